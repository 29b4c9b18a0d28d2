"""CUDA graphs: what a graph removes from a pipeline stage, what it requires, and a cost model for the gain.

Eager, every op of a stage's forward and backward goes through Python (the module's ``forward``), the
dispatcher (argument checks, autograd bookkeeping, the allocator) and a kernel launch. A CUDA graph records
the kernels of one call once and replays them with a single launch::

    eager    host │py·disp·launch│py·disp·launch│py·disp·launch│ ... N_ops times
             GPU       └─k1─┘          └─k2─┘          └─k3─┘       idle while the host is behind
    graphed  host │replay│
             GPU    └k1┘└k2┘└k3┘ ...                                kernels back to back

    model (per chunk):  eager ≈ max(T_device, N_ops · t_op)      graphed ≈ max(T_device, t_replay)

``t_op`` is what the host spends per op; a graph saves it when the host, not the GPU, is the bottleneck —
small micro-batches, small models, many small kernels (norms, activations, views).

What capture requires (``audit`` finds the violations by running a callable under a ``TorchDispatchMode``):

    static shapes      the replay reuses the recorded launch configs   -> no data-dependent shapes
                                                                          (nonzero, masked_select, unique)
    static addresses   inputs copied into the graph's own buffers, outputs read from its buffers
    no host sync       capture cannot wait for a result on the host     -> no .item(), no bool(tensor)
    comm by choice     NCCL collectives can be captured (they replay on the communicator they were
                       captured with), but DDP's gradient-ready hooks fire once per capture, not per replay,
                       and a reduce inside a chunk's graph could not start before the whole chunk ended.
                       Megatron keeps DP gradient communication outside the graphs, silences the hooks during
                       capture and issues the reduce itself, bucket by bucket as the backward makes the
                       gradients ("data-parallel separation"), so that it overlaps the rest of the backward

On a CPU nothing can be captured: ``OpCounter`` counts the ATen ops of a chunk (all of them cost the host
a dispatch; views, ``_unsafe_view`` and empty allocations launch no kernel, the rest are "compute" ops, about
one kernel launch each on a GPU) and ``dispatch_cost`` measures ``t_op`` for real (the chunk at a tiny shape,
where the kernels do almost nothing, divided by its op count; on CUDA it synchronizes around each pass, so
a chunk's time is its wall time, not the host's enqueue time); ``replay_model`` turns them into the modelled
gain. ``graph_stages`` is the CUDA path (``torch.cuda.make_graphed_callables``), checked by
``benchmarks/gpu/cuda_graphs.py`` on a sequential chain of stages with one micro-batch in flight — not inside
DualPipeV's schedule, which would need a graph per in-flight micro-batch and separate I and W graphs.
"""
from __future__ import annotations

import time
from collections import Counter
from typing import Callable

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from toolkit.pipeline.executor import ExecutorHook
from toolkit.runtime.opcost import COLLECTIVE_NAMESPACES, HOST_SYNC, NO_KERNEL, launches_kernel  # noqa: F401

# ops whose output shape depends on the data (the host cannot know it without waiting for the device)
DATA_DEPENDENT = {"aten.nonzero", "aten.masked_select", "aten.unique", "aten._unique2", "aten.unique_consecutive",
                  "aten.unique_dim", "aten.bincount"}


class OpCounter(TorchDispatchMode):
    """Counts the ATen ops dispatched inside the block (forward and, when run inside it, backward)::

        with OpCounter() as ops:
            loss = stage(x).sum(); loss.backward()
        ops.total, ops.compute, ops.counts.most_common(5)

    ``total`` counts every op (each costs the host a dispatch, which a graph replay skips); ``compute`` only
    those that launch a kernel (``launches_kernel``); ``no_kernel`` names the ops seen that do not.
    """

    def __init__(self):
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.no_kernel: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        self.counts[name] += 1
        if not launches_kernel(func):
            self.no_kernel.add(name)
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def compute(self) -> int:
        return sum(n for op, n in self.counts.items() if op not in self.no_kernel)


def count_ops(forward: Callable[[], torch.Tensor]) -> dict[str, dict]:
    """ATen ops of one forward and of its backward: ``{"forward": {op: n}, "backward": {op: n}}``, plus
    ``"no_kernel"``: the sorted names among them that launch no kernel (views, ``NO_KERNEL``).

    ``forward()`` must return a tensor that needs a gradient (a loss, or a stage output: then the backward is
    seeded with ones)."""
    with OpCounter() as fwd:
        out = forward()
    grad = None if out.numel() == 1 else torch.ones_like(out)
    with OpCounter() as bwd:
        out.backward(grad)
    return {"forward": dict(fwd.counts), "backward": dict(bwd.counts),
            "no_kernel": sorted(fwd.no_kernel | bwd.no_kernel)}


