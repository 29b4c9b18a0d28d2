"""Vocabulary parallelism: the embedding and the output layer split over all pipeline stages
(Yeung, Qi, Lin, Wan, MLSys 2025).

In a plain pipeline the first stage carries the input embedding and the last the output head and its
softmax; at V = 256k the head alone costs as much as several transformer layers, so the last stage sets the
pace of the whole pipeline. Here every one of the p ranks holds V/p rows of both tables and the vocabulary
work becomes three small passes on every rank, glued by a few collectives::

    input layer      every rank: partial embedding E_i[idx] (zero for ids outside its rows) ── all-reduce SUM
                     (stage 0 uses the sum; the paper reduces to stage 0, half the bytes, but the ledger
                     does not count dist.reduce) ;  backward: stage 0 broadcasts dE ──► each rank's rows

    output layer     last stage: X = ln_f(h)  ── broadcast X [N,D] ──► every rank
      S pass (rank i)  Y_i = X W_i^T               [N,V/p]
                       m_i = rowmax Y_i, s_i = sum exp(Y_i - m_i), P_i = exp(Y_i - m_i)/s_i, z_i = Y_i[target] or 0
                       (Algorithm 2 also) G_i = P_i W_i  [N,D],  H_i = W_i[target] or 0  [N,D]
      C0 barrier       m = all-reduce MAX m_i;  [s, z] = all-reduce SUM [s_i e^(m_i-m), z_i]
                       loss = log s + m - z ;  alpha_i = s_i e^(m_i-m) / s        (softmax_i = alpha_i P_i)
                       (Algorithm 2) dX = g * all-reduce SUM (alpha_i G_i - H_i)  ──► last stage's backward
      T pass (rank i)  dY_i = g (alpha_i P_i - onehot_i);  dW_i = dY_i^T X
                       (Algorithm 1) dX_i = dY_i W_i;  C1 barrier: dX = all-reduce SUM dX_i ──► last stage

Algorithm 1 waits for the T pass before the last stage can start its backward (two barriers); Algorithm 2
precomputes G_i, H_i in the S pass (N*D more memory per micro-batch) so dX is ready right after C0 and the
T pass only produces dW (one barrier). Both give the unsharded loss and gradients up to summation order.

The schedule: ``vocab_1f1b`` weaves the S/T passes into 1F1B as actions of ``toolkit.pipeline.schedule``
(``VocabSchedule``: a warm-up one forward longer for Algorithm 2, two for Algorithm 1, which is where the
paper's p + 1 and p + 2 micro-batches of activations come from). ``VocabExecutor`` runs exactly those action
lists on p processes (``VocabStage``: a rank's blocks and its rows of both tables; C0 on a comm thread, every
collective asynchronous and issued in micro-batch order per process group on every rank).

For settings this machine cannot hold: the cost model (``vocab_costs``, re-exported here: ``pass_ops``,
``stage_costs`` on a ``Hardware``) gives per-stage seconds for the baseline layout (embedding on stage 0,
head on stage p-1) and for vocabulary parallelism, and ``simulate_layouts`` times both layouts with
``toolkit.pipeline.simulate``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from toolkit.pipeline.executor import ActivationMeter, PipelineExecutor, _finished, key_of
from toolkit.pipeline.schedule import Action, Schedule, linear_layout, one_f_one_b
from toolkit.pipeline.simulate import simulate
from toolkit.pipeline.vocab_costs import (A100, Hardware, Workload, comm_time, op_time, pass_ops,  # noqa: F401
                                          stage_costs, stage_flops)

ALGORITHMS = (1, 2)


def shard_rows(vocab_size: int, p: int, rank: int) -> tuple[int, int]:
    """[lo, hi) rows of the vocabulary held by ``rank`` of ``p``; raises unless p divides V."""
    if vocab_size % p:
        lo, hi = (vocab_size // p) * p, (vocab_size // p + 1) * p
        raise ValueError(f"vocab_size={vocab_size} is not divisible by the {p} pipeline stages; "
                         f"use a multiple of {p} (e.g. {lo} or {hi}), as Megatron pads the vocabulary")
    per = vocab_size // p
    return rank * per, (rank + 1) * per


# ---------------------------------------------------------------------------------------------
# Input layer
# ---------------------------------------------------------------------------------------------
def partial_embedding(weight: torch.Tensor, idx: torch.Tensor, lo: int) -> torch.Tensor:
    """Rows of ``weight`` (the shard [lo, lo+V/p)) for the ids it holds, zeros elsewhere. [B,T] -> [B,T,D]"""
    local = idx - lo
    inside = (local >= 0) & (local < weight.shape[0])
    # masked_fill keeps only the mask for its backward (a product would keep the [B,T,D] rows too)
    return F.embedding(local.clamp(0, weight.shape[0] - 1), weight).masked_fill(~inside.unsqueeze(-1), 0.0)


def embed_forward(weight: torch.Tensor, idx: torch.Tensor, lo: int, group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial with its graph, summed embedding [B,T,D] detached). Collective: every rank calls it."""
    partial = partial_embedding(weight, idx, lo)
    full = partial.detach().clone()
    dist.all_reduce(full, group=group)
    return partial, full


