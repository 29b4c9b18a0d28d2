"""What differs between the torch versions the toolkit supports, in one place.

The floor is torch 2.7 (``pyproject.toml``): the first release whose FSDP2 (``torch.distributed.fsdp.fully_shard``,
public since 2.6) runs on CPU: 2.6's all-gather calls ``Stream.record_event``, which its CPU stream lacks
(tried: 2.6.0 fails in the first forward, 2.7.1 runs). Newer releases renamed two collectives and added the
pipeline schedules and helpers that some lessons compare against::

    torch API                                                first   without it
    ───────────────────────────────────────────────────────  ─────   ─────────────────────────────────────
    fsdp.fully_shard on CPU, CPUOffloadPolicy                 2.7    (the floor; on CUDA from 2.6)
    pipelining.ScheduleZBVZeroBubble                          2.6    (below the floor)
    pipelining schedules' scale_grads (mean over micro-       2.7    (the floor)
      batches)
    pipelining._schedule_visualizer.get_schedule_ops          2.8    torch's schedule orders not compared
    pipelining.ScheduleDualPipeV                              2.9    torch's DualPipeV not run
    distributed.all_gather_single / reduce_scatter_single     2.13   all_gather_into_tensor / reduce_scatter_tensor
                                                                     (the same op; deprecated from 2.13 on)

Every call site of the flat collectives goes through ``all_gather_single`` / ``reduce_scatter_single``
here, which take the new name where torch has it and the old one elsewhere; the ledger counts both under
the old names. Names are looked up at call time, never cached, so the ledger's wrappers (installed after
import) and a test that removes a name inside the ranks both see the call. Optional comparisons ask
``missing(feature)`` and say why they were skipped instead of crashing.
"""
from __future__ import annotations

import importlib.util

import torch
import torch.distributed as dist

# feature -> (first torch release with it, what the toolkit loses without it)
FEATURES = {
    "schedule_ops": ("2.8", "torch.distributed.pipelining's schedule orders (_schedule_visualizer.get_schedule_ops)"),
    "dualpipev": ("2.9", "torch.distributed.pipelining.ScheduleDualPipeV"),
    "single_collectives": ("2.13", "the names all_gather_single / reduce_scatter_single (the shims here fall "
                                   "back to all_gather_into_tensor / reduce_scatter_tensor)"),
}


class TorchFeatureMissing(RuntimeError):
    """This torch lacks an optional API (``FEATURES``); the message says which release added it."""


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """Rank r's ``input`` [n] lands in chunk r of ``output`` [W*n] (``dist.all_gather_single``, torch >= 2.13;
    ``dist.all_gather_into_tensor`` before)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, op=dist.ReduceOp.SUM, group=None,
                          async_op: bool = False):
    """Chunk r of the element-wise reduction of every rank's ``input`` [W*n] lands in rank r's ``output`` [n]
    (``dist.reduce_scatter_single``, torch >= 2.13; ``dist.reduce_scatter_tensor`` before)."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, op=op, group=group, async_op=async_op)


def missing(feature: str) -> str | None:
    """None when this torch has ``feature`` (a key of ``FEATURES``), else a sentence saying what is missing
    and which release added it, for a lesson to print."""
    if feature not in FEATURES:
        raise ValueError(f"feature={feature!r} is not known; allowed: {sorted(FEATURES)}")
    if _has(feature):
        return None
    since, what = FEATURES[feature]
    return f"torch {torch.__version__} lacks {what}: it needs torch >= {since}"


def require(feature: str) -> None:
    """Raise ``TorchFeatureMissing`` (naming the release that added it) unless this torch has ``feature``."""
    reason = missing(feature)
    if reason:
        raise TorchFeatureMissing(reason)


def pipeline_schedule_class(torch_name: str) -> type:
    """torch.distributed.pipelining's schedule class for ``torch_name`` (``"1F1B"``, ``"DualPipeV"``, ...);
    ``TorchFeatureMissing`` for DualPipeV on torch < 2.9."""
    from torch.distributed.pipelining import schedules
    if torch_name.lower() == "dualpipev":
        require("dualpipev")
    return schedules.get_schedule_class(torch_name)


def _has(feature: str) -> bool:
    if feature == "single_collectives":
        return hasattr(dist, "all_gather_single") and hasattr(dist, "reduce_scatter_single")
    if feature == "dualpipev":
        from torch.distributed.pipelining import schedules
        return hasattr(schedules, "ScheduleDualPipeV")
    return _module_exists("torch.distributed.pipelining._schedule_visualizer")  # schedule_ops


def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a test sets sys.modules[name] = None to remove it
        return False