def dispatch_cost(forward: Callable[[], torch.Tensor], repeats: int = 20,
                  device: torch.device | str | None = None) -> dict[str, float]:
    """Seconds per call of ``forward()`` and of its backward, median of ``repeats`` (after 3 untimed calls).

    Called on a stage at a tiny shape (one token), this is the host's cost of the chunk: Python, dispatcher,
    autograd and allocator, with kernels that do almost nothing. Divided by the op count it is ``t_op``.
    On a CUDA ``device`` the device is synchronized before and after each pass (kernels run asynchronously:
    without it the times would be the host's enqueue time alone, whatever the kernels cost)."""
    sync = torch.cuda.synchronize if torch.device(device or "cpu").type == "cuda" else (lambda: None)
    fwd, bwd = [], []
    for i in range(repeats + 3):
        sync()
        t0 = time.perf_counter()
        out = forward()
        sync()
        t1 = time.perf_counter()
        out.backward(None if out.numel() == 1 else torch.ones_like(out))
        sync()
        t2 = time.perf_counter()
        if i >= 3:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
    return {"forward_s": sorted(fwd)[len(fwd) // 2], "backward_s": sorted(bwd)[len(bwd) // 2]}


def replay_model(n_ops: int, t_op: float, t_device: float, t_replay: float) -> dict[str, float]:
    """The modelled chunk time eager and graphed (a GPU runs kernels while the host launches the next ones):

    eager = max(t_device, n_ops · t_op), graphed = max(t_device, t_replay), speed-up = eager / graphed."""
    eager, graphed = max(t_device, n_ops * t_op), max(t_device, t_replay)
    return {"eager_s": eager, "graphed_s": graphed, "speedup": eager / graphed if graphed > 0 else float("inf")}


class _Audit(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.found: dict[str, str] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if name in DATA_DEPENDENT:
            self.found[name] = "output shape depends on the data (a graph replays fixed shapes)"
        elif name in HOST_SYNC:
            self.found[name] = "the host waits for a device value (not allowed during capture)"
        elif name.startswith(COLLECTIVE_NAMESPACES):
            self.found[name] = ("collective: capturable on NCCL, kept out by choice (DP hooks fire once per capture; "
                                "eager, it overlaps the backward bucket by bucket)")
        return func(*args, **(kwargs or {}))


def audit(fn: Callable[[], object]) -> dict[str, str]:
    """Run ``fn()`` and return ``{op: why it breaks CUDA-graph capture, or why it is kept out of graphs}`` (empty =
    capturable as far as ops tell; shapes and addresses must also stay the same from call to call). Data-dependent
    shapes and host syncs break a capture; collectives are flagged as kept out by choice (module docstring)."""
    with _Audit() as mode:
        fn()
    return dict(sorted(mode.found.items()))


# ------------------------------------------------------------------------------------------------
# CUDA
# ------------------------------------------------------------------------------------------------
def graph_stages(modules: list[nn.Module], samples: list[tuple[torch.Tensor, ...]], warmup: int = 3) -> list[nn.Module]:
    """``torch.cuda.make_graphed_callables`` on pipeline stages: each gets a forward graph and a backward graph,
    captured in order so they share one memory pool. ``samples[i]`` are example inputs of stage i with the
    shapes, dtypes and ``requires_grad`` of every later call (inputs are copied into static buffers on
    each call). Needs CUDA, no host syncs inside the stages, and no hooks on the modules.

    Gradient accumulation over micro-batches: the backward graph returns its *static* gradient buffers, and
    autograd may adopt such a buffer as a parameter's ``.grad`` when ``.grad`` is None — the next replay then
    overwrites it (pytorch/pytorch#181723). So every ``.grad`` is allocated here, and the caller must zero
    them with ``zero_grad(set_to_none=False)``: accumulation is then in place, into buffers of its own."""
    if not torch.cuda.is_available():
        raise RuntimeError("graph_stages needs CUDA")
    graphed = list(torch.cuda.make_graphed_callables(tuple(modules), tuple(samples), num_warmup_iters=warmup))
    for module in modules:
        for p in module.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
    return graphed


class GraphReplay(ExecutorHook):
    """An executor hook (``PipelineExecutor(..., hooks=[GraphReplay(ctx.emulator)])``) that runs every op of the
    pipeline as one CUDA graph replay on the emulated cluster: the host pays one launch per op (chunk) instead of
    one per kernel, the stream runs the same kernels. What Megatron's per-chunk graphs buy, timed on the virtual
    clock; on this CPU nothing is captured and the results are the eager ones, bit for bit."""

    def __init__(self, emulator):
        if emulator is None:
            raise ValueError("GraphReplay needs the emulated cluster (launch(..., cluster=...)): on a CPU nothing "
                             "can be captured")
        self.emulator = emulator

    def op_context(self, a):
        return self.emulator.graph_replay()