def embed_backward(partial: torch.Tensor, d_embed: torch.Tensor, src: int, group=None) -> None:
    """Broadcast dE from stage 0 (``src``, global rank) and push it into this rank's rows. Collective."""
    dist.broadcast(d_embed, src=src, group=group)
    partial.backward(d_embed)


# ---------------------------------------------------------------------------------------------
# Output layer: S pass, C0, T pass (C1)
# ---------------------------------------------------------------------------------------------
@dataclass
class SState:
    """What the S pass of one micro-batch keeps on rank i until its T pass."""

    x: torch.Tensor  # [N,D]
    target: torch.Tensor  # [N] global ids
    inside: torch.Tensor  # [N] bool: target in this shard
    local_target: torch.Tensor  # [N] clamped local row
    P: torch.Tensor  # [N,V/p] local softmax exp(Y_i - m_i)/s_i
    m: torch.Tensor  # [N] local row max
    s: torch.Tensor  # [N] local sum exp(Y_i - m_i)
    z: torch.Tensor  # [N] target logit if in shard else 0
    G: torch.Tensor | None = None  # [N,D] P_i W_i (Algorithm 2)
    H: torch.Tensor | None = None  # [N,D] W_i[target] or 0 (Algorithm 2)
    alpha: torch.Tensor | None = None  # [N] set by C0


def s_pass(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, lo: int, algorithm: int) -> SState:
    """Local logits and softmax statistics of this rank's vocabulary rows. x [N,D], weight [V/p,D], target [N]"""
    Y = x @ weight.t()  # [N,V/p]
    m = Y.max(dim=1).values  # [N]
    e = torch.exp(Y - m[:, None])
    s = e.sum(dim=1)
    P = e / s[:, None]
    local = target - lo
    inside = (local >= 0) & (local < weight.shape[0])
    local = local.clamp(0, weight.shape[0] - 1)
    z = Y.gather(1, local[:, None]).squeeze(1) * inside
    st = SState(x, target, inside, local, P, m, s, z)
    if algorithm == 2:
        st.G = P @ weight  # [N,D]
        st.H = weight[local] * inside[:, None]  # [N,D]
    return st


def c0(st: SState, group=None) -> torch.Tensor:
    """The first barrier: global max, sum and target logit; sets ``st.alpha``; returns per-token loss [N]."""
    m = st.m.clone()
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    scaled = st.s * torch.exp(st.m - m)  # s_i e^(m_i - m)
    packed = torch.stack([scaled, st.z])  # [2,N]: one all-reduce for both sums
    dist.all_reduce(packed, group=group)
    s, z = packed
    st.alpha = scaled / s
    return torch.log(s) + m - z


def dx_fused(st: SState, grad_scale: float, group=None) -> torch.Tensor:
    """Algorithm 2: dX = g * sum_i (alpha_i G_i - H_i), right after C0 (no T pass needed). [N,D]"""
    dx = (st.alpha[:, None] * st.G - st.H) * grad_scale
    dist.all_reduce(dx, group=group)
    return dx


def t_pass(st: SState, weight: torch.Tensor, grad_scale: float, algorithm: int) -> torch.Tensor | None:
    """dW_i into ``weight.grad``; Algorithm 1 also returns this rank's dX_i (to be summed by ``c1``)."""
    dY = st.alpha[:, None] * st.P  # softmax_i [N,V/p]
    rows = torch.arange(dY.shape[0], device=dY.device)
    dY[rows[st.inside], st.local_target[st.inside]] -= 1.0
    dY *= grad_scale
    dW = dY.t() @ st.x  # [V/p,D]
    weight.grad = dW if weight.grad is None else weight.grad + dW
    return dY @ weight if algorithm == 1 else None


