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
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode, _pop_mode_temporarily

from . import vclock
from .cluster import Cluster, check, cluster as make_cluster
from .efficiency import Kernel
from .opcost import OpKind, _bytes, _flop_formulas, _tensors, element_bytes, host_read  # noqa: F401 (re-exported)

BAND = {"compute x0.7": (0.7, 1.0), "compute x1.3": (1.3, 1.0), "links x0.8": (1.0, 0.8), "links x1.2": (1.0, 1.2),
        "compute x0.7, links x1.2": (0.7, 1.2), "compute x1.3, links x0.8": (1.3, 0.8),
        "compute x0.7, links x0.8": (0.7, 0.8), "compute x1.3, links x1.2": (1.3, 1.2)}
"""The sensitivity band: (achieved compute factor, link bandwidth factor) of each perturbed replay — the axes and
the corners of efficiency x0.7..x1.3 and bandwidth x0.8..x1.2."""
WHAT_IF = {"compute": [0.5, 0.7, 1.0, 1.3, 2.0], "bandwidth": [0.25, 0.5, 1.0, 2.0, 4.0]}
"""A what-if explorer's grid: the achieved compute and the links' bandwidth, each x these factors."""


def what_if(preset: str) -> dict[str, list[float]]:
    """The what-if grid a lesson replays at ``preset``: ``WHAT_IF``, or its corners and centre at ``smoke``
    (9 replays instead of 25, for the test suite)."""
    return {axis: values[::2] for axis, values in WHAT_IF.items()} if preset == "smoke" else WHAT_IF


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
        if (not kind.timed or getattr(emu._local, "internal", False)
                or (emu.ledger is not None and emu.ledger.inside_op)):
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


