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
that runs the toy. With ``world_size > 1`` the process is one rank of a job on torch's ``fake`` process group
(collectives return at once, no data): the comm ledger counts each collective's bytes at the true shapes and
``toolkit.runtime.collectives`` times it on the group's link, as the emulated cluster does. One process stands
for every rank (a symmetric job: tensor- or data-parallel layers). How its collectives meet its kernels is
``overlap`` (``OVERLAPS``): every one exposed; FSDP's schedule, where each all-gather is prefetched during the
layer before and the gradients' reductions run behind the backward; or DDP's, whose reductions run behind the
backward and whose (ZeRO) all-gather of the updated weights waits for them::

    overlap="none"   kernels ─AG─ kernels ─RS─ kernels          the step: kernels + every collective
    overlap="fsdp"   compute  L1 L2 L3 ... B3 B2 B1             the step: the compute, the first all-gather,
                     gathers AG2 AG3 ...  AG2 AG1                what a layer's own could not hide, the last
                     reduce              RS3 RS2 RS1             reduction
    overlap="ddp"    compute  L1 L2 L3 ... B3 B2 B1 Adam         DDP / ZeRO-1, -2: the reductions behind the
                     reduce              RS3 RS2 RS1 ──AG        backward, the weights' all-gather after them

On CPU, FSDP2 and DDP issue their collectives synchronously, so the program cannot show its overlap here: the
schedule is declared. A model, not a measurement (``toolkit.models.real_runs`` checks it against published
training runs).
"""
from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from . import collectives
from .cluster import Cluster, cluster as make_cluster
from .efficiency import Kernel, kernel_seconds
from .ledger import CommLedger
from .opcost import OpKind, _bytes, _flop_formulas, _tensors


OVERLAPS = ("none", "fsdp", "ddp")
"""``none``: every collective exposed (a bulk schedule); ``fsdp``: all-gathers one ahead, reductions behind;
``ddp``: reductions behind the backward, every all-gather after them, exposed (ZeRO-1/2 gather the updated
weights once the optimizer has them)."""


@dataclass
class Estimate:
    """What ``estimate`` found: the kernels of the step and their modelled seconds on ``gpu``."""

    gpu: str
    kernels: list[tuple[str, Kernel, float]] = field(default_factory=list)
    """(ATen op, the kernel it stands for, modelled seconds), in program order."""
    comms: list[dict] = field(default_factory=list)
    """Each collective: op, ranks in its group, bytes this rank sent (the ledger's), the link, modelled seconds."""
    host_op_s: float = 0.0
    overlap: str = "none"
    """How the collectives meet the kernels (``OVERLAPS``)."""
    static_bytes: int = 0
    """Device bytes of what ``build`` made (parameters, inputs), at the true shapes."""
    peak_bytes: int = 0
    """The most device bytes alive at once during the step: ``static_bytes`` plus the tensors the step's ops
    allocated and had not freed (activations saved for backward, gradients, workspaces of the ATen ops seen)."""
    end_bytes: int = 0
    """Device bytes alive as the step returns, what it returned still held: for a forward that returns its
    output, ``static_bytes`` + the output + the activations its graph saved for the backward."""

    @property
    def kernels_s(self) -> float:
        """The kernels back to back on the device."""
        return sum(s for _, _, s in self.kernels)

    @property
    def host_s(self) -> float:
        """The host's cost of issuing them eagerly, one op each."""
        return len(self.kernels) * self.host_op_s

    @property
    def comm_s(self) -> float:
        """The collectives' seconds on the wire, one after another."""
        return sum(c["seconds"] for c in self.comms)

    @property
    def device_s(self) -> float:
        """The device's step: its kernels in program order and its collectives, met as ``overlap`` says
        (``OVERLAPS``). FSDP2 runs all-gathers and reductions on two streams of their own; here each runs at its
        link's full rate (sharing the link while both are on it is not modelled)."""
        ends = [0.0]
        for k in self.kernels:
            ends.append(ends[-1] + k[2])
        t = gathers_free = reductions_free = prefetch_from = 0.0
        done = 0  # kernels run so far
        for c in self.comms:
            t += ends[c["at"]] - ends[done]
            done = c["at"]
            if self.overlap == "fsdp" and c["op"].startswith("all_gather"):
                start = max(prefetch_from, gathers_free)  # issued one all-gather early: during the layer before
                prefetch_from, gathers_free = t, start + c["seconds"]
                t = max(t, gathers_free)  # the layer's kernels need its parameters
            elif self.overlap != "none" and c["op"] in ("reduce_scatter_tensor", "reduce_scatter", "all_reduce"):
                reductions_free = max(t, reductions_free) + c["seconds"]  # gradients: waited for at the end
            elif self.overlap == "ddp":  # after every reduction (the optimizer's input), nothing to hide it
                t = max(t, reductions_free) + c["seconds"]
            else:
                t = max(t, gathers_free) + c["seconds"]
        return max(t + ends[-1] - ends[done], gathers_free, reductions_free)

    @property
    def exposed_s(self) -> float:
        """The collectives' seconds the kernels did not hide."""
        return self.device_s - self.kernels_s

    @property
    def step_s(self) -> float:
        """The step: the device's (``device_s``), or the host's issuing when it is slower (it runs ahead
        otherwise)."""
        return max(self.device_s, self.host_s)

    @property
    def flops(self) -> float:
        return sum(k.flops for _, k, _ in self.kernels)

    def on(self, cluster: str | Cluster) -> "Estimate":
        """The same step timed on another cluster (other rates, the same ops): each kernel on its GPU, each
        collective on the link its group spans there; what tracing again on ``cluster`` would give."""
        c = make_cluster(cluster)
        kernels = [(name, k, _kernel_s(c.gpu, k)) for name, k, _ in self.kernels]
        comms = []
        for x in self.comms:
            secs, protocol, link = collectives.seconds(c, x["op"], x["group"], x["world"], x["sent_bytes"])
            comms.append({**x, "seconds": secs, "protocol": protocol, "link": link.name})
        return dataclasses.replace(self, gpu=c.gpu.name, kernels=kernels, comms=comms,
                                   host_op_s=c.gpu.efficiency.host_op_s)

    def by_kind(self) -> dict[str, float]:
        """Modelled seconds per kernel kind (gemm, attention, memory)."""
        out: Counter = Counter()
        for _, k, s in self.kernels:
            out[k.kind] += s
        return dict(out)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """Factories (``torch.empty``, a module's parameters) make ``dtype`` inside: how a ``build`` makes a model in
    bf16, since a module of fake tensors cannot be converted after it is made."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _kernel_s(gpu, k: Kernel) -> float:
    """One kernel's seconds on ``gpu`` at a training step's rates (``efficiency.kernel_seconds``)."""
    return kernel_seconds(k, gpu.bf16_flops, gpu.hbm_bytes_per_s, gpu.sms, gpu.efficiency)


_TRACING: list["RealShapes"] = []
"""The trace in progress on this process (``estimate`` pushes it): ``fused`` charges its fused kernels."""


def tracing() -> "RealShapes | None":
    """The trace ``estimate`` is running, or None."""
    return _TRACING[-1] if _TRACING else None


class RealShapes(TorchDispatchMode):
    """Times every ATen op it sees on ``cluster``'s GPU (``opcost`` + ``efficiency``); used under FakeTensorMode
    by ``estimate``. Floating-point tensors count their own dtype's bytes (the program runs at the real dtype).
    Inside ``fused`` (what ``portable.fused_kernel`` opens) the ops go untimed and the block is one kernel, as on
    the emulated cluster."""

    def __init__(self, cluster: Cluster, est: Estimate, seen: set[int]):
        super().__init__()
        self.gpu, self.est = cluster.gpu, est
        self.formulas, self.kinds = _flop_formulas(), {}
        self.seen, self.live = seen, est.static_bytes  # storages counted (by id), bytes alive
        self.untimed = 0  # > 0 inside a fused kernel's block

    @contextlib.contextmanager
    def fused(self, name: str, kind: str, kernel):
        """The ops inside stand for one kernel: ``kernel.cost()`` (``portable.FusedKernel``) gives its FLOPs,
        the tensors it reads and writes once (each at its own dtype's bytes) and its dims."""
        self.untimed += 1
        try:
            yield kernel
        finally:
            self.untimed -= 1
        flops, tensors, dims = kernel.cost()
        k = Kernel(kind, float(flops), float(_bytes(_tensors(tensors), 0)), tuple(dims))
        self.est.kernels.append((name, k, _kernel_s(self.gpu, k)))

    def _track(self, out) -> None:
        """Count each new storage an op returns until it is freed (views and in-place ops return one seen)."""
        for t in torch.utils._pytree.tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            if id(st) in self.seen:
                continue
            n = st.nbytes()
            self.seen.add(id(st))
            self.live += n
            self.est.peak_bytes = max(self.est.peak_bytes, self.live)
            weakref.finalize(st, self._free, id(st), n)

    def _free(self, key: int, n: int) -> None:
        self.seen.discard(key)
        self.live -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor
        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor runs it on this rank's shards, whose ops come back here
        out = func(*args, **kwargs)
        self._track(out)
        kind = self.kinds.get(func)
        if kind is None:
            kind = self.kinds[func] = OpKind(func, self.formulas)
        # metadata queries (prim.device, sizes) return no tensor: no kernel; in-place ones (a fused optimizer) do
        if kind.timed and not self.untimed and (_tensors_in(out) or func._schema.is_mutable):
            k = kind.kernel(args, kwargs, out, 0)  # every tensor at its own dtype's size
            self.est.kernels.append((kind.name, k, _kernel_s(self.gpu, k)))
        return out


def _storages(built) -> dict[int, int]:
    """id -> bytes of every storage in ``built`` (tensors, and the parameters of modules), each once; a sharded
    parameter (a DTensor: FSDP2's) counts this rank's shard."""
    from torch.distributed.tensor import DTensor
    items = built if isinstance(built, tuple) else (built,)
    tensors = [t for x in items for t in (x.parameters() if isinstance(x, torch.nn.Module) else
                                          torch.utils._pytree.tree_flatten(x)[0]) if isinstance(t, torch.Tensor)]
    tensors = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    return {id(t.untyped_storage()): t.untyped_storage().nbytes() for t in tensors}


def _tensors_in(tree) -> bool:
    flat, _ = torch.utils._pytree.tree_flatten(tree)
    return any(isinstance(t, torch.Tensor) for t in flat)


class _CommClock:
    """What the comm ledger tells about each collective (it calls ``on_collective``/``on_send``/``on_recv``, as it
    does the emulator's): its group, its bytes, timed on the cluster's link for that group."""

    def __init__(self, cluster: Cluster, est: Estimate, world_size: int):
        self.cluster, self.est, self.world = cluster, est, world_size

    def _time(self, op: str, group, sent: float, peers=None):
        ranks = peers or dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
        secs, protocol, link = collectives.seconds(self.cluster, op, ranks, self.world, sent)
        self.est.comms.append({"op": op, "ranks": len(ranks), "group": list(ranks), "world": self.world,
                               "sent_bytes": sent, "link": link.name, "protocol": protocol, "seconds": secs,
                               "at": len(self.est.kernels)})

    def on_collective(self, name, group, sent, args, kwargs, out, is_async, tag):
        self._time(name, group, sent)
        return out

    def on_send(self, name, group, sent, args, kwargs, out, is_async, tag):
        dst = kwargs.get("dst", args[1] if len(args) > 1 else 0)
        self._time("send", group, sent, [dist.get_rank(), dst])
        return out

    def on_recv(self, name, group, args, kwargs, out, is_async, tag):
        return out  # the sender's side timed the transfer

    def on_batch(self, p2p_ops, works, tag):
        """``batch_isend_irecv``: each send timed as one (the receives are their other ends)."""
        for p in p2p_ops:
            if getattr(p.op, "__name__", "") == "isend":
                self._time("send", p.group, p.tensor.numel() * p.tensor.element_size(), [dist.get_rank(), p.peer])
        return works


def estimate(build: Callable[[], Any], step: Callable[..., Any], cluster: str | Cluster = "h100-ib400",
             world_size: int = 1, rank: int = 0, overlap: str = "none") -> Estimate:
    """``build()`` makes the model and its inputs at their real shapes (untimed), ``step(built)`` runs what is
    timed (``build``'s result is passed as is, or unpacked when it is a tuple); both with fake tensors, so
    nothing is computed and no memory is taken. With ``world_size > 1`` this process is rank ``rank`` of a fake
    process group of that size (``dist.new_group`` works inside ``build``); the cluster's ``ranks_per_node``
    places the ranks; a device mesh (FSDP2's ``fully_shard(mesh=...)``) is made in ``build`` under
    ``torch._subclasses.fake_tensor.unset_fake_temporarily()``. ``overlap`` (``OVERLAPS``) says how the
    collectives meet the kernels. Returns the ``Estimate`` of ``step`` on ``cluster``'s GPUs and links.

    >>> est = estimate(lambda: (torch.nn.Linear(4096, 14336, dtype=torch.bfloat16),
    ...                         torch.empty(16384, 4096, dtype=torch.bfloat16)),
    ...                lambda lin, x: lin(x))                                             # doctest: +SKIP
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    for name, v in (("world_size", world_size), ("rank", rank)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0 or (name == "world_size" and v < 1):
            raise ValueError(f"{name}={v!r} must be an int >= {1 if name == 'world_size' else 0}")
    if rank >= world_size:
        raise ValueError(f"rank={rank} must be < world_size={world_size}")
    if overlap not in OVERLAPS:
        raise ValueError(f"overlap={overlap!r} must be one of {OVERLAPS}")
    c = make_cluster(cluster)
    est = Estimate(c.gpu.name, host_op_s=c.gpu.efficiency.host_op_s, overlap=overlap)
    fake_pg = world_size > 1
    if fake_pg:
        if dist.is_initialized():
            raise ValueError("estimate(world_size > 1) runs its own fake process group: call it outside a launch")
        from torch.testing._internal.distributed.fake_pg import FakeStore
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    ledger = CommLedger().install() if fake_pg else None
    try:
        with FakeTensorMode():
            built = build()
            seen = _storages(built)
            est.static_bytes = est.peak_bytes = sum(seen.values())
            if ledger is not None:
                ledger.observer = _CommClock(c, est, world_size)
            with RealShapes(c, est, set(seen)) as mode:
                _TRACING.append(mode)
                try:
                    returned = step(*built) if isinstance(built, tuple) else step(built)
                    est.end_bytes = mode.live
                    del returned
                finally:
                    _TRACING.pop()
    finally:
        if ledger is not None:
            ledger.uninstall()
        if fake_pg:
            dist.destroy_process_group()
    return est