def c1(dx_i: torch.Tensor, group=None) -> torch.Tensor:
    """Algorithm 1's second barrier: dX = all-reduce SUM dX_i."""
    dist.all_reduce(dx_i, group=group)
    return dx_i


def state_bytes(st: SState) -> int:
    """Bytes an S pass keeps alive until its T pass."""
    return sum(t.numel() * t.element_size() for t in (st.x, st.P, st.m, st.s, st.z, st.G, st.H) if t is not None)


# ---------------------------------------------------------------------------------------------
# Schedules for the simulator: 1F1B with the vocabulary passes woven in
# ---------------------------------------------------------------------------------------------
@dataclass
class VocabSchedule(Schedule):
    """1F1B plus ``S``/``T`` actions (``stage`` = the vocabulary shard = the rank) and their barriers::

        S(q, mb)        <- F(last stage, mb)                  X is broadcast from the last stage
        T(q, mb)        <- S(every shard, mb)                 C0
        B(last, mb)     <- S(every shard, mb)   Algorithm 2   C0 + the fused dX all-reduce
                        <- T(every shard, mb)   Algorithm 1   C1 needs every T pass
    """

    algorithm: int = 2
    placed: float = float("inf")
    """While ``vocab_1f1b`` builds it: micro-batches < placed have their S (and, past +0.5, T) actions."""

    def deps(self, a: Action) -> list[tuple[str, int, int, int]]:
        last = self.n_stages - 1
        shards = lambda op: [(op, q, a.mb, 0) for q in range(self.p)]
        if a.op == "S":
            return [("F", last, a.mb, 0)]
        if a.op == "T":
            return shards("S")
        out = super().deps(a)
        if a.op == "B" and a.stage == last:
            if self.algorithm == 2 and a.mb < self.placed:
                out += shards("S")
            if self.algorithm == 1 and a.mb + 0.5 < self.placed:
                out += shards("T")
        return out


