"""Data-parallel gradient all-reduce kept out of the pipeline's compute and issued as soon as gradients are final
("data-parallel separation", what Megatron does around its CUDA graphs): per stage, or bucket by bucket.

PP × DP: each pipeline rank has ``dp`` replicas with their own micro-batches; after the step their stage
gradients must be averaged over the replicas. Three ways, the same bytes, the same result::

    plain      run the whole pipeline step ─────────────────────────────► all-reduce every stage ─► done
                                                                           (exposed: the step waits)
    separated  ... B/W of stage s's last micro-batch ─► all-reduce(stage s) in flight ─┐
               ... the rest of the schedule (other stage's F, B, W, p2p) ─────────────┴► wait ─► done
    bucketed   ... the last B/W of stage s:  dW(layer L) dW(L-1) ... dW(1)     (gradients in reverse order)
                                                 └► bucket 1 └► bucket 2 ... └► bucket n   each in flight as
                                                                                           soon as it is full

A stage's gradients are final after its last gradient-producing op on this rank (the last of its B, I
and W: LayerNorm/embedding gradients come with the I, Linear weights with the W). DualPipeV finishes the
stages of a rank at different times — the phase-1 chunk (stage 2p-1-r) before the phase-0 chunk — so the
first all-reduce overlaps the second chunk's last backwards. But the phase-0 chunk's last op is the rank's
last op: per stage, its all-reduce has nothing left to hide behind. Bucket by bucket (Megatron's and DDP's
way) it starts inside that last op: the stage's parameters are cut, in reverse order, into buckets of at
least ``bucket_bytes``; during the stage's last gradient op each parameter reports its final gradient (a
post-accumulate-grad hook for what autograd accumulates, ``WeightGradStore.grad_ready`` for the dW a W runs)
and each bucket leaves as soon as all of its parameters have, so all but the last bucket overlap the rest
of that op. Buckets leave in their order on every replica (collectives must match).

Each all-reduce is one flat buffer (the bucket's gradients concatenated), averaged over ``dp``. Plain and
separated use the same buffers (one per stage) in the same order, so the sums are the same bits; buckets
cut the buffers differently, which is bitwise the same at dp = 2 (a sum of two numbers has one order) and
within float rounding beyond (the all-reduce may add each element's dp terms in another order).

Why outside the graph: a captured region replays exactly the kernels it recorded, on the buffers and the
communicator it recorded; DDP's hooks fire during capture only. Issued from the host between replays, the
reduce is free to start when the gradients are done and to overlap whatever the schedule runs next.

``DataParallelSeparation`` is the executor hook that does it:
``PipelineExecutor(..., hooks=[DataParallelSeparation(grid.group("dp"), separate=True, bucket_bytes=...)])``.
"""
from __future__ import annotations

import contextlib
import time
from typing import Callable, ContextManager

import torch
import torch.distributed as dist
import torch.nn as nn

from .executor import ExecutorHook, SplitLinear
from .schedule import Action

GRAD_OPS = ("B", "I", "W")


def last_grad_ops(schedule, rank: int) -> dict[int, int]:
    """{stage: index (in the rank's flat op order) of its last B, I or W}, for every stage on ``rank``."""
    last, i = {}, 0
    for action in schedule.ranks[rank]:
        for part in action.parts:
            if part.op in GRAD_OPS:
                last[part.stage] = i
            i += 1
    return last


def make_buckets(params: list[nn.Parameter], bucket_bytes: int | None) -> list[list[nn.Parameter]]:
    """``params`` in reverse order (the order a backward finishes them), cut into buckets: each closes at the
    first parameter that brings it to ``bucket_bytes`` or more. None: one bucket of all of them."""
    params = [p for p in reversed(params) if p.requires_grad]
    if bucket_bytes is None:
        return [params] if params else []
    buckets, current, size = [], [], 0
    for p in params:
        current.append(p)
        size += p.numel() * p.element_size()
        if size >= bucket_bytes:
            buckets.append(current)
            current, size = [], 0
    return buckets + ([current] if current else [])


def written_by(op: str, module: nn.Module) -> set[int]:
    """ids of the parameters of ``module`` whose gradient op ``op`` writes: a B all of them, an I all but the
    deferred Linears' (``SplitLinear``), a W only those."""
    deferred = {id(p) for m in module.modules() if isinstance(m, SplitLinear) for p in m.parameters()}
    every = {id(p) for p in module.parameters() if p.requires_grad}
    return {"B": every, "I": every - deferred, "W": deferred & every}[op]


