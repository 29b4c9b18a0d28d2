"""The same schedules in torch.distributed.pipelining, for side-by-side runs and order comparisons.

::

    our Schedule (schedule.py) ──► PipelineExecutor ──► loss, grads, timeline
                  │ same stage modules, same micro-batches
    torch order  (from_torch)  ──► PipelineStage + ScheduleGPipe / Schedule1F1B / ScheduleInterleaved1F1B /
                                   ScheduleZBVZeroBubble / ScheduleDualPipeV  ──► loss, grads, step time

``compare_orders`` lines the two per-rank compute orders up and lists where they differ (torch's
``pipeline_order``, read through ``get_schedule_ops`` without any process). Known differences, as
checked in tests/test_schedules.py for torch 2.13:

- DualPipeV: identical per-rank orders (both follow DeepSeek's eight steps). torch runs an
  ``OVERLAP_F_B`` as the forward and then the backward, one after the other; it does not overlap them.
- 1F1B: torch's ``Schedule1F1B.pipeline_order`` (the IR used for display) numbers the last rank's
  micro-batches from 1 (F1..Fm, no F0); the schedule that actually runs (``_step_microbatches``) is
  the standard order, the same as ours.
- GPipe, Interleaved1F1B: identical orders (for m a multiple of p).
- ZBVZeroBubble: we have no generator of our own; ``from_torch("zbv", p, m)`` imports torch's order (checked)
  so the simulator and our executor can run it.

Older torch (``toolkit.runtime.compat``): the orders need torch >= 2.8 (``torch_order_missing``), DualPipeV
torch >= 2.9 for both (``runtime_missing``). Lessons ask these first, and say what they skipped.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from toolkit.runtime import compat

from .schedule import TORCH_NAMES, Schedule, torch_order


def runtime_missing(name: str) -> str | None:
    """Why ``TorchPipeline(name, ...)`` cannot run on this torch (a sentence naming the release it needs), or
    None when it can (DualPipeV needs torch >= 2.9; the others run on the floor)."""
    return compat.missing("dualpipev") if name == "dualpipev" else None


def compare_orders(ours: Schedule, name: str | None = None) -> dict:
    """Compare ``ours`` with torch's order of the same name, p and m.

    Returns ``{"identical": bool, "torch": [[str]], "ours": [[str]], "diffs": [(rank, index, ours, torch)]}``
    (the first difference per rank).
    """
    theirs = torch_order(name or ours.name, ours.p, ours.m)  # unchecked: torch's 1F1B IR is incomplete
    a, b = ours.to_strings(), theirs.to_strings()
    diffs = []
    for r, (x, y) in enumerate(zip(a, b)):
        for i in range(max(len(x), len(y))):
            xi, yi = (x[i] if i < len(x) else None), (y[i] if i < len(y) else None)
            if xi != yi:
                diffs.append((r, i, xi, yi))
                break
    return {"identical": a == b, "ours": a, "torch": b, "diffs": diffs}


class TorchPipeline:
    """torch.distributed.pipelining's implementation of ``name`` over the given stage modules.

    Args:
        name: a key of ``schedule.TORCH_NAMES`` ("gpipe", "1f1b", "interleaved", "zbv", "dualpipev").
        modules: ``{stage index: module}`` held by this rank (1 stage, or 2 for the multi-stage schedules).
        n_stages: stages in the whole pipeline.
        m: micro-batches per step.
        loss_fn: ``loss_fn(output, target)`` per micro-batch; torch divides gradients by m (``scale_grads``),
            so the gradients are those of the mean loss, as in ``PipelineExecutor``.
    """

    def __init__(self, name: str, modules: dict[int, nn.Module], n_stages: int, m: int, loss_fn: Callable,
                 device: torch.device | str = "cpu", group=None):
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.schedules import PipelineScheduleSingle

        if name not in TORCH_NAMES:
            raise ValueError(f"schedule={name!r} has no torch counterpart; allowed: {sorted(TORCH_NAMES)}")
        reason = runtime_missing(name)
        if reason:
            raise compat.TorchFeatureMissing(reason)
        cls = compat.pipeline_schedule_class(TORCH_NAMES[name])
        self.stage_ids = sorted(modules)
        stages = [PipelineStage(modules[s], s, n_stages, torch.device(device), group=group) for s in self.stage_ids]
        single = issubclass(cls, PipelineScheduleSingle)
        self.schedule = cls(stages[0] if single else stages, m, loss_fn=loss_fn)
        self.first, self.last = 0 in self.stage_ids, n_stages - 1 in self.stage_ids

    def step(self, inputs: list[torch.Tensor], targets: list[torch.Tensor]) -> float | None:
        """One step over the micro-batches (concatenated into the batch torch splits again); returns the
        mean loss on the rank holding the last stage, else None."""
        args = (torch.cat(inputs),) if self.first else ()
        losses: list[torch.Tensor] = []
        kwargs = {"target": torch.cat(targets), "losses": losses} if self.last else {}
        self.schedule.step(*args, **kwargs)
        return float(torch.stack(losses).mean()) if self.last else None