def vocab_1f1b(p: int, m: int, algorithm: int, costs) -> VocabSchedule:
    """1F1B with the vocabulary passes woven in, each placed on every rank as soon as it is ready.

    Start from 1F1B whose warm-up is ``extra`` forwards longer (1 for Algorithm 2, 2 for Algorithm 1:
    while the vocabulary passes of micro-batch i run, the last stage runs the forward of i+1 (and i+2)
    instead of waiting, which is where the paper's p+1 and p+2 micro-batches of activations come from).
    Then for i = 0..m-1 simulate (``costs``: anything ``simulate`` takes) and insert S(q, i) on every
    rank q before its first action that starts after F(last, i) ends, and T(q, i) before the first that
    starts after the last S(., i) ends::

        rank q:  .. F B F [S(i)] B F [T(i)] B ..        S(i) ready: X of micro-batch i broadcast
                                                        T(i) ready: C0 done on every rank
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm={algorithm!r}; allowed: {ALGORITHMS}")
    if not isinstance(m, int) or m < p:
        raise ValueError(f"m={m!r} micro-batches: must be an int >= p={p}")
    extra = 3 - algorithm
    ranks = []
    for r in range(p):
        warmup = min(p - r - 1 + extra, m)
        acts = [Action("F", r, i) for i in range(warmup)]
        for i in range(m - warmup):
            acts += [Action("F", r, warmup + i), Action("B", r, i)]
        ranks.append(acts + [Action("B", r, i) for i in range(m - warmup, m)])
    sched = VocabSchedule(f"vocab-{algorithm}", ranks, linear_layout(p), m, algorithm=algorithm, placed=0)
    comm = getattr(costs, "comm", 0.0)
    for i in range(m):
        for op in ("S", "T"):
            res = simulate(sched, costs)
            ends = {(s["kind"], s["meta"]["stage"], s["meta"]["mb"]): s["end"] for s in res.spans}
            ready = ends[("F", p - 1, i)] if op == "S" else max(ends[("S", q, i)] for q in range(p))
            for q in range(p):
                starts = [s["start"] for s in res.spans if s["rank"] == q]  # in list order
                after_vocab = max((n + 1 for n, a in enumerate(sched.ranks[q]) if a.op in "ST"), default=0)
                pos = next((n for n in range(after_vocab, len(starts))
                            if starts[n] >= ready + (comm if q != p - 1 else 0.0)), len(starts))
                sched.ranks[q].insert(pos, Action(op, q, i))
            sched.placed = i + 1 if op == "T" else i + 0.5
    return sched.check()


class StageCosts:
    """``action -> seconds`` from per-stage rows of ``stage_costs`` (or measured), for ``simulate``."""

    def __init__(self, rows: list[dict[str, float]], comm: float = 0.0):
        self.rows, self.comm = rows, comm

    def __call__(self, a: Action) -> float:
        return self.rows[a.stage][a.op]


def simulate_layouts(rows_base: list[dict], rows_vocab: list[dict], m: int, algorithm: int = 2,
                     comm: float = 0.0) -> dict:
    """Simulate the baseline (1F1B, vocabulary on the first/last stage) and vocabulary parallelism
    (``vocab_1f1b``) from per-stage costs; returns both ``SimResult`` and the throughput ratio."""
    p = len(rows_base)
    base = simulate(one_f_one_b(p, m), StageCosts(rows_base, comm))
    costs = StageCosts(rows_vocab, comm)
    sched = vocab_1f1b(p, m, algorithm, costs)
    ours = simulate(sched, costs)
    return {"baseline": base, "vocab": ours, "schedule": sched, "speedup": base.makespan / ours.makespan}


# ---------------------------------------------------------------------------------------------
# Running it for real: the pipeline executor with S and T actions
# ---------------------------------------------------------------------------------------------
GROUPS = ("input", "x", "c0", "dx", "c1")
"""One process group per stream of collectives. Inside a group every rank issues in micro-batch order, whatever
its own action order, so the collectives match; groups never wait on each other."""


def vocab_groups(peers: list[int]) -> dict[str, object]:
    """The process groups ``VocabExecutor`` issues its collectives on. Collective: every rank calls it."""
    return {name: dist.new_group(peers) for name in GROUPS}


class VocabStage(nn.Module):
    """Rank r's share of a ``toolkit.models.GPT`` under vocabulary parallelism::

        stage 0      x = E (token embedding, summed over ranks) + pos ─► its blocks
        stage r      its blocks (n_layer / p of them)
        stage p-1    its blocks ─► X = ln_f(h)
        every rank   tok, out: rows [lo, hi) of the token table and of the output layer

    Blocks, ``pos`` and ``ln_f`` are the model's own modules (parameters shared with it); ``tok`` and ``out`` are
    copies of this rank's rows, the vocabulary parameters this rank owns.
    """

    def __init__(self, model: nn.Module, rank: int, p: int):
        super().__init__()
        n_layer = len(model.blocks)
        if n_layer % p:
            raise ValueError(f"n_layer={n_layer} must be divisible by the {p} pipeline stages")
        per = n_layer // p
        self.lo, self.hi = shard_rows(model.cfg.vocab_size, p, rank)
        self.blocks = nn.ModuleList(model.blocks[rank * per:(rank + 1) * per])
        self.pos = model.embed.pos if rank == 0 else None
        self.ln_f = model.head.ln_f if rank == p - 1 else None
        self.tok = nn.Parameter(model.embed.tok.weight[self.lo:self.hi].detach().clone())  # [V/p, D]
        self.out = nn.Parameter(model.head.out.weight[self.lo:self.hi].detach().clone())  # [V/p, D]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B,T,D] -> [B,T,D]
        if self.pos is not None:
            x = x + self.pos(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x) if self.ln_f is not None else x


class _ToShards(torch.autograd.Function):
    """Where the last stage's output X leaves the graph for the vocabulary passes of every rank. Its backward
    brings dX back from them (``VocabExecutor.output_grad``), so the last stage's B is a plain backward."""

    @staticmethod
    def forward(ctx, X, executor, mb):
        ctx.executor, ctx.mb, ctx.shape = executor, mb, X.shape
        return X.new_zeros(())

    @staticmethod
    def backward(ctx, _):
        return ctx.executor.output_grad(ctx.mb).view(ctx.shape), None, None