class DataParallelSeparation(ExecutorHook):
    """The executor hook that averages the stage gradients over ``dp_group`` in each step.

    Args:
        dp_group: the replicas of this pipeline rank (``ProcessGrid.group("dp")``).
        separate: issue the all-reduces (``async_op=True``) as the gradients become final and wait at the end
            of the step; False: all-reduce every stage after the pipeline step (plain).
        bucket_bytes: None: one all-reduce per stage, right after its last gradient op; a size: buckets of at
            least that many gradient bytes, each issued during the stage's last gradient op as soon as its
            gradients are final (needs ``separate``).
        grad_context: entered around what touches the gradients here (flattening, the all-reduce call,
            averaging), e.g. ``lambda: emulator.scaled(bytes=...)`` to time them as a real model's.

    After a step, ``reduces`` lists per all-reduce ``{"stage", "bucket", "bytes", "issued", "done_by",
    "waited_s"}``, in issue order: times on the timeline's clock (when there is one) of the issue, of the first
    action boundary at which the reduce was seen complete (an upper bound of its end), and the seconds the
    step blocked on it at the end; on an emulated cluster also ``"waited_vs"``, that wait on the virtual clock.
    """

    def __init__(self, dp_group=None, separate: bool = True, bucket_bytes: int | None = None,
                 grad_context: Callable[[], ContextManager] | None = None):
        if bucket_bytes is not None and (isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int)
                                         or bucket_bytes < 1):
            raise ValueError(f"bucket_bytes={bucket_bytes!r} must be None (one all-reduce per stage) or an int >= 1")
        if bucket_bytes is not None and not separate:
            raise ValueError("bucket_bytes needs separate=True: plain all-reduces every stage after the step")
        self.dp_group, self.separate, self.bucket_bytes = dp_group, separate, bucket_bytes
        self.grad_context = grad_context or contextlib.nullcontext
        self.dp = dist.get_world_size(dp_group) if dist.is_initialized() else 1
        self.reduces: list[dict] = []

    def bind(self, executor) -> None:
        super().bind(executor)
        self._last = last_grad_ops(executor.schedule, executor.rank)
        self.buckets = {s: make_buckets(list(m.parameters()), self.bucket_bytes) for s, m in executor.modules.items()}

    def _clock(self) -> float:
        timeline = self.executor.timeline
        return timeline.now() if timeline is not None else time.perf_counter()

    def _issue(self, stage: int, bucket: int) -> None:
        params = self.buckets[stage][bucket]
        with self.grad_context():
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            work = dist.all_reduce(flat, group=self.dp_group, async_op=True)
        rec = {"stage": stage, "bucket": bucket, "bytes": flat.numel() * flat.element_size(), "issued": self._clock(),
               "done_by": None, "waited_s": 0.0}
        self.reduces.append(rec)
        self._pending.append((work, flat, params, rec))
        self._next[stage] = bucket + 1

    def _issue_ready(self, stage: int, final: set[int] | None = None) -> None:
        """Issue the stage's next buckets, in order, while all their parameters are in ``final`` (ids of the
        parameters whose gradient is final; None: every bucket left)."""
        buckets = self.buckets[stage]
        while self._next[stage] < len(buckets) and (
                final is None or all(id(p) in final for p in buckets[self._next[stage]])):
            self._issue(stage, self._next[stage])

    @contextlib.contextmanager
    def _bucketing(self, a: Action):
        """Around the stage's last gradient op: what it does not write is final already; each parameter it writes
        reports its final gradient, and the buckets leave as they fill."""
        module = self.executor.modules[a.stage]
        written = written_by(a.op, module)
        final = {id(p) for p in module.parameters() if id(p) not in written}

        def ready(p: torch.Tensor) -> None:
            final.add(id(p))
            self._issue_ready(a.stage, final)
        self._issue_ready(a.stage, final)
        handles = [p.register_post_accumulate_grad_hook(ready) for p in module.parameters() if id(p) in written]
        store = self.executor.weight_grads
        store.grad_ready = ready
        try:
            yield
        finally:
            store.grad_ready = None
            for h in handles:
                h.remove()

    def _poll(self) -> None:
        now = self._clock()
        for work, _, _, rec in self._pending:
            if rec["done_by"] is None and work.is_completed():
                rec["done_by"] = now

    # -- hooks --------------------------------------------------------------------------------------------
    def step_begin(self, inputs, targets) -> None:
        self._op_index, self._pending, self.reduces = 0, [], []
        self._next = {s: 0 for s in self.buckets}

    def op_context(self, a: Action) -> ContextManager:
        if self.bucket_bytes is not None and self._last.get(a.stage) == self._op_index:
            return self._bucketing(a)
        return contextlib.nullcontext()

    def after_op(self, a: Action) -> None:
        self._op_index += 1
        if self.separate and self._last.get(a.stage) == self._op_index - 1:
            self._issue_ready(a.stage)  # per stage: its one bucket; bucketed: whatever is left

    def after_action(self, action: Action) -> None:
        if self._pending:
            self._poll()

    def step_end(self, loss):
        if not self.separate:
            for stage in sorted(self._last, key=self._last.get):  # the same order as the separated issues
                self._issue_ready(stage)
        for work, flat, params, rec in self._pending:
            t0 = time.perf_counter()
            work.wait()
            rec["waited_s"] = time.perf_counter() - t0
            if hasattr(work, "exposed"):  # the emulated cluster's handle: the wait on the virtual clock
                rec["waited_vs"] = work.exposed[0]
            if rec["done_by"] is None:
                rec["done_by"] = self._clock()
            with self.grad_context():
                flat /= self.dp
                offset = 0
                for p in params:
                    p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
                    offset += p.numel()
        self._pending = []
        return loss


__all__ = ["DataParallelSeparation", "last_grad_ops", "make_buckets", "written_by"]
