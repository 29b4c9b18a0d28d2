"""The emulated cluster: the real program on real processes, timed as it would run on a cluster it is not on.

On a laptop gloo moves bytes on the cores that compute, so overlap, bubbles and compression show their bytes but
not their time. The emulator keeps the run real — the ops, their shapes, their order and their dependencies are
the program's own, and every tensor is bitwise what it is without emulation (one exception of torch's, below) —
and takes *time* from a calibrated model of a target cluster (``toolkit.runtime.cluster``), one virtual clock
per rank. This is SMPI's on-line simulation (Clauss et al. 2011; Degomme et al., TPDS 2017)::

    rank r, a real process                       its virtual clock (``toolkit.runtime.vclock``): a host that issues
    ──────────────────────                       and a stream that runs, now = max(host, stream)
    y = x @ w     (any ATen op)  ─ ComputeTimer ─► host += one eager op (Python, dispatcher, launch);
                                                   stream += the kernel at its achieved rate (GEMM tiles and waves,
                                                   attention, HBM; at least the kernel's fixed cost:
                                                   ``toolkit.runtime.efficiency``; views and empty allocations:
                                                   no kernel; .item(), host_read: the host waits)
    dist.all_gather(...)         ─ the ledger ──► end_r = max(now, link free) + NCCL's time for the op, its size
       the real op runs as usual                  and the group's placement (``toolkit.runtime.collectives``);
       + a side all_reduce(MAX) of end_r  ──────► done = max over the group's ranks of end_r; now = max(now, done)
    w = dist.isend(t, dst)       ─ the ledger ──► the sender's end travels beside the payload (same tag)
    async op ... compute ... w.wait()          ──► the stream waits for done; a kernel that runs while a
                                                   collective holds SMs (``Link.channels``) runs on the rest

    step time on the target = difference of the clock around the step (``bench`` with ``clock="virtual"``;
    ``metered()``: a block's virtual seconds, the seconds its transfers held their links, its FLOPs and ops)

Every event is also written to the rank's trace, so a finished run can be re-timed under other cluster
figures without running it again (``vclock.replay``; ``sensitivity``: the same quantity with the achieved
compute x0.7 and x1.3 and the links' bandwidth x0.8 and x1.2, the band an emulated verdict must hold across).

What the models leave out: contention between ranks (two ranks sharing a switch port, a NIC shared by two flows
of different ranks); a late peer delays a collective's completion but not this rank's link. A rank's transfers
queue on its own link (one at a time, in issue order; a side thread's in a queue of its own).
``scaled(flops=, bytes=)`` multiplies every op's FLOPs and every tensor's bytes, transfers included (the
workload-matched mode: a toy's ops timed as the real model's; a GEMM's shape grows by the cube root of the FLOP
factor in each dimension, so its efficiency is read at that size).

Values: every op runs unchanged, with one exception torch makes for any Python dispatch mode (this one, or
``FlopCounterMode``): ``torch.linalg.svdvals`` and ``eigvalsh``, and what calls them (``matrix_norm`` with ``ord``
2, -2 or "nuc", ``cond``), then compute the vectors too, as they do for autograd, and LAPACK's other path moves
the values' last bits (float64: within 1e-12 of the largest value; ``tests/test_emulator.py`` pins it). The
toolkit computes them paused (lesson 05's spectral tails).

The measured CPU time of every op is kept beside its modelled time (``report()["ops"]``), never driving the clock.
Clocks are per thread; a thread that takes work from another carries its time with ``fork()`` / ``join(stamp)``
(``worker(stamp)`` also times the ATen ops it runs). On one thread everything here is deterministic: the same job
gives the same virtual times at any load, and on any machine that runs the same ATen ops. With a side thread one
thing depends on which thread reaches the clock first: a comm kernel that starts before kernels another thread has
already queued slows them by the SMs it takes (``vclock.RankClock.issue``), and a kernel queued after it is slowed
the same way, but a stamp handed over in between (``fork``) keeps the earlier time. Lesson 13's comm thread moved a
33 ms step by 1.8 µs this way once in CI; a replay of the recorded trace gives back those same times.

Where each part lives: this module (the clocks, compute, host copies and disk I/O, ``paused``),
``emulated_comm`` (the comm ledger's observer: collectives and point-to-point), ``emulator_report`` (totals,
reports, the sensitivity band). Technique code never sees any of them: ``toolkit.runtime.portable`` gives it
verbs that mean the same with and without an emulated cluster.
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict

from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode, _pop_mode_temporarily

from . import vclock
from .cluster import Cluster, check, cluster as make_cluster
from .efficiency import Kernel
from .emulated_comm import CommHooks
from .emulator_report import Reports, sensitivity, what_if
from .ledger import inside_op
from .opcost import OpKind, _bytes, _flop_formulas, _tensors, host_read

__all__ = ["ComputeTimer", "Emulator", "LocalTransfer", "build", "current", "host_read", "metered", "sensitivity",
           "what_if"]
"""What lessons import from here (``host_read``, ``sensitivity`` and ``what_if`` live in ``opcost`` and
``emulator_report``)."""

class ComputeTimer(TorchDispatchMode):
    """Sees every ATen op a rank runs (forward and backward) and advances the emulator's clock by its kernel's
    time; runs the op unchanged and measures its real CPU time beside it."""

    def __init__(self, emulator: "Emulator"):
        super().__init__()
        self.emulator = emulator
        self.formulas = _flop_formulas()
        self.kinds: dict = {}  # OpOverload -> OpKind

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = self.kinds.get(func)
        if kind is None:
            kind = self.kinds[func] = OpKind(func, self.formulas)
        emu = self.emulator
        if not kind.timed or getattr(emu._local, "internal", False) or inside_op():
            return func(*args, **kwargs)  # no kernel, or part of a collective (gloo's own copies): no compute time
        t0 = time.perf_counter()
        out = func(*args, **kwargs)
        cpu_s = time.perf_counter() - t0
        emu.run_kernel(kind.name, kind.kernel(args, kwargs, out, emu.cluster.float_bytes), cpu_s)
        if kind.host_sync:  # the host needs the value: it waits for the stream
            emu.synchronize()
        return out


# ---- the emulator ------------------------------------------------------------------------------------------------
_CURRENT: "Emulator | None" = None


def current() -> "Emulator | None":
    """The emulator of this rank: None when the launch has no ``cluster``, and on a thread inside ``paused()``
    (the block runs as without one: a comm thread it hands work to carries no clock either)."""
    emu = _CURRENT
    return None if emu is None or getattr(emu._local, "paused", False) else emu


class Emulator(CommHooks, Reports):
    """One rank's virtual clock on ``cluster`` (a ``vclock.RankClock`` it drives and traces). Built and installed
    by the worker when ``launch(..., cluster=)`` is given; lessons read it through ``ctx.emulator``, technique code
    never (``toolkit.runtime.portable``: verbs that mean the same with and without it). Its communication is
    ``CommHooks`` (the comm ledger's observer), its reports ``Reports``."""

    def __init__(self, cluster: Cluster, rank: int, world_size: int):
        self.cluster, self.rank, self.world_size = check(cluster, world_size), rank, world_size
        self.clock = vclock.RankClock(self.cluster, rank, world_size)
        self.flop_scale = 1.0  # scaled(): the workload-matched mode
        self.byte_scale = 1.0
        self._lock = threading.RLock()
        self._local = threading.local()
        self._main = threading.get_ident()
        self._tids: dict[int, int] = {self._main: 0}
        self._group_ranks: dict[int, list[int]] = {}
        self._sequence: dict[tuple, int] = defaultdict(int)  # per group / per (src, dst, tag): calls so far
        self._labels: dict[str, int] = defaultdict(int)
        self._pauses = 0  # threads inside paused(): the ledger's calls pass through (CommHooks)
        self._timer: ComputeTimer | None = None

    # ---- installation ---------------------------------------------------------------------------------------
    def install(self, ledger) -> "Emulator":
        """Observe ``ledger`` (every torch.distributed call: ``CommHooks``) and start timing compute on this
        thread. The ledger holds the emulator, never the other way round."""
        global _CURRENT
        ledger.observer = self
        self._timer = ComputeTimer(self)
        self._timer.__enter__()
        _CURRENT = self
        return self

    def uninstall(self) -> None:
        """Stop timing compute, and be ``current()`` no more. A ledger it observes still calls it: a rank's ledger
        and emulator live as long as its process (tests drop both)."""
        global _CURRENT
        if self._timer is not None:
            self._timer.__exit__(None, None, None)
            self._timer = None
        _CURRENT = None

    # ---- threads and the clock ------------------------------------------------------------------------------
    def _tid(self, start=None) -> int:
        """This thread's id in the clock (0: the main thread); a new thread's clock starts at ``start`` or where
        the main thread is now."""
        ident = threading.get_ident()
        with self._lock:
            tid = self._tids.get(ident)
            if tid is None:
                tid = self._tids[ident] = len(self._tids)
                self.clock.thread(tid, start)
        return tid

    @property
    def ops(self) -> dict[str, dict]:
        return self.clock.ops

    @property
    def comms(self) -> list[dict]:
        return self.clock.comms

    def now(self) -> float:
        """This thread's virtual time, seconds (0 when the ranks left the start barrier): when both its host has
        issued everything so far and its stream has run it, i.e. what a synchronize here would return."""
        with self._lock:
            return self.clock.now(self._tid())

    def mark(self, name: str) -> float:
        """This thread's time, recorded under ``name`` so that a replay reads it back (``vclock.RankClock.marks``)."""
        with self._lock:
            return self.clock.mark(self._tid(), name)

    @contextlib.contextmanager
    def window(self, name: str):
        """Mark the block as ``name`` (its start and end, after a synchronize: the stream's work inside counts),
        so that a replay reads its time back (``vclock.RankClock.window``); yields nothing."""
        self.mark(f"{name}:start")
        yield
        self.synchronize()
        self.mark(f"{name}:end")

    def label(self, prefix: str) -> str:
        """A fresh name for a group of marks (``prefix#1``, ``prefix#2``, ...): the same on every rank that makes
        the same calls."""
        self._labels[prefix] += 1
        return f"{prefix}#{self._labels[prefix]}"

    def synchronize(self) -> None:
        """The host waits for its stream (``torch.cuda.synchronize``, ``.item()``, a barrier)."""
        with self._lock:
            self.clock.sync(self._tid())

    def wait_until(self, t: float) -> float:
        """This thread's stream waits for an event at ``t``; returns the time its ``now`` moved."""
        with self._lock:
            return self.clock.wait_until(self._tid(), t)

    def reset(self) -> None:
        """Every clock, link and record back to 0 (the worker calls it right after the start barrier)."""
        with self._lock:
            self.clock.reset()

    def fork(self) -> vclock.Stamp:
        """A stamp of this thread's time, for a thread that takes over work from it (``join``)."""
        with self._lock:
            return self.clock.fork(self._tid())

    def join(self, stamp: float) -> None:
        """This thread continues work handed over at ``stamp`` (its host and stream move there if behind; a thread
        without a clock yet starts at ``stamp``, not where the main thread happens to be now)."""
        with self._lock:
            if threading.get_ident() not in self._tids:
                self._tid(stamp)
            else:
                self.clock.join(self._tid(), stamp)

    @contextlib.contextmanager
    def worker(self, stamp: float):
        """On a thread of its own (a comm thread, a pool's worker): the work inside was handed over at ``stamp``
        (``fork()`` on the thread that handed it). The clock joins the stamp, and the block's ATen ops are timed
        on this thread's clock, as the main thread's are (a dispatch mode is per thread)."""
        self.join(stamp)
        with ComputeTimer(self):
            yield self

    @contextlib.contextmanager
    def scaled(self, flops: float = 1.0, bytes: float = 1.0):  # noqa: A002 - the name of what is scaled
        """Inside, every op counts ``flops`` times its FLOPs and ``bytes`` times its bytes, and every transfer
        carries ``bytes`` times its bytes; the fixed costs are unchanged. This is the workload-matched mode: the
        toy's tensors stand for tensors ``bytes`` times larger, its GEMMs for ``flops`` times more work, as in the
        real model it stands for (``toolkit.models.catalog`` and ``matched_scales`` give the factors)."""
        for name, value in (("flops", flops), ("bytes", bytes)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"scaled({name}=...) must be a number > 0, got {value!r}")
        previous = self.flop_scale, self.byte_scale
        self.flop_scale, self.byte_scale = float(flops), float(bytes)
        try:
            yield self
        finally:
            self.flop_scale, self.byte_scale = previous

    @contextlib.contextmanager
    def metered(self, flops: float = 1.0, bytes: float = 1.0):  # noqa: A002 - as scaled()
        """The block on this thread's clock, under ``scaled(flops, bytes)``: yields a dict that holds, once the
        block ends, ``s`` (the virtual seconds it took), ``wire_s`` (the seconds its transfers and copies held
        their links), ``flops`` (the FLOPs its ops counted, unscaled: the program's own) and ``ops`` (each op's
        modelled kernel seconds in the block, by name)."""
        got: dict = {}
        with self._lock:
            before = {name: row["model_s"] for name, row in self.ops.items()}
        first, t0, f0 = len(self.comms), self.now(), self.flops()
        with self.scaled(flops, bytes):
            yield got
        with self._lock:
            ops = {name: row["model_s"] - before.get(name, 0.0) for name, row in self.ops.items()}
        got.update(s=self.now() - t0, flops=self.flops() - f0, ops={k: v for k, v in ops.items() if v > 0},
                   wire_s=sum(c["local_end"] - c["start"] for c in self.comms[first:] if c["local_end"] is not None))

    def tensor_bytes(self, tensors) -> float:
        """Bytes of ``tensors`` on the target (floats at ``Cluster.float_bytes`` per element), unscaled."""
        return float(_bytes(_tensors(tensors), self.cluster.float_bytes))

    def flops(self) -> float:
        """FLOPs counted so far on this rank (unscaled: the program's own)."""
        with self._lock:
            return sum(row["flops"] for row in self.ops.values())

    @contextlib.contextmanager
    def graph_replay(self):
        """The ops inside run as one CUDA graph replay: the host pays one launch for all of them, none per op;
        every kernel still pays its fixed cost on the device."""
        with self._lock:
            self.clock.graph(self._tid(), True)
        try:
            yield self
        finally:
            with self._lock:
                self.clock.graph(self._tid(), False)

    @contextlib.contextmanager
    def paused(self):
        """Inside, this rank runs as without an emulated cluster: its ops pass untimed and unrecorded (the timer
        leaves the dispatch stack), collectives carry no clock message, host copies and disk I/O take no time, the
        clocks stand still (the sections of a lesson that measure the real run only, without the emulator's
        bookkeeping on every op). Collective: the ranks of a group pause around the same collectives."""
        previous = getattr(self._local, "internal", False), getattr(self._local, "paused", False)
        with self._lock:
            self._pauses += 1  # collectives on any thread carry no clock until the last pause ends
        self._local.internal = self._local.paused = True
        # this thread's timer off the dispatch stack: ops run at native speed, not through Python (+50 % a step)
        top = _get_current_dispatch_mode()
        off_stack = _pop_mode_temporarily() if isinstance(top, ComputeTimer) and top.emulator is self else \
            contextlib.nullcontext()
        try:
            with off_stack:
                yield self
        finally:
            self._local.internal, self._local.paused = previous
            with self._lock:
                self._pauses -= 1

    @property
    def timing(self) -> bool:
        """Whether this thread's ops are timed now (False inside ``paused``, ``untimed`` and ``internal``)."""
        return not getattr(self._local, "internal", False)

    @contextlib.contextmanager
    def internal(self):
        """Ops inside are the emulator's own bookkeeping: not timed."""
        previous = getattr(self._local, "internal", False)
        self._local.internal = True
        try:
            yield
        finally:
            self._local.internal = previous

    def untimed(self):
        """The ops inside take no time (the real copies behind ``host_copy`` and ``disk_io``: their time is the
        link's)."""
        return self.internal()

    # ---- the host and the disk: offload's copies, a CPU-side optimizer -------------------------------------
    def host_copy(self, nbytes: float, to_host: bool, tag: str = "offload", after: float = 0.0) -> "LocalTransfer":
        """A copy of ``nbytes`` between this rank's device and its host memory, on a copy engine (the PCIe link,
        one queue per direction): it starts when the stream has produced the data, the link is free and
        (``after``) an earlier copy it depends on has ended; compute goes on meanwhile. ``wait()`` on the handle
        makes the stream wait for it (the data is needed); the real copy ops belong inside ``untimed()``."""
        queue = "d2h" if to_host else "h2d"
        return self._local_transfer(queue, nbytes * self.byte_scale, tag, queue, after=after)

    def disk_io(self, nbytes: float, write: bool, tag: str = "nvme") -> "LocalTransfer":
        """A read or write of ``nbytes`` on this rank's share of the node's NVMe drives (one queue), as
        ``host_copy``."""
        return self._local_transfer("disk", nbytes * self.byte_scale, tag, "write" if write else "read", write)

    def _local_transfer(self, queue: str, nbytes: float, tag: str, op: str, write: bool = False,
                        after: float = 0.0) -> "LocalTransfer":
        if getattr(self._local, "paused", False):  # paused: the copy takes no time and is not recorded
            issue = self.clock.now(0)
            return LocalTransfer(self, {"op": op, "tag": tag, "link": queue, "bytes": nbytes, "issue": issue,
                                        "start": issue, "local_end": issue, "done": None, "exposed": None})
        with self._lock:
            return LocalTransfer(self, self.clock.local(self._tid(), queue, nbytes, tag, op, write, after))

    @contextlib.contextmanager
    def on_host(self):
        """The ops inside run on the host CPU (a CPU-side optimizer step): timed by ``Cluster.cpu``'s roofline on
        this thread's host clock, no launches; the stream is not involved."""
        previous = getattr(self._local, "on_host", False)
        self._local.on_host = True
        try:
            yield self
        finally:
            self._local.on_host = previous

    # ---- compute --------------------------------------------------------------------------------------------
    def run_kernel(self, name: str, kernel: Kernel, cpu_s: float = 0.0) -> float:
        """One kernel on this thread (``vclock.RankClock.compute``), under ``scaled``; returns its seconds."""
        with self._lock:
            tid = self._tid()
            return self.clock.compute(tid, self.clock.kernel_id(name, kernel), self.flop_scale, self.byte_scale,
                                      getattr(self._local, "on_host", False), cpu_s)

    def compute(self, name: str, flops: float, nbytes: float, cpu_s: float = 0.0, kind: str | None = None,
                dims: tuple = ()) -> float:
        """One kernel the toolkit describes itself (a fused Triton kernel, ring attention's block): ``kind``
        ``gemm``, ``attention`` or ``memory`` (default: GEMM-like when it has FLOPs), ``dims`` its shape
        (``toolkit.runtime.efficiency.Kernel``). Returns its seconds."""
        kind = kind or ("gemm" if flops > 0 else "memory")
        return self.run_kernel(name, Kernel(kind, float(flops), float(nbytes), tuple(dims)), cpu_s)

class LocalTransfer:
    """A copy on this rank's host link or disk (``Emulator.host_copy`` / ``disk_io``): ``wait()`` makes the stream
    wait for it, ``wait_host()`` the host (a CPU-side step that reads the copied data)."""

    def __init__(self, emulator: Emulator, rec: dict):
        self._emu, self._rec = emulator, rec

    @property
    def end(self) -> float:
        """When the copy ends (a stamp a later copy can start ``after``)."""
        if "index" not in self._rec:  # paused: no record in the clock
            return self._rec["local_end"]
        return self._emu.clock.end_stamp(self._rec)

    def wait(self) -> float:
        """The stream waits for the copy; returns the time the clock moved (0: it was done in time)."""
        if "index" not in self._rec:
            return 0.0
        with self._emu._lock:
            return self._emu.clock.local_wait(self._emu._tid(), self._rec)

    def wait_host(self) -> float:
        """The host waits for the copy (its data is read by host code next)."""
        if "index" not in self._rec:
            return 0.0
        with self._emu._lock:
            return self._emu.clock.local_wait(self._emu._tid(), self._rec, host=True)


def metered(emu: Emulator | None, scale: dict[str, float] | None = None):
    """``emu.metered(**scale)`` (the program's own sizes when ``scale`` is None), or, without an emulator, a block
    that measures nothing (it yields an empty dict)."""
    return contextlib.nullcontext({}) if emu is None else emu.metered(**(scale or {}))


def build(spec, rank: int, world_size: int) -> Emulator:
    """An emulator from a launch spec's ``cluster`` entry (a preset name or ``Cluster.to_dict()``)."""
    c = Cluster.from_dict(spec) if isinstance(spec, dict) else make_cluster(spec)
    return Emulator(c, rank, world_size)
