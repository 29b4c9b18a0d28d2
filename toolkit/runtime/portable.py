"""Verbs for what technique code does that the emulated cluster must also time: the same call with and without it,
so a technique never asks whether it is emulated (SimGrid's rule: the simulated program is the real program).

    verb                               on real hardware                   on the emulated cluster, also
    ─────────────────────────────────  ─────────────────────────────────  ─────────────────────────────────────────
    with io.to_host() as copy:         the copies inside, as written      they take no time of their own; on
        buf.copy_(x); copy.add(n)      (copy_, clone, a hook)             leaving, one transfer of the counted
    copy.wait() / wait_host()          0.0: CUDA code orders by events    bytes on the host link; the stream (the
                                                                          host) waits for it: the seconds it moved
    io.disk_read(n) / disk_write(n)    (the caller's store does the I/O)  a transfer on the node's drives
    with host_compute(4):              the ops inside                     run on the host CPU's roofline, floats
                                                                          at 4 bytes
    token = handoff(device)            a CUDA event on this stream        a stamp of this thread's time
    with on_side_thread(token, s)      the worker's kernels on stream s,  the worker's clock starts at the stamp;
        as span:                       after the event; synchronized      its ops are timed on it; ``span`` holds
                                                                          vhanded, vstart, vend
    join(token)                        nothing (the job synchronized)     the waiting thread moves to vend
    with virtual_seconds() as span:    nothing                            span["vseconds"]: the block's time
    with fused_kernel(name, kind)      the ops inside                     they go untimed; ``kernel.cost`` is
        as kernel:                                                        charged as one kernel on leaving

``HostIO`` keeps the emulated cluster of the moment it is built (none inside ``paused()``), as the technique
objects that hold one do; the other verbs look it up when called.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch

from .emulator import LocalTransfer, current
from .opcost import element_bytes


class Transfer:
    """A copy between device and host memory, or a disk I/O (``HostIO``): ``nbytes`` at the target's sizes;
    ``wait()`` (the stream needs the data) and ``wait_host()`` (host code reads it) return the seconds the wait
    moved the emulated clock, ``end`` is when it ends (a later copy's ``after``); 0.0 on real hardware."""

    def __init__(self, nbytes: float = 0.0):
        self.nbytes = nbytes
        self.timed: LocalTransfer | None = None  # the emulated cluster's record of it

    def add(self, nbytes: float) -> None:
        """Count ``nbytes`` more (``HostIO.nbytes`` gives a tensor's at the target's element size)."""
        self.nbytes += nbytes

    @property
    def end(self) -> float:
        return self.timed.end if self.timed is not None else 0.0

    def wait(self) -> float:
        return self.timed.wait() if self.timed is not None else 0.0

    def wait_host(self) -> float:
        return self.timed.wait_host() if self.timed is not None else 0.0


class HostIO:
    """This rank's copies between device and host memory and its disk I/O (module docstring)."""

    def __init__(self):
        self._emu = current()
        self._float_bytes = self._emu.cluster.float_bytes if self._emu is not None else 0

    @property
    def measures_waits(self) -> bool:
        """Whether a clock measures the waits for these copies (the emulated cluster's): where none does, a copy
        issued only when its data is needed is the evidence that the data came late."""
        return self._emu is not None

    def nbytes(self, numel: int, dtype: torch.dtype) -> int:
        """Bytes of ``numel`` elements of ``dtype`` on the target (floats at the emulated GPU's size)."""
        return numel * element_bytes(dtype, self._float_bytes)

    def to_host(self, after: float = 0.0) -> contextlib.AbstractContextManager[Transfer]:
        """The copies inside go device -> host, as one transfer (``after``: not before a transfer that ends then)."""
        return self._copy(True, after)

    def to_device(self, after: float = 0.0) -> contextlib.AbstractContextManager[Transfer]:
        """The copies inside go host -> device, as one transfer."""
        return self._copy(False, after)

    @contextlib.contextmanager
    def _copy(self, to_host: bool, after: float) -> Iterator[Transfer]:
        transfer = Transfer()
        if self._emu is None:
            yield transfer
            return
        with self._emu.untimed():  # the copies' time is the link's
            yield transfer
        transfer.timed = self._emu.host_copy(transfer.nbytes, to_host, after=after)

    def disk_read(self, nbytes: float) -> Transfer:
        """A read of ``nbytes`` from this rank's share of the node's drives, issued now."""
        return self._disk(nbytes, write=False)

    def disk_write(self, nbytes: float) -> Transfer:
        """A write of ``nbytes``, issued now."""
        return self._disk(nbytes, write=True)

    def _disk(self, nbytes: float, write: bool) -> Transfer:
        transfer = Transfer(nbytes)
        if self._emu is not None:
            transfer.timed = self._emu.disk_io(nbytes, write)
        return transfer

    def virtual_step(self, waits: tuple[str, ...]) -> "VirtualStep":
        """The emulated clock across one optimizer step, from now (``VirtualStep``)."""
        return VirtualStep(self._emu, waits)


class VirtualStep:
    """The emulated cluster's clock across one optimizer step: the step's virtual seconds, the host's time in
    updates (the CPU's roofline), and the time each kind of wait for a copy moved the clock (``*_wait_s``);
    ``done()`` is None on real hardware."""

    def __init__(self, emu, waits: tuple[str, ...]):
        self.emu = emu
        self.start = emu.now() if emu else 0.0
        self.host0 = self._host_seconds()
        self.waits = dict.fromkeys(waits, 0.0)

    def _host_seconds(self) -> float:
        if self.emu is None:
            return 0.0
        return sum(row["model_s"] for name, row in self.emu.ops.items() if name.startswith("host: "))

    def wait(self, transfer: Transfer, key: str, host: bool) -> None:
        self.waits[key] += transfer.wait_host() if host else transfer.wait()

    def done(self) -> dict | None:
        if self.emu is None:
            return None
        return {"step_s": self.emu.now() - self.start, "host_update_s": self._host_seconds() - self.host0,
                **self.waits}


@contextlib.contextmanager
def host_compute(float_bytes: int):
    """The ops inside run on the host's processor (an optimizer update on the host) with their floats at
    ``float_bytes`` per element: on the emulated cluster timed by ``Cluster.cpu``'s roofline on this thread's host
    clock (it times floats at the GPU's ``float_bytes`` otherwise)."""
    emu = current()
    if emu is None:
        yield
        return
    with emu.on_host(), emu.scaled(flops=emu.flop_scale, bytes=emu.byte_scale * float_bytes / emu.cluster.float_bytes):
        yield


# ---- a hand-over to another thread --------------------------------------------------------------------------------
class Handoff:
    """What a job handed to another thread starts after (``handoff``), and, once it has run, when it ended."""

    def __init__(self, device: torch.device):
        self.event, self.emu = None, current()
        if device.type == "cuda":
            self.event = torch.cuda.Event()
            self.event.record()
        self.stamp = self.emu.fork() if self.emu is not None else 0.0  # the job starts no earlier than now
        self.vend: float | None = None  # set by on_side_thread on the emulated cluster


def handoff(device: torch.device) -> Handoff:
    """On the issuing thread: a job for another thread starts after what this thread has issued so far."""
    return Handoff(device)


@contextlib.contextmanager
def on_side_thread(token: Handoff, stream: "torch.cuda.Stream | None" = None) -> Iterator[dict]:
    """On the worker thread: the block is the job ``token`` handed over. On CUDA its kernels run on ``stream``
    after the issuing stream's work, and are done when the block ends. On the emulated cluster the block's ops are
    timed on this thread's clock, which starts no earlier than the hand-over; the yielded dict then holds
    ``vhanded``, ``vstart`` (after this thread's earlier jobs) and ``vend``, else stays empty."""
    span: dict = {}
    with token.emu.worker(token.stamp) if token.emu is not None else contextlib.nullcontext():
        if token.emu is not None:
            span.update(vhanded=float(token.stamp), vstart=token.emu.now())
        if token.event is None:
            yield span
        else:
            torch.cuda.set_device(stream.device)  # this thread on the stream's GPU
            with torch.cuda.stream(stream):
                stream.wait_event(token.event)
                yield span
                stream.synchronize()
        if token.emu is not None:
            span["vend"] = token.vend = token.emu.now()


def join(token: Handoff) -> None:
    """On a thread that waited for the job ``token`` handed over: it continues after the job's end."""
    if token.vend is not None:
        token.emu.join(token.vend)


@contextlib.contextmanager
def virtual_seconds() -> Iterator[dict]:
    """The yielded dict holds, once the block ends on the emulated cluster, ``vseconds``: its virtual time."""
    emu, span = current(), {}
    start = emu.now() if emu is not None else None
    yield span
    if emu is not None:
        span["vseconds"] = emu.now() - start


# ---- a block of ops that stands for one fused kernel --------------------------------------------------------------
class FusedKernel:
    """``cost``: set inside the block to a function returning (FLOPs, the tensors read and written once, dims),
    called only where the kernel is timed (it may read values: a mask's count)."""

    def __init__(self):
        self.cost: Callable[[], tuple[float, list, tuple]] | None = None


@contextlib.contextmanager
def fused_kernel(name: str, kind: str) -> Iterator[FusedKernel]:
    """The ops inside stand for the one kernel a GPU runs for them (a Triton kernel, flash attention on packed
    sequences): on the emulated cluster, where it times this thread, they go untimed and the block is charged
    as that kernel (``kind``: ``gemm``, ``attention`` or ``memory``; ``Emulator.compute``); in a step traced at
    true shapes (``shapes.estimate``) likewise; elsewhere they run as they are."""
    from .shapes import tracing
    emu, kernel, trace = current(), FusedKernel(), tracing()
    if trace is not None:
        with trace.fused(name, kind, kernel):
            yield kernel
        return
    if emu is None or not emu.timing:
        yield kernel
        return
    with emu.untimed():
        yield kernel
        flops, tensors, dims = kernel.cost()
        nbytes = emu.tensor_bytes(tensors)
    emu.compute(name, flops, nbytes, kind=kind, dims=dims)