class Emulator:
    """One rank's virtual clock on ``cluster`` (a ``vclock.RankClock`` it drives and traces). Built and installed
    by the worker when ``launch(..., cluster=)`` is given; lessons read it through ``ctx.emulator`` (or
    ``emulator.current()``)."""

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
        self.ledger = None
        self._timer: ComputeTimer | None = None

    # ---- installation ---------------------------------------------------------------------------------------
    def install(self, ledger) -> "Emulator":
        """Hook into ``ledger`` (every torch.distributed call) and start timing compute on this thread."""
        global _CURRENT
        self.ledger = ledger
        ledger.emulator = self
        self._timer = ComputeTimer(self)
        self._timer.__enter__()
        _CURRENT = self
        return self

    def uninstall(self) -> None:
        global _CURRENT
        if self._timer is not None:
            self._timer.__exit__(None, None, None)
            self._timer = None
        if self.ledger is not None:
            self.ledger.emulator = None
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
        ledger = self.ledger
        previous = getattr(self._local, "internal", False), getattr(self._local, "paused", False)
        ledger_emulator = ledger.emulator if ledger is not None else None  # None already when nested
        if ledger is not None:
            ledger.emulator = None
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
            if ledger is not None:
                ledger.emulator = ledger_emulator

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

    # ---- communication --------------------------------------------------------------------------------------
    def ranks_of(self, group) -> list[int]:
        key = id(group)
        if key not in self._group_ranks:
            self._group_ranks[key] = (list(range(self.world_size)) if group is None or group is dist.group.WORLD
                                      else dist.get_process_group_ranks(group))
        return self._group_ranks[key]

    def _collective_key(self, group) -> tuple:
        """What the ranks of ``group`` call its next collective alike: the group's name and how many it had."""
        g = group if group is not None else dist.group.WORLD
        name = getattr(g, "group_name", None) or str(self.ranks_of(group))
        self._sequence[("c", name)] += 1
        return ("c", name, self._sequence[("c", name)])

    def _p2p_key(self, src: int, dst: int, tag: int) -> tuple:
        self._sequence[("p", src, dst, tag)] += 1
        return ("p", src, dst, tag, self._sequence[("p", src, dst, tag)])

    def _virtual_bytes(self, sent: int, tensor: torch.Tensor | None) -> float:
        """Sent bytes at the target's element size (float payloads at ``float_bytes``)."""
        if tensor is None or not sent:
            return float(sent) * self.byte_scale
        return sent * self.byte_scale * element_bytes(tensor.dtype, self.cluster.float_bytes) / tensor.element_size()

    @contextlib.contextmanager
    def _side(self):
        """The clock's own messages: neither timed, nor counted by the ledger, nor emulated."""
        with self.internal(), (self.ledger.quiet() if self.ledger is not None else contextlib.nullcontext()):
            yield

    def _issue(self, op: str, peers: list[int], wire: float, tag: str, key: tuple) -> dict:
        with self._lock:
            return self.clock.issue(self._tid(), op, [self.rank] + peers, wire, tag, key)

    def _finish(self, rec: dict, msg: "_ClockMessage") -> None:
        """The transfer of ``rec`` is waited for: this thread's stream waits for its virtual completion (a
        barrier also blocks the host)."""
        with self._side():
            start, done = msg.interval()
        with self._lock:
            self.clock.finish(self._tid(), rec, start, done, barrier=rec["op"] == "barrier")

    def _returned(self, work, rec: dict, msg: "_ClockMessage", is_async: bool):
        if not is_async:
            self._finish(rec, msg)
            return work
        return EmulatedWork(self, work, rec, msg)

    def on_collective(self, op: str, group, sent: int, args, kwargs, work, is_async: bool, tag: str):
        """A collective was issued (``work``: its handle if async): its end on this rank's link, then a side
        all_reduce(MAX) of the ends on the same group gives its completion. Returns what the caller gets."""
        tensors = _tensors((args, kwargs))
        key = self._collective_key(group)
        rec = self._issue(op, [r for r in self.ranks_of(group) if r != self.rank],
                          self._virtual_bytes(sent, tensors[0] if tensors else None), tag, key)
        with self._side():
            stamp = torch.tensor([rec["local_end"], rec["start"]], dtype=torch.float64)
            msg = _ClockMessage(dist.all_reduce(stamp, op=dist.ReduceOp.MAX, group=group, async_op=True), stamp)
        return self._returned(work, rec, msg, is_async)

    @staticmethod
    def _p2p_args(args, kwargs, key: str, group) -> tuple[int | None, int]:
        """(peer's global rank, tag) of a send/recv call."""
        peer = kwargs.get(key, args[1] if len(args) > 1 else None)
        if peer is None and kwargs.get("group_" + key) is not None:
            peer = dist.get_global_rank(group, kwargs["group_" + key])
        return peer, kwargs.get("tag", args[3] if len(args) > 3 else 0)

    def on_send(self, op: str, group, sent: int, args, kwargs, work, is_async: bool, tag: str):
        """A send: its end on this rank's link travels to the receiver beside the payload (same tag)."""
        dst, msg_tag = self._p2p_args(args, kwargs, "dst", group)
        rec = self._issue(op, [dst], self._virtual_bytes(sent, _tensors((args, kwargs))[0]), tag,
                          self._p2p_key(self.rank, dst, msg_tag))
        with self._side():
            stamp = torch.tensor([rec["local_end"], rec["start"]], dtype=torch.float64)
            msg = _ClockMessage(dist.isend(stamp, dst, group=group, tag=msg_tag), stamp)
        return self._returned(work, rec, msg, is_async)

    def on_recv(self, op: str, group, args, kwargs, work, is_async: bool, tag: str):
        """A receive: completes at the sender's end (the side message after the payload)."""
        src, msg_tag = self._p2p_args(args, kwargs, "src", group)
        if src is None:
            if is_async:
                raise ValueError("an irecv from any source (src=None) cannot be emulated: the arrival time comes "
                                 "from the sender; name src")
            src = work  # a blocking recv returns the sender's rank
        with self._lock:
            rec = self.clock.receive(self._tid(), op, tag, self._p2p_key(src, self.rank, msg_tag))
        with self._side():
            stamp = torch.zeros(2, dtype=torch.float64)
            msg = _ClockMessage(dist.irecv(stamp, src, group=group, tag=msg_tag), stamp)
        return self._returned(work, rec, msg, is_async)

    def on_batch(self, p2p_ops: list, works: list, tag: str) -> list:
        """``batch_isend_irecv``: each op's clock message goes out after all payloads, in the same order."""
        side_ops, pending = [], []
        for p in p2p_ops:
            sending = getattr(p.op, "__name__", "") == "isend"
            peer = p.peer  # a global rank
            with self._side():
                if sending:
                    rec = self._issue("isend", [peer], self._virtual_bytes(
                        p.tensor.numel() * p.tensor.element_size(), p.tensor), tag, self._p2p_key(self.rank, peer,
                                                                                                  p.tag))
                    stamp = torch.tensor([rec["local_end"], rec["start"]], dtype=torch.float64)
                else:
                    with self._lock:
                        rec = self.clock.receive(self._tid(), "irecv", tag, self._p2p_key(peer, self.rank, p.tag))
                    stamp = torch.zeros(2, dtype=torch.float64)
            side_ops.append(dist.P2POp(p.op, stamp, p.peer, p.group, p.tag))
            pending.append((rec, stamp))
        with self._side():
            side_works = dist.batch_isend_irecv(side_ops)
        return [EmulatedWork(self, work, rec, _ClockMessage(side, stamp))
                for work, side, (rec, stamp) in zip(works, side_works, pending)]

    # ---- DDP: its C++ reducer is seen only through a comm hook --------------------------------------------------
    def ddp_hook(self, state, bucket):  # no annotations: DDP checks them against Future[Tensor] objects
        """A DDP comm hook (``ddp.register_comm_hook(group_or_None, emulator.ddp_hook)``): the bucket's average by
        ``dist.all_reduce`` (seen by the ledger and this clock), waited on the main clock when backward ends."""
        t = bucket.buffer()
        group = state
        t.div_(dist.get_world_size(group))
        work = dist.all_reduce(t, group=group, async_op=True)
        torch.autograd.Variable._execution_engine.queue_callback(work.wait)
        return work.get_future().then(lambda fut: fut.value()[0])

    # ---- what the run cost, and what it would cost elsewhere ----------------------------------------------------
    def totals(self) -> dict[str, float]:
        """Modelled seconds so far: the kernels' time on the stream, the host's per-op costs, the transfers'
        link time, the time the clocks waited for communication (exposed), and the CPU time the ops took here."""
        return totals(self.clock)

    def link_busy(self, tag: str | None = None) -> dict[str, float]:
        """Seconds each of this rank's links carried transfers (issued under ledger ``tag``, or all)."""
        busy: dict[str, float] = defaultdict(float)
        for c in self.comms:
            if c["local_end"] is not None and (tag is None or c["tag"] == tag):
                busy[c["link"]] += c["local_end"] - c["start"]
        return dict(busy)

    def report(self) -> dict:
        """JSON-able: the cluster, the totals, per-op rows (calls, FLOPs, bytes, modelled and CPU seconds) and
        per-(tag, op, link) communication rows (calls, bytes, link seconds, exposed seconds)."""
        comm: dict[tuple, dict] = defaultdict(lambda: {"calls": 0, "bytes": 0.0, "link_s": 0.0, "exposed_s": 0.0})
        for c in self.comms:
            row = comm[(c["tag"], c["op"], c["link"])]
            row["calls"] += 1
            row["bytes"] += c["bytes"]
            row["link_s"] += (c["local_end"] - c["start"]) if c["local_end"] is not None else 0.0
            row["exposed_s"] += c["exposed"] or 0.0
        return {"cluster": self.cluster.name, "now_s": self.now(), "totals": self.totals(),
                "ops": {k: dict(v) for k, v in sorted(self.ops.items(), key=lambda kv: -kv[1]["model_s"])},
                "comm": [{"tag": k[0], "op": k[1], "link": k[2], **v} for k, v in comm.items()]}

    def traces(self) -> list[dict] | None:
        """Collective: every rank's trace (``vclock.export``) on rank 0, None on the others."""
        with self.paused(), self._side():
            mine = vclock.export(self.clock)
            gathered = [None] * self.world_size if self.rank == 0 else None
            dist.gather_object(mine, gathered, dst=0)
        return gathered

    def sensitivity(self, quantity, band: dict[str, tuple[float, float]] | None = None,
                    grid: dict[str, list[float]] | None = None, progress=None) -> dict:
        """Collective: ``quantity`` (a function of the ranks' clocks, ``list[vclock.RankClock]``, returning a
        number or a dict of numbers) on this run replayed at unchanged figures (``value``: equal to the live run)
        and on the cluster perturbed by each entry of ``band`` (default ``BAND``: ``(compute, bandwidth)``
        factors), with ``low`` and ``high`` over the band. ``grid`` ({"compute": [...], "bandwidth": [...]})
        adds the quantity at every pair: a what-if explorer's data. ``progress(done, total, message)`` after each
        replay (``ctx.progress``, inside a ``ctx.part`` of its own). The same dict on every rank."""
        traces = self.traces()
        out = None
        if self.rank == 0:
            out = sensitivity(traces, self.cluster, quantity, band, grid, progress)
        holder = [out]
        with self.paused(), self._side():
            dist.broadcast_object_list(holder, src=0)
        return holder[0]


