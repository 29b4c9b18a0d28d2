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
paper's p + 1 and p + 2 micro-batches of activations come from). The pipeline executor runs exactly those
action lists on p processes with the ``VocabPasses`` hook (``vocab_passes``: ``VocabStage``, a rank's blocks
and its rows of both tables; C0 on a comm thread, every collective asynchronous and issued in micro-batch
order per process group on every rank). What each rank sends per micro-batch: ``collective_bytes``.

For settings this machine cannot hold: the cost model (``vocab_costs``, re-exported here: ``pass_ops``,
``stage_costs`` on a ``toolkit.runtime.cluster.Cluster``, its GPU's achieved rates) gives per-stage seconds for the baseline layout (embedding on stage 0,
head on stage p-1) and for vocabulary parallelism, and ``simulate_layouts`` times both layouts with
``toolkit.pipeline.simulate``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from toolkit.pipeline.schedule import Action, Schedule, linear_layout, one_f_one_b
from toolkit.pipeline.simulate import simulate
from toolkit.pipeline.vocab_costs import (Workload, from_rates, gpt, op_time, pass_ops, stage_costs,  # noqa: F401
                                          stage_flops)

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
    """This rank's logits and softmax statistics, in fp32 (as Megatron's). x [N,D], weight [V/p,D], target [N]"""
    Y = (x @ weight.t()).float()  # [N,V/p]
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
        st.G = P.to(weight.dtype) @ weight  # [N,D]
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
    """Algorithm 2: dX = g * sum_i (alpha_i G_i - H_i), right after C0 (no T pass needed). [N,D], X's dtype"""
    dx = ((st.alpha[:, None] * st.G - st.H) * grad_scale).to(st.x.dtype)
    dist.all_reduce(dx, group=group)
    return dx


def t_pass(st: SState, weight: torch.Tensor, grad_scale: float, algorithm: int) -> torch.Tensor | None:
    """dW_i into ``weight.grad``; Algorithm 1 also returns this rank's dX_i (to be summed by ``c1``)."""
    dY = st.alpha[:, None] * st.P  # softmax_i [N,V/p]
    rows = torch.arange(dY.shape[0], device=dY.device)
    dY[rows, st.local_target] -= st.inside.to(dY.dtype)  # onehot_i: no shape that depends on the targets
    dY = (dY * grad_scale).to(st.x.dtype)
    dW = dY.t() @ st.x  # [V/p,D]
    weight.grad = dW if weight.grad is None else weight.grad + dW
    return dY @ weight if algorithm == 1 else None


def state_bytes(st: SState) -> int:
    """Bytes an S pass keeps alive until its T pass."""
    return sum(t.numel() * t.element_size() for t in (st.x, st.P, st.m, st.s, st.z, st.G, st.H) if t is not None)


def collective_bytes(p: int, tokens: int, d_model: int, algorithm: int, elem_bytes: int = 4) -> dict[str, int]:
    """Bytes one rank sends per micro-batch on each collective of the vocabulary layers, by ``"group:op"`` (the
    ledger's convention: a ring all-reduce of S bytes sends 2(p-1)/p·S, a broadcast S on every rank).
    N = ``tokens`` per micro-batch, D = ``d_model``, e = ``elem_bytes``::

        input:all_reduce   the partial embeddings E_i [N, D]          2(p-1)/p · N·D·e
        input:broadcast    dE [N, D] from stage 0                     N·D·e
        x:broadcast        X [N, D] from the last stage               N·D·e
        c0:all_reduce      max m [N], then [s, z] [2, N]              2(p-1)/p · N·e + 2(p-1)/p · 2N·e
        dx:all_reduce      Algorithm 2: the fused dX [N, D]           2(p-1)/p · N·D·e
        c1:all_reduce      Algorithm 1: dX = Σ dX_i [N, D]            2(p-1)/p · N·D·e
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm={algorithm!r}; allowed: {ALGORITHMS}")
    ring = lambda size: 2 * (p - 1) * size // p  # noqa: E731
    act = tokens * d_model * elem_bytes
    return {"input:all_reduce": ring(act), "input:broadcast": act, "x:broadcast": act,
            "c0:all_reduce": ring(tokens * elem_bytes) + ring(2 * tokens * elem_bytes),
            ("dx" if algorithm == 2 else "c1") + ":all_reduce": ring(act)}


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
    starts after the last S(., i) ends; a pass that B(last, i) waits for (S, and Algorithm 1's T) goes before
    B(q, i) at the latest, which waits for B(last, i) (at skewed costs the rule alone could put it after)::

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
                if op == "S" or algorithm == 1:  # B(last, i) needs it, and B(q, i) needs B(last, i)
                    pos = min(pos, sched.ranks[q].index(Action("B", q, i)))
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
                     comm: float = 0.0, schedule: VocabSchedule | None = None) -> dict:
    """Simulate the baseline (1F1B, vocabulary on the first/last stage) and vocabulary parallelism
    (``vocab_1f1b``) from per-stage costs; returns both ``SimResult`` and the throughput ratio. ``schedule``: the
    vocabulary schedule to time (None: ``vocab_1f1b``'s from these costs; a replay on other figures keeps the
    action lists that ran)."""
    p = len(rows_base)
    base = simulate(one_f_one_b(p, m), StageCosts(rows_base, comm))
    costs = StageCosts(rows_vocab, comm)
    sched = schedule or vocab_1f1b(p, m, algorithm, costs)
    ours = simulate(sched, costs)
    return {"baseline": base, "vocab": ours, "schedule": sched, "speedup": base.makespan / ours.makespan}
