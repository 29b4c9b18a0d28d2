"""A program's ops at a real model's shapes, timed on a target GPU without computing them.

``torch._subclasses.FakeTensorMode`` gives tensors shapes, dtypes and strides and no storage: an op returns at
once with the right output shape. Under it, this module's dispatch mode sees every ATen op the program runs, turns
each into the kernel it stands for (``toolkit.runtime.opcost``) and times it on the GPU's efficiency model, as
the emulated cluster does for a toy's ops::

    build()  under FakeTensorMode      a Llama-sized layer: parameters with shapes, no memory
    step(*built)  under FakeTensorMode + RealShapes
        every ATen op ──► opcost.OpKind.kernel (FLOPs, bytes, GEMM / attention shape)
                      ──► efficiency.kernel_seconds on the cluster's GPU (a training step's share of each rate)

So a laptop answers "what would this layer take on an H100" at the model's true shapes, through the same code
that runs the toy. One process, no communication: the multi-rank, shapes-only run of a whole lesson is not built
yet. A model, not a measurement.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .cluster import Cluster, cluster as make_cluster
from .efficiency import Kernel, kernel_seconds
from .opcost import OpKind, _flop_formulas


@dataclass
class Estimate:
    """What ``estimate`` found: the kernels of the step and their modelled seconds on ``gpu``."""

    gpu: str
    kernels: list[tuple[str, Kernel, float]] = field(default_factory=list)
    """(ATen op, the kernel it stands for, modelled seconds), in program order."""
    host_op_s: float = 0.0

    @property
    def kernels_s(self) -> float:
        """The kernels back to back on the device."""
        return sum(s for _, _, s in self.kernels)

    @property
    def host_s(self) -> float:
        """The host's cost of issuing them eagerly, one op each."""
        return len(self.kernels) * self.host_op_s

    @property
    def step_s(self) -> float:
        """The step: the device's kernels, or the host's issuing when it is slower (it runs ahead otherwise)."""
        return max(self.kernels_s, self.host_s)

    @property
    def flops(self) -> float:
        return sum(k.flops for _, k, _ in self.kernels)

    def by_kind(self) -> dict[str, float]:
        """Modelled seconds per kernel kind (gemm, attention, memory)."""
        out: Counter = Counter()
        for _, k, s in self.kernels:
            out[k.kind] += s
        return dict(out)


class RealShapes(TorchDispatchMode):
    """Times every ATen op it sees on ``cluster``'s GPU (``opcost`` + ``efficiency``); used under FakeTensorMode
    by ``estimate``. Floating-point tensors count their own dtype's bytes (the program runs at the real dtype)."""

    def __init__(self, cluster: Cluster, est: Estimate):
        super().__init__()
        self.gpu, self.est = cluster.gpu, est
        self.formulas, self.kinds = _flop_formulas(), {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        kind = self.kinds.get(func)
        if kind is None:
            kind = self.kinds[func] = OpKind(func, self.formulas)
        if kind.timed and _tensors_in(out):  # metadata queries (prim.device, sizes) return no tensor: no kernel
            nbytes = max([t.element_size() for t in _floats((args, out))] or [4])
            k = kind.kernel(args, kwargs, out, nbytes)
            g = self.gpu
            self.est.kernels.append((kind.name, k, kernel_seconds(k, g.bf16_flops, g.hbm_bytes_per_s, g.sms,
                                                                   g.efficiency)))
        return out


def _tensors_in(tree) -> bool:
    flat, _ = torch.utils._pytree.tree_flatten(tree)
    return any(isinstance(t, torch.Tensor) for t in flat)


def _floats(tree) -> list[torch.Tensor]:
    flat, _ = torch.utils._pytree.tree_flatten(tree)
    return [t for t in flat if isinstance(t, torch.Tensor) and t.dtype.is_floating_point]


def estimate(build: Callable[[], Any], step: Callable[..., Any], cluster: str | Cluster = "h100-ib400") -> Estimate:
    """``build()`` makes the model and its inputs at their real shapes (untimed), ``step(built)`` runs what is
    timed (``build``'s result is passed as is, or unpacked when it is a tuple); both with fake tensors, so
    nothing is computed and no memory is taken. Returns the ``Estimate`` of ``step`` on ``cluster``'s GPU.

    >>> est = estimate(lambda: (torch.nn.Linear(4096, 14336, dtype=torch.bfloat16),
    ...                         torch.empty(16384, 4096, dtype=torch.bfloat16)),
    ...                lambda lin, x: lin(x))                                             # doctest: +SKIP
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    c = make_cluster(cluster)
    est = Estimate(c.gpu.name, host_op_s=c.gpu.efficiency.host_op_s)
    with FakeTensorMode():
        built = build()
        with RealShapes(c, est):
            step(*built) if isinstance(built, tuple) else step(built)
    return est