def totals(clock: vclock.RankClock) -> dict[str, float]:
    """``Emulator.totals`` of one clock (a live one or a replayed one)."""
    return {"kernels_s": sum(r["model_s"] for r in clock.ops.values()),
            "launch_s": sum(r["launch_s"] for r in clock.ops.values()),
            "comm_s": sum(c["local_end"] - c["start"] for c in clock.comms if c["local_end"] is not None),
            "exposed_s": sum(c["exposed"] or 0.0 for c in clock.comms),
            "cpu_s": sum(r["cpu_s"] for r in clock.ops.values())}


def sensitivity(traces: list[dict], cluster: Cluster, quantity, band: dict[str, tuple[float, float]] | None = None,
                grid: dict[str, list[float]] | None = None, progress=None) -> dict:
    """``Emulator.sensitivity`` from traces already gathered (any process)."""
    band = BAND if band is None else band
    t0 = time.perf_counter()
    total = 1 + len(band) + (len(grid.get("compute", [1.0])) * len(grid.get("bandwidth", [1.0])) if grid else 0)
    done = [0]

    def value(compute: float, bandwidth: float):
        got = quantity(vclock.replay(traces, cluster.perturbed(compute, bandwidth)))
        done[0] += 1
        if progress is not None:
            progress(done[0], total, "the run replayed on other figures")
        return got

    base = value(1.0, 1.0)
    out = {"value": base, "band": {name: value(*factors) for name, factors in band.items()}, "factors": band}
    values = list(out["band"].values()) + [base]
    if isinstance(base, dict):
        out["low"] = {k: min(v[k] for v in values) for k in base}
        out["high"] = {k: max(v[k] for v in values) for k in base}
    else:
        out["low"], out["high"] = min(values), max(values)
    if grid:
        out["grid"] = {"compute": list(grid.get("compute", [1.0])), "bandwidth": list(grid.get("bandwidth", [1.0]))}
        out["grid"]["values"] = [[value(c, b) for b in out["grid"]["bandwidth"]] for c in out["grid"]["compute"]]
    out["replays"] = total
    out["events"] = sum(len(t["events"]) for t in traces)
    out["wall_s"] = time.perf_counter() - t0
    return out


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


