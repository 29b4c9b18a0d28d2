"""Data-parallel gradient all-reduce kept out of the pipeline's compute and issued per stage, as soon as a
stage's gradients are final ("data-parallel separation", what Megatron does around its CUDA graphs).

PP × DP: each pipeline rank has ``dp`` replicas with their own micro-batches; after the step their stage
gradients must be averaged over the replicas. Two ways, the same bytes, bitwise the same result::

    plain      run the whole pipeline step ─────────────────────────────► all-reduce every stage ─► done
                                                                           (exposed: the step waits)
    separated  ... B/W of stage s's last micro-batch ─► all-reduce(stage s) in flight ─┐
               ... the rest of the schedule (other stage's F, B, W, p2p) ─────────────┴► wait ─► done

A stage's gradients are final after its last gradient-producing op on this rank (the last of its B, I
and W: LayerNorm/embedding gradients come with the I, Linear weights with the W). DualPipeV finishes the
stages of a rank at different times — the phase-1 chunk (stage 2p-1-r) before the phase-0 chunk — so the
first all-reduce overlaps the second chunk's last backwards. The all-reduce of one stage is one flat
buffer (the stage's gradients concatenated, as DDP's buckets), averaged over ``dp``; both ways use the
same buffers in the same order, so the sums are the same bits.

Why outside the graph: a captured region replays exactly the kernels it recorded, on the buffers and the
communicator it recorded; DDP's hooks fire during capture only. Issued from the host between replays, the
reduce is free to start when the stage is done and to overlap whatever the schedule runs next.

``DataParallelSeparation`` is the executor hook that does it:
``PipelineExecutor(..., hooks=[DataParallelSeparation(grid.group("dp"), separate=True)])``.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from .executor import ExecutorHook
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


class DataParallelSeparation(ExecutorHook):
    """The executor hook that averages the stage gradients over ``dp_group`` in each step.

    Args:
        dp_group: the replicas of this pipeline rank (``ProcessGrid.group("dp")``).
        separate: issue each stage's all-reduce (``async_op=True``) right after its last gradient op and wait
            at the end of the step; False: all-reduce every stage after the pipeline step (plain).

    After a step, ``reduces`` lists per stage ``{"stage", "bytes", "issued", "done_by", "waited_s"}``: times
    on the timeline's clock (when there is one) of the issue, of the first action boundary at which the
    reduce was seen complete (an upper bound of its end), and the seconds the step blocked on it at the end;
    on an emulated cluster also ``"waited_vs"``, that wait on the virtual clock.
    """

    def __init__(self, dp_group=None, separate: bool = True):
        self.dp_group, self.separate = dp_group, separate
        self.dp = dist.get_world_size(dp_group) if dist.is_initialized() else 1
        self.reduces: list[dict] = []

    def bind(self, executor) -> None:
        super().bind(executor)
        self._last = last_grad_ops(executor.schedule, executor.rank)

    def _clock(self) -> float:
        timeline = self.executor.timeline
        return timeline.now() if timeline is not None else time.perf_counter()

    def _issue(self, stage: int) -> None:
        grads = [p.grad for p in self.executor.modules[stage].parameters()]
        flat = torch.cat([g.reshape(-1) for g in grads])
        work = dist.all_reduce(flat, group=self.dp_group, async_op=True)
        rec = {"stage": stage, "bytes": flat.numel() * flat.element_size(), "issued": self._clock(),
               "done_by": None, "waited_s": 0.0}
        self.reduces.append(rec)
        self._pending.append((work, flat, grads, rec))

    def _poll(self) -> None:
        now = self._clock()
        for work, _, _, rec in self._pending:
            if rec["done_by"] is None and work.is_completed():
                rec["done_by"] = now

    # -- hooks --------------------------------------------------------------------------------------------
    def step_begin(self, inputs, targets) -> None:
        self._op_index, self._pending, self.reduces = 0, [], []

    def after_op(self, a: Action) -> None:
        self._op_index += 1
        if self.separate and self._last.get(a.stage) == self._op_index - 1:
            self._issue(a.stage)

    def after_action(self, action: Action) -> None:
        if self._pending:
            self._poll()

    def step_end(self, loss):
        if not self.separate:
            for stage in sorted(self._last, key=self._last.get):  # the same order as the separated issues
                self._issue(stage)
        for work, flat, grads, rec in self._pending:
            t0 = time.perf_counter()
            work.wait()
            rec["waited_s"] = time.perf_counter() - t0
            if hasattr(work, "exposed"):  # the emulated cluster's handle: the wait on the virtual clock
                rec["waited_vs"] = work.exposed[0]
            if rec["done_by"] is None:
                rec["done_by"] = self._clock()
            flat /= self.dp
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
        self._pending = []
        return loss


__all__ = ["DataParallelSeparation", "last_grad_ops"]
