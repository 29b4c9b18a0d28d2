"""Vocabulary parallelism run for real: the pipeline executor's hook for the S and T passes and the input layer.

``vocab_parallel`` has the maths (S pass, C0, T pass, the partial embedding), the schedule (``vocab_1f1b``:
1F1B with S and T actions) and its simulation; this module runs that schedule on p processes::

    VocabStage     rank r's share of the GPT: its blocks, and rows [lo, hi) of the token table and of the
                   output layer (every rank holds V/p rows of both)
    vocab_groups   one process group per stream of collectives (input, x, c0, dx, c1)
    VocabPasses    the ``ExecutorHook``: S and T as ops, the stage forward that swaps token ids for the summed
                   embedding and hands the last stage's output to the passes, the comm thread for C0

Composition is the executor's list of hooks, e.g. with activation offload
``hooks=[VocabPasses(stage, groups), Offload(offloader)]`` (``toolkit.compose``).
"""
from __future__ import annotations

import contextlib
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist
import torch.nn as nn

from toolkit.pipeline.executor import ActivationMeter, ExecutorHook, completed, key_of
from toolkit.pipeline.schedule import Action
from toolkit.pipeline.vocab_parallel import (SState, VocabSchedule, c0, dx_fused, partial_embedding, s_pass,
                                             shard_rows, t_pass)
from toolkit.runtime.portable import Handoff, handoff, join, on_side_thread, virtual_seconds

GROUPS = ("input", "x", "c0", "dx", "c1")
"""One process group per stream of collectives. Inside a group every rank issues in micro-batch order, whatever
its own action order, so the collectives match; groups never wait on each other."""


def vocab_groups(peers: list[int]) -> dict[str, object]:
    """The process groups ``VocabPasses`` issues its collectives on. Collective: every rank calls it."""
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
    brings dX back from them (``VocabPasses.output_grad``), so the last stage's B is a plain backward."""

    @staticmethod
    def forward(ctx, X, passes, mb):
        ctx.passes, ctx.mb, ctx.shape = passes, mb, X.shape
        return X.new_zeros(())

    @staticmethod
    def backward(ctx, _):
        return ctx.passes.output_grad(ctx.mb).view(ctx.shape), None, None


class _CommJob:
    """A job on the comm thread. ``wait()`` blocks until it has run and continues after its end (``join``: the
    CUDA code blocks the same way, the job synchronizes its side stream before it returns; on an emulated cluster
    this thread's clock moves to the job's virtual end); ``result()`` is its value."""

    def __init__(self, future, token: Handoff):
        self.future, self.token = future, token

    def wait(self) -> None:
        self.future.result()
        join(self.token)

    def result(self):
        return self.future.result()