class _ClockMessage:
    """The side message that carries a transfer's virtual [end, start]: one this rank sent (known here), or one
    received, or reduced (MAX over the group) into ``stamp``."""

    def __init__(self, work, stamp: torch.Tensor):
        self.work, self.stamp = work, stamp

    def ready(self) -> bool:
        return self.work.is_completed()

    def interval(self) -> tuple[float, float]:
        """(start, end) of the transfer on the wire (a collective's: its latest start and latest end)."""
        self.work.wait()
        end, start = self.stamp.tolist()
        return start, end

    def value(self) -> float:
        return self.interval()[1]


class EmulatedWork:
    """An async op's handle: ``wait()`` waits for the real op, then moves the waiting thread's clock to the op's
    virtual completion. ``is_completed()`` answers in virtual time (and only True once the real op is done too),
    so polling never moves a clock: a wait after it finds the completion already passed."""

    def __init__(self, emulator: Emulator, work, rec: dict, msg: _ClockMessage):
        self._emu, self._work, self._rec, self._msg = emulator, work, rec, msg

    def wait(self, *args, **kwargs):
        out = self._work.wait(*args, **kwargs) if self._work is not None else True
        self._emu._finish(self._rec, self._msg)
        return out

    def is_completed(self) -> bool:
        if not (self._work.is_completed() and self._msg.ready()):
            return False
        with self._emu._side():
            return self._msg.value() <= self._emu.now()

    @property
    def exposed(self) -> tuple[float, float]:
        """(seconds this op's waits moved the clock, the part of them with its bytes on the wire)."""
        return self._rec["exposed"] or 0.0, self._rec.get("exposed_wire", 0.0)

    def get_future(self):
        return self._work.get_future()

    def __getattr__(self, name):
        return getattr(self._work, name)


def metered(emu: Emulator | None, scale: dict[str, float] | None = None):
    """``emu.metered(**scale)`` (the program's own sizes when ``scale`` is None), or, without an emulator, a block
    that measures nothing (it yields an empty dict)."""
    return contextlib.nullcontext({}) if emu is None else emu.metered(**(scale or {}))


def build(spec, rank: int, world_size: int) -> Emulator:
    """An emulator from a launch spec's ``cluster`` entry (a preset name or ``Cluster.to_dict()``)."""
    c = Cluster.from_dict(spec) if isinstance(spec, dict) else make_cluster(spec)
    return Emulator(c, rank, world_size)