class VocabExecutor(PipelineExecutor):
    """``PipelineExecutor`` for a ``VocabSchedule``: its S and T actions run on every rank, the input layer
    around the step, the collectives asynchronously. Where each piece runs and what it waits for (every wait
    is recorded in ``waits`` with its seconds: the exposed communication)::

        step start   all ranks  partial embedding of every micro-batch; all-reduce each      async "input"
        F(0, i)      rank 0     wait E_i ("E"); x = E_i + pos ─► blocks
        F(last, i)   last rank  X_i = ln_f(blocks(x)); broadcast X_i                         async "x" (root)
        S(q, i)      rank q     wait X_i ("X"; posted one action ahead); S pass; state to the comm thread
        comm thread  each rank  C0: all-reduce max m, all-reduce [s, z]                          "c0"
                                Algorithm 2: dX = g Σ_i (α_i G_i - H_i)                          "dx"
                                one micro-batch after another, while the main thread computes
        T(q, i)      rank q     wait C0_i ("C0"); T pass: dW_i; Algorithm 1: all-reduce dX_i   async "c1"
        B(last, i)   last rank  its backward pulls dX_i: Algorithm 2 waits "dX", Algorithm 1 "C1"
        B(0, i)      rank 0     dE_i = grad of E_i; broadcast it                       async "input" (root)
        step end     all ranks  wait the dE broadcasts, push dE into the token rows; finish the comm thread

    The comm thread is the CPU counterpart of the paper's side stream for C0 (on CUDA it runs its kernels on a
    side stream). Each group's collectives are issued in micro-batch order on every rank (``collectives``
    records (group, "what micro-batch") in issue order), so they match whatever a rank's action order is.

    The input layer runs ahead: the tokens are known before the step, so rank 0's summed embeddings of all m
    micro-batches wait for their forward (m·N·D floats, not counted below). Counted:
    ``meter`` (as in ``PipelineExecutor``) the stage activations, F to B, including the embedding E_i that
    stage 0 differentiates; ``vocab_meter`` what an S pass keeps until its T pass; ``peak_total`` the largest
    sum of both after any op; ``peak_held`` the most micro-batches whose stage activations were held at once;
    ``forward_bytes`` the saved bytes of each forward. ``step`` returns the mean loss on every rank.
    """

    OPS = {**PipelineExecutor.OPS, "S": "vocab_s", "T": "vocab_t"}

    def __init__(self, schedule: VocabSchedule, rank: int, stage: VocabStage, act_shape: tuple[int, int, int],
                 groups: dict[str, object], **kwargs):
        if not isinstance(schedule, VocabSchedule):
            raise ValueError(f"VocabExecutor runs a VocabSchedule (vocab_1f1b), got {type(schedule).__name__}")
        missing = sorted(set(GROUPS) - set(groups))
        if missing:
            raise ValueError(f"groups lacks {missing}; make them with vocab_groups(peers)")
        super().__init__(schedule, rank, {rank: stage}, None, act_shape, **kwargs)
        self.stage, self.algorithm, self.groups = stage, schedule.algorithm, groups
        self.vocab_meter = ActivationMeter(stage.parameters())
        if self.device.type == "cuda":
            self._side = torch.cuda.Stream(self.device)
        self.collectives: list[tuple[str, str]] = []
        self.comm_spans: list[dict] = []

    # -- collectives ------------------------------------------------------------------------------
    def _issue(self, group: str, what: str, fn, *args, **kwargs):
        self.collectives.append((group, what))
        return fn(*args, group=self.groups[group], **kwargs)

    def _wait(self, what: str, mb: int, work) -> None:
        start = time.perf_counter()
        work.wait() if hasattr(work, "wait") else work.result()
        end = time.perf_counter()
        self.waits.append({"msg": what, "stage": self.rank, "mb": mb, "chunk": 0, "seconds": end - start,
                           "pair": False,
                           **({"start": start - self.timeline.origin} if self.timeline is not None else {})})

    def _on_comm_thread(self, what: str, mb: int, fn):
        """Run ``fn`` on the comm thread after everything queued before it (FIFO, one worker)."""
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()

        @torch.no_grad()  # grad mode is per thread: the passes compute their gradients by hand
        def job():
            start = time.perf_counter()
            if event is None:
                out = fn()
            else:  # its kernels on a side stream, after the main stream's work so far; done when it returns
                torch.cuda.set_device(self.device)
                with torch.cuda.stream(self._side):
                    self._side.wait_event(event)
                    out = fn()
                    self._side.synchronize()
            self.comm_spans.append({"kind": what, "mb": mb, "start": start - self._origin,
                                    "end": time.perf_counter() - self._origin})
            return out

        return self._pool.submit(job)

    # -- the input layer ----------------------------------------------------------------------------
    def _input_forward(self, inputs: list[torch.Tensor]) -> None:
        for mb, idx in enumerate(inputs):
            partial = partial_embedding(self.stage.tok, idx, self.stage.lo)  # [B,T,D], graph to the token rows
            full = partial.detach().clone()
            self._partials[mb] = partial
            self._embeds[mb] = (self._issue("input", f"E {mb}", dist.all_reduce, full, async_op=True), full)
        if self.rank != 0:  # dE of each micro-batch comes from rank 0, in micro-batch order
            for mb, idx in enumerate(inputs):
                buf = torch.empty(self.act_shape, dtype=self.dtype, device=self.device)
                self._dE[mb] = (self._issue("input", f"dE {mb}", dist.broadcast, buf, src=self.peers[0],
                                            async_op=True), buf)

    def _embedding(self, mb: int) -> torch.Tensor:
        work, full = self._embeds.pop(mb)
        self._wait("E", mb, work)
        self._E[mb] = full.requires_grad_()
        return full

    def _input_backward(self, mb: int) -> None:
        """Rank 0, after B(0, mb): dE to every rank (async), and into rank 0's own rows."""
        dE = self._E.pop(mb).grad
        self._dE[mb] = (self._issue("input", f"dE {mb}", dist.broadcast, dE, src=self.peers[0], async_op=True), dE)
        self._partials.pop(mb).backward(dE)

    # -- the ops ------------------------------------------------------------------------------------
    def stage_fn(self, a: Action):
        module, mb = self.modules[a.stage], a.mb

        def fn(x: torch.Tensor) -> torch.Tensor:
            if a.stage == 0:  # x are token ids: the input layer's summed embedding replaces them
                x = self._embedding(mb)
                self.hold(key_of(a), [x])  # alive until B (its gradient is dE)
            X = module(x)
            if a.stage != self.last:
                return X
            self._X_out[mb] = X.detach()
            return _ToShards.apply(X, self, mb)

        return fn

    def forward(self, a: Action) -> None:
        before = self.meter.live if self.meter else 0
        super().forward(a)
        if self.meter:
            self.forward_bytes.append(self.meter.live - before)
        self._held += 1
        self.peak_held = max(self.peak_held, self._held)
        if a.stage == self.last:  # X to every rank for its S pass (root of the broadcast)
            X = self._X_out[a.mb]
            self._x_root.append((self._issue("x", f"X {a.mb}", dist.broadcast, X, src=self.peers[self.rank],
                                             async_op=True), X))

    def after_backward(self, a: Action) -> None:
        self._held -= 1
        if a.stage == 0:
            self._input_backward(a.mb)

    def _post_x(self, mb: int) -> None:
        if mb not in self._x_in and self.rank != self.schedule.stage_rank[self.last]:
            buf = torch.empty(self.act_shape, dtype=self.dtype, device=self.device)
            last = self.peers[self.schedule.stage_rank[self.last]]
            self._x_in[mb] = (self._issue("x", f"X {mb}", dist.broadcast, buf, src=last, async_op=True), buf)

    @torch.no_grad()  # the vocabulary passes compute their gradients by hand: no graph to keep
    def vocab_s(self, a: Action) -> None:
        """S: this rank's logits, softmax statistics (and Algorithm 2's G, H); C0 goes to the comm thread."""
        mb = a.mb
        if mb in self._X_out:
            X = self._X_out.pop(mb)
        else:
            self._post_x(mb)
            work, X = self._x_in.pop(mb)
            self._wait("X", mb, work)
        N, D = X.shape[0] * X.shape[1], X.shape[2]
        st = s_pass(X.reshape(N, D), self.stage.out, self._targets[mb].reshape(-1), self.stage.lo, self.algorithm)
        self.vocab_meter.hold(("S", mb), [t for t in (st.x, st.P, st.m, st.s, st.z, st.G, st.H) if t is not None])
        self._state[mb] = st
        self._grad_scale = 1.0 / (N * self.schedule.m)  # the mean over every token of every micro-batch
        self._c0[mb] = self._on_comm_thread("C0", mb, lambda: self._c0_job(mb, st))
        if self.algorithm == 2:
            self._dx[mb] = self._on_comm_thread("dX", mb, lambda: self._issue("dx", f"dX {mb}", dx_fused, st,
                                                                               self._grad_scale))

    def _c0_job(self, mb: int, st: SState) -> torch.Tensor:
        self.collectives.append(("c0", f"C0 {mb}"))
        return c0(st, group=self.groups["c0"])

    @torch.no_grad()
    def vocab_t(self, a: Action) -> None:
        """T: wait for C0, then dW of this rank's rows (Algorithm 1 also its dX share, all-reduced async)."""
        mb = a.mb
        future = self._c0.pop(mb)
        self._wait("C0", mb, future)
        self._loss += float(future.result().mean()) / self.schedule.m
        st = self._state.pop(mb)
        dx_i = t_pass(st, self.stage.out, self._grad_scale, self.algorithm)
        if self.algorithm == 1:
            self._c1[mb] = (self._issue("c1", f"C1 {mb}", dist.all_reduce, dx_i, async_op=True), dx_i)
        self.vocab_meter.release(("S", mb))

    def output_grad(self, mb: int) -> torch.Tensor:
        """dX of micro-batch ``mb`` for the last stage's backward: Algorithm 2's fused all-reduce (after C0),
        or Algorithm 1's C1 (after every T pass)."""
        if self.algorithm == 2:
            future = self._dx.pop(mb)
            self._wait("dX", mb, future)
            return future.result()
        work, dx = self._c1.pop(mb)
        self._wait("C1", mb, work)
        return dx

    def after_op(self, a: Action) -> None:
        live = (self.meter.live if self.meter else 0) + self.vocab_meter.live
        self.peak_total = max(self.peak_total, live)

    def after_action(self, action: Action) -> None:
        self._done += 1
        acts = self.schedule.ranks[self.rank]
        if self._done < len(acts) and acts[self._done].op == "S":
            self._post_x(acts[self._done].mb)  # X arrives while this rank computes something else
        self._x_root = [(w, t) for w, t in self._x_root if not _finished(w)]

    # -- the step -----------------------------------------------------------------------------------
    def step(self, inputs: list[torch.Tensor], targets: list[torch.Tensor]) -> float:
        """One training step (gradients accumulate); returns the mean loss, on every rank."""
        from concurrent.futures import ThreadPoolExecutor

        self._origin = self.timeline.origin if self.timeline is not None else time.perf_counter()
        self._partials, self._embeds, self._E, self._dE = {}, {}, {}, {}
        self._X_out, self._x_in, self._x_root = {}, {}, []
        self._state, self._c0, self._dx, self._c1 = {}, {}, {}, {}
        self._loss, self._done, self._held, self.peak_held, self.peak_total = 0.0, 0, 0, 0, 0
        self.collectives, self.comm_spans, self.forward_bytes = [], [], []
        self.vocab_meter = ActivationMeter(self.stage.parameters())
        self._input_forward(inputs)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vocab-comm")
        try:
            super().step(inputs, targets)
        except BaseException:
            self._pool.shutdown(wait=False, cancel_futures=True)
            raise
        self._pool.shutdown(wait=True)
        for mb, (work, dE) in sorted(self._dE.items()):
            work.wait()
            if self.rank != 0:
                self._partials.pop(mb).backward(dE)
        if self.rank != self.schedule.stage_rank[self.last]:  # dX is the last stage's; the others contributed
            for future in self._dx.values():
                future.result()  # raises what the comm thread raised
            self._dx = {}
        if self.rank != 0:  # the summed embeddings are rank 0's input; the other ranks only contributed
            self._x_root += list(self._embeds.values())
            self._embeds = {}
        for work, _ in self._x_root + list(self._c1.values()):
            work.wait()
        left = {name: len(d) for name, d in (("partials", self._partials), ("embeddings", self._embeds),
                                             ("S states", self._state), ("C0", self._c0), ("dX", self._dx))
                if d}
        if left:
            raise RuntimeError(f"rank {self.rank}: vocabulary step ended with unconsumed {left}")
        return self._loss