class VocabPasses(ExecutorHook):
    """The pipeline executor's hook for a ``VocabSchedule``: its S and T actions on every rank, the input layer
    around the step, the collectives asynchronously::

        stage = VocabStage(model, rank, p)
        passes = VocabPasses(stage, vocab_groups(peers))
        loss = PipelineExecutor(vocab_1f1b(p, m, 2, costs), rank, {rank: stage}, None, act_shape,
                                hooks=[passes]).step(inputs, targets)      # the mean loss, on every rank

    Where each piece runs and what it waits for (every wait is recorded in the executor's ``waits`` with its
    seconds: the exposed communication)::

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
    side stream). A job is handed over (``toolkit.runtime.portable.handoff``, ``on_side_thread``, ``join``): on an
    emulated cluster it carries the virtual time it was handed (its ops and collectives on its own clock), and a
    wait for its result moves the waiting thread to the job's end. Each group's collectives are issued in
    micro-batch order on every rank (``collectives`` records (group, "what micro-batch") in issue order), so they
    match whatever a rank's action order is.

    The input layer runs ahead: the tokens are known before the step, so rank 0's summed embeddings of all m
    micro-batches wait for their forward (m·N·D floats, not counted below). Counted: the executor's ``meter``
    the stage activations, F to B, including the embedding E_i that stage 0 differentiates; ``vocab_meter``
    what an S pass keeps until its T pass; ``peak_total`` the largest sum of both after any op; ``peak_held``
    the most micro-batches whose stage activations were held at once; ``forward_bytes`` the saved bytes of each
    forward. The step's loss (``step_end``) is the mean loss, on every rank.
    """

    def __init__(self, stage: VocabStage, groups: dict[str, object]):
        missing = sorted(set(GROUPS) - set(groups))
        if missing:
            raise ValueError(f"groups lacks {missing}; make them with vocab_groups(peers)")
        self.stage, self.groups = stage, groups
        self.collectives: list[tuple[str, str]] = []
        self.comm_spans: list[dict] = []

    def bind(self, executor) -> None:
        if not isinstance(executor.schedule, VocabSchedule):
            raise ValueError(f"VocabPasses runs a VocabSchedule (vocab_1f1b), got {type(executor.schedule).__name__}")
        super().bind(executor)
        self.algorithm = executor.schedule.algorithm
        self.vocab_meter = ActivationMeter(self.stage.parameters())
        self._side = torch.cuda.Stream(executor.device) if executor.device.type == "cuda" else None

    def ops(self):
        return {"S": self.vocab_s, "T": self.vocab_t}

    # -- collectives ------------------------------------------------------------------------------
    def _issue(self, group: str, what: str, fn, *args, **kwargs):
        self.collectives.append((group, what))
        return fn(*args, group=self.groups[group], **kwargs)

    def _wait(self, what: str, mb: int, work) -> None:
        timeline = self.executor.timeline
        start = time.perf_counter()
        with virtual_seconds() as virtual:
            work.wait()
        end = time.perf_counter()
        self.executor.waits.append({"msg": what, "stage": self.executor.rank, "mb": mb, "chunk": 0,
                                    "seconds": end - start, "pair": False,
                                    **({"start": start - timeline.origin} if timeline is not None else {}),
                                    **virtual})

    def _on_comm_thread(self, what: str, mb: int, fn) -> "_CommJob":
        """Run ``fn`` on the comm thread after everything queued before it (FIFO, one worker): on CUDA its
        kernels on a side stream, after the main stream's work so far, done when it returns."""
        token = handoff(self.executor.device)

        @torch.no_grad()  # grad mode is per thread: the passes compute their gradients by hand
        def job():
            start = time.perf_counter()
            with on_side_thread(token, self._side) as virtual:
                out = fn()
            self.comm_spans.append({"kind": what, "mb": mb, "start": start - self._origin,
                                    "end": time.perf_counter() - self._origin, **virtual})
            return out

        self._last_job = _CommJob(self._pool.submit(job), token)
        return self._last_job

    # -- the input layer ----------------------------------------------------------------------------
    def _input_forward(self, inputs: list[torch.Tensor]) -> None:
        ex = self.executor
        for mb, idx in enumerate(inputs):
            partial = partial_embedding(self.stage.tok, idx, self.stage.lo)  # [B,T,D], graph to the token rows
            full = partial.detach().clone()
            self._partials[mb] = partial
            self._embeds[mb] = (self._issue("input", f"E {mb}", dist.all_reduce, full, async_op=True), full)
        if ex.rank != 0:  # dE of each micro-batch comes from rank 0, in micro-batch order
            for mb, idx in enumerate(inputs):
                buf = torch.empty(ex.act_shape, dtype=ex.dtype, device=ex.device)
                self._dE[mb] = (self._issue("input", f"dE {mb}", dist.broadcast, buf, src=ex.peers[0],
                                            async_op=True), buf)

    def _embedding(self, mb: int) -> torch.Tensor:
        work, full = self._embeds.pop(mb)
        self._wait("E", mb, work)
        self._E[mb] = full.requires_grad_()
        return full

    def _input_backward(self, mb: int) -> None:
        """Rank 0, after B(0, mb): dE to every rank (async), and into rank 0's own rows."""
        dE = self._E.pop(mb).grad
        self._dE[mb] = (self._issue("input", f"dE {mb}", dist.broadcast, dE, src=self.executor.peers[0],
                                    async_op=True), dE)
        self._partials.pop(mb).backward(dE)

    # -- the forward and backward of the stages -------------------------------------------------------
    def stage_fn(self, a: Action, fn):
        ex, mb = self.executor, a.mb

        def vocab_fn(x: torch.Tensor) -> torch.Tensor:
            if a.stage == 0:  # x are token ids: the input layer's summed embedding replaces them
                x = self._embedding(mb)
                ex.hold(key_of(a), [x])  # alive until B (its gradient is dE)
            X = self.stage(x)
            if a.stage != ex.last:
                return X
            self._X_out[mb] = X.detach()
            return _ToShards.apply(X, self, mb)

        return vocab_fn

    @contextlib.contextmanager
    def forward_context(self, a: Action):
        ex = self.executor
        if a.op != "F":
            yield
            return
        before = ex.meter.live if ex.meter else 0
        yield
        if ex.meter:
            self.forward_bytes.append(ex.meter.live - before)
        self._held += 1
        self.peak_held = max(self.peak_held, self._held)
        if a.stage == ex.last:  # X to every rank for its S pass (root of the broadcast)
            X = self._X_out[a.mb]
            self._x_root.append((self._issue("x", f"X {a.mb}", dist.broadcast, X, src=ex.peers[ex.rank],
                                             async_op=True), X))

    def after_backward(self, a: Action) -> None:
        self._held -= 1
        if a.stage == 0:
            self._input_backward(a.mb)

    # -- the vocabulary passes ------------------------------------------------------------------------
    def _post_x(self, mb: int) -> None:
        ex = self.executor
        if mb not in self._x_in and ex.rank != ex.schedule.stage_rank[ex.last]:
            buf = torch.empty(ex.act_shape, dtype=ex.dtype, device=ex.device)
            last = ex.peers[ex.schedule.stage_rank[ex.last]]
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
        st = s_pass(X.reshape(N, D), self.stage.out, self.executor.targets[mb].reshape(-1), self.stage.lo,
                    self.algorithm)
        self.vocab_meter.hold(("S", mb), [t for t in (st.x, st.P, st.m, st.s, st.z, st.G, st.H) if t is not None])
        self._state[mb] = st
        self._grad_scale = 1.0 / (N * self.executor.schedule.m)  # the mean over every token of every micro-batch
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
        self._loss += float(future.result().mean()) / self.executor.schedule.m
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
        meter = self.executor.meter
        live = (meter.live if meter else 0) + self.vocab_meter.live
        self.peak_total = max(self.peak_total, live)

    def after_action(self, action: Action) -> None:
        self._done += 1
        acts = self.executor.schedule.ranks[self.executor.rank]
        if self._done < len(acts) and acts[self._done].op == "S":
            self._post_x(acts[self._done].mb)  # X arrives while this rank computes something else
        self._x_root = [(w, t) for w, t in self._x_root if not completed(w)]

    # -- the step -----------------------------------------------------------------------------------
    def step_begin(self, inputs: list[torch.Tensor], targets: list[torch.Tensor]) -> None:
        timeline = self.executor.timeline
        self._origin = timeline.origin if timeline is not None else time.perf_counter()
        self._partials, self._embeds, self._E, self._dE = {}, {}, {}, {}
        self._X_out, self._x_in, self._x_root = {}, {}, []
        self._state, self._c0, self._dx, self._c1 = {}, {}, {}, {}
        self._loss, self._done, self._held, self.peak_held, self.peak_total = 0.0, 0, 0, 0, 0
        self.collectives, self.comm_spans, self.forward_bytes = [], [], []
        self.vocab_meter = ActivationMeter(self.stage.parameters())
        self._input_forward(inputs)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vocab-comm")
        self._last_job: _CommJob | None = None

    def step_failed(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def step_end(self, loss: float | None) -> float:
        """Finish the input layer and the comm thread; the mean loss of the step (on every rank)."""
        ex = self.executor
        self._pool.shutdown(wait=True)
        if self._last_job is not None:  # the step ends when the comm thread's last job has (FIFO: all of them)
            self._last_job.wait()
        for mb, (work, dE) in sorted(self._dE.items()):
            work.wait()
            if ex.rank != 0:
                self._partials.pop(mb).backward(dE)
        if ex.rank != ex.schedule.stage_rank[ex.last]:  # dX is the last stage's; the others contributed
            for future in self._dx.values():
                future.result()  # raises what the comm thread raised
            self._dx = {}
        if ex.rank != 0:  # the summed embeddings are rank 0's input; the other ranks only contributed
            self._x_root += list(self._embeds.values())
            self._embeds = {}
        for work, _ in self._x_root + list(self._c1.values()):
            work.wait()
        left = {name: len(d) for name, d in (("partials", self._partials), ("embeddings", self._embeds),
                                             ("S states", self._state), ("C0", self._c0), ("dX", self._dx))
                if d}
        if left:
            raise RuntimeError(f"rank {ex.rank}: vocabulary step ended with unconsumed {left}")
        return self._loss


def vocab_grad_diff(model: nn.Module, stage: VocabStage, reference: nn.Module) -> float:
    """Largest |grad - reference grad| over what this rank owns: its blocks (and pos / ln_f, shared with
    ``model``) and its rows of the two tables (``stage.tok``, ``stage.out``)."""
    ref = dict(reference.named_parameters())
    mine = {id(q) for q in stage.parameters()}
    worst = 0.0
    for name, q in model.named_parameters():
        if id(q) in mine:
            worst = max(worst, (q.grad - ref[name].grad).abs().max().item())
    for own, name in ((stage.tok, "embed.tok.weight"), (stage.out, "head.out.weight")):
        worst = max(worst, (own.grad - ref[name].grad[stage.lo:stage.hi]).abs().max().item())
    return worst
