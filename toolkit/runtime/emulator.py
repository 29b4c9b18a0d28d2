"""The emulated cluster: the real program on real processes, timed as it would run on a cluster it is not on.

On a laptop gloo moves bytes on the cores that compute, so overlap, bubbles and compression show their bytes but
not their time. The emulator keeps the run real — the ops, their shapes, their order and their dependencies are
the program's own, and every tensor is bitwise what it is without emulation (one exception of torch's, below) —
and takes *time* from models of a target cluster (``toolkit.runtime.cluster``), one virtual clock per rank. This
is SMPI's on-line simulation (Clauss et al. 2011; Degomme et al., TPDS 2017), with a roofline for the compute::

    rank r, a real process                       its virtual clock (seconds on the target cluster): a host that
    ──────────────────────                       issues and a stream that runs, now = max(host, stream)
    y = x @ w     (any ATen op)  ─ ComputeTimer ─► host += launch; stream = max(host, stream) + max(FLOPs / peak,
                                                   bytes / HBM)   (views and empty allocations: no kernel, no time;
                                                   .item(), host_read and the like: the host waits)
    dist.all_gather(...)         ─ the ledger ──► end_r = max(now, link free) + α + S/β   on the link the group spans
       the real op runs as usual                  link free = end_r            (this rank's transfers queue on it)
       + a side all_reduce(MAX) of end_r  ──────► done = max over the group's ranks of end_r; now = max(now, done)
    w = dist.isend(t, dst)       ─ the ledger ──► end = max(now, link free) + α + S/β; the end travels beside the
                                                   payload as a 1-element message with the same tag (eager: the
                                                   sender does not wait for the receiver to post)
    w = dist.irecv(t, src) ... w.wait()        ──► stream = max(stream, the sender's end)
    async op ... compute ... w.wait()          ──► the clock went on while the link was busy; the wait moves the
                                                   stream to max(stream, done), as NCCL's wait orders the compute
                                                   stream after the transfer: the exposed part is what now moved

    step time on the target = difference of the clock around the step (``bench`` with ``clock="virtual"``;
    ``metered()``: a block's virtual seconds, the seconds its transfers held their links, its FLOPs and ops)

What the models take, what they leave out:
- Compute: FLOPs as ``torch.utils.flop_counter`` counts them (matmuls and attention), and QR and SVD by Golub & Van
  Loan's counts (``qr_flops``, ``svd_flops``: flop_counter has none); other ops 0 (their bytes time them). Bytes: the
  op's tensor inputs plus outputs. A factorisation is timed at the bf16 peak like a GEMM and charged one launch:
  optimistic for cuSOLVER, whose fp32 kernels at a compressor's thin shapes are latency-bound and several. Float
  tensors are timed at ``Cluster.float_bytes`` per element (bf16 on the GPU, whatever the CPU run holds, usually
  fp32). Every op that launches a kernel costs the host ``GPU.launch_s``; the
  host runs ahead of the stream, so launches hide behind long kernels and dominate short ones (inside
  ``graph_replay()`` the host pays one launch for all). ``scaled(flops=, bytes=)`` multiplies every op's FLOPs
  and every tensor's bytes, transfers included (the workload-matched mode: a toy's ops timed as the real model's).
- Communication: Hockney α–β per call on the link the group spans (``Cluster.link_between``), bytes as the ledger
  counts them (nccl-tests' bus-bandwidth convention). A rank's transfers queue on its own link (one at a time,
  in issue order; a side thread's in a queue of its own); contention *between* ranks (two ranks sharing a switch
  port, a NIC shared by two flows of different ranks) is not modelled. A late peer delays a collective's
  completion but not this rank's link.
- Host: the CPU time of Python and of the dispatcher is not charged; the launch term stands for it. One stream per
  host thread (compute and communication kernels do not contend for the GPU's SMs).
- Values: every op runs unchanged, with one exception torch makes for any Python dispatch mode (this one, or
  ``FlopCounterMode``): ``torch.linalg.svdvals`` and ``eigvalsh``, and what calls them (``matrix_norm`` with
  ``ord`` 2, -2 or "nuc", ``cond``), then compute the vectors too, as they do for autograd, and LAPACK's other
  path moves the values' last bits (float64: within 1e-12 of the largest value;
  ``tests/test_emulator.py`` pins it). The toolkit computes them paused (lesson 05's spectral tails).

The measured CPU time of every op is kept beside its modelled time (``report()["ops"]``), never driving the clock.
Clocks are per thread; a thread that takes work from another carries its time with ``fork()`` / ``join(stamp)``
(``worker(stamp)`` also times the ATen ops it runs).
Everything here is deterministic: the same job gives the same virtual times at any load, and on any machine that
runs the same ATen ops. Where values decide shapes (MoE routing, a rank chosen from a gradient), a CPU kernel
path that rounds differently (AVX2 against AVX-512) may run slightly different ops: seen as 0.40x against 0.39x in
lesson 05's matched sync.
"""
from __future__ import annotations

import contextlib
import math
import threading
import time
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode, _pop_mode_temporarily

from .cluster import Cluster, check, cluster as make_cluster

# ---- which ATen ops are kernels, and what they cost ------------------------------------------------------------
COLLECTIVE_NAMESPACES = ("c10d.", "_c10d_functional.", "c10d_functional.")
# not views by their schema, but they launch no kernel either (a new header, or memory from the allocator)
NO_KERNEL = {"aten._unsafe_view", "aten._reshape_alias", "aten.lift_fresh", "aten.empty", "aten.empty_like",
             "aten.empty_strided", "aten.new_empty", "aten.new_empty_strided", "aten.set_"}
# ops that make the host wait for the device (the value goes to Python); toolkit.to_host: ``host_read``
HOST_SYNC = {"aten._local_scalar_dense", "aten.is_nonzero", "aten.item", "aten.equal", "toolkit.to_host"}
# ops that read a few rows of a large input: bytes = indices + 2 x output, not the whole table
GATHER_LIKE = {"aten.embedding", "aten.index_select", "aten.gather", "aten.index"}


@torch.library.custom_op("toolkit::to_host", mutates_args=())
def _to_host(t: torch.Tensor) -> torch.Tensor:
    return t.to("cpu", copy=True)


def host_read(t: torch.Tensor) -> list:
    """``t.tolist()`` through one op, ``toolkit.to_host``: the copy to the host's memory that ``.tolist()`` of a
    device tensor makes, after which the host holds the values (it waited for the device). The emulated cluster's
    clock and ``toolkit.graphs.audit`` see it as a host sync; a plain ``.tolist()`` of a CPU tensor dispatches no op,
    so on this machine neither would see that the host needs the value (DeepEP's normal mode sizing its receive
    buffers from the exchanged counts, for one)."""
    return _to_host(t.detach()).tolist()


def launches_kernel(func) -> bool:
    """Whether an ATen op (an ``OpOverload``) computes: not a view (``func.is_view``: ``view``, ``t``,
    ``transpose``, ``expand``, ``detach``, ...) and not in ``NO_KERNEL``. On a GPU such an op is about one
    kernel launch (some launch none or several: ``cudaLaunchKernel`` from the profiler is the real count)."""
    return not func.is_view and str(func.overloadpacket) not in NO_KERNEL


def _sdpa_cpu_flops(q, k, v, *args, out_val=None, **kwargs) -> int:
    from torch.utils.flop_counter import sdpa_flop_count
    return sdpa_flop_count(q.shape, k.shape, v.shape)


def _sdpa_cpu_backward_flops(grad_out, q, k, v, *args, out_val=None, **kwargs) -> int:
    from torch.utils.flop_counter import sdpa_backward_flop_count
    return sdpa_backward_flop_count(grad_out.shape, q.shape, k.shape, v.shape)


def _batch_l_k(a: torch.Tensor) -> tuple[int, int, int]:
    """(matrices in the batch, longer side l, shorter side k) of a [..., m, n] input."""
    m, n = a.shape[-2], a.shape[-1]
    return math.prod(a.shape[:-2]), max(m, n), min(m, n)


def qr_flops(a: torch.Tensor, mode: str = "reduced", *args, out_val=None, **kwargs) -> int:
    """Householder QR of [..., m, n] (LAPACK geqrf): 2lk² − 2k³/3 per matrix, l = max(m, n), k = min(m, n); forming
    Q (orgqr, modes "reduced" and "complete") as much again (Golub & Van Loan, Matrix Computations, 4th ed., 5.2)."""
    batch, l, k = _batch_l_k(a)
    factor = 2 * l * k * k - 2 * k ** 3 / 3
    return int(batch * factor * (1 if mode == "r" else 2))


def svd_flops(a: torch.Tensor, full_matrices: bool = False, compute_uv: bool = True, *args, out_val=None,
              **kwargs) -> int:
    """SVD of [..., m, n] by Golub–Kahan–Reinsch, per matrix (Golub & Van Loan, 4th ed., Fig. 8.6.1): the values only
    4lk² − 4k³/3; with thin U and V 14lk² + 8k³; with full U and V 4l²k + 8lk² + 9k³."""
    batch, l, k = _batch_l_k(a)
    if not compute_uv:
        per = 4 * l * k * k - 4 * k ** 3 / 3
    elif full_matrices:
        per = 4 * l * l * k + 8 * l * k * k + 9 * k ** 3
    else:
        per = 14 * l * k * k + 8 * k ** 3
    return int(batch * per)


def _flop_formulas() -> dict:
    """flop_counter's registry (matmuls, convolutions, attention), plus the CPU flash-attention kernels it does not
    list (same formulas) and the factorisations a compressor runs (QR, SVD: flop_counter counts them as 0)."""
    from torch.utils.flop_counter import flop_registry
    table = dict(flop_registry)
    aten = torch.ops.aten
    for name, formula in (("_scaled_dot_product_flash_attention_for_cpu", _sdpa_cpu_flops),
                          ("_scaled_dot_product_flash_attention_for_cpu_backward", _sdpa_cpu_backward_flops),
                          ("linalg_qr", qr_flops), ("_linalg_svd", svd_flops)):
        if hasattr(aten, name):
            table[getattr(aten, name)] = formula
    return table


def _tensors(tree) -> list[torch.Tensor]:
    out = []
    stack = [tree]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
    return out


def element_bytes(dtype: torch.dtype, float_bytes: int) -> int:
    """Bytes per element on the target: floats of 16 to 32 bits as ``float_bytes`` (bf16: 2), others as they are."""
    if dtype.is_floating_point and 2 <= dtype.itemsize <= 4:
        return float_bytes
    return dtype.itemsize


def _bytes(tensors, float_bytes: int) -> int:
    return sum(t.numel() * element_bytes(t.dtype, float_bytes) for t in tensors)


def op_cost(func, args, kwargs, out, float_bytes: int, formulas: dict) -> tuple[float, float]:
    """(FLOPs, bytes moved) of one ATen op: FLOPs by ``formulas`` (``_flop_formulas``); bytes = tensors read (the
    inputs, not the ``out=`` buffers, which are only written) + tensors written (the outputs)."""
    return _OpKind(func, formulas).cost(args, kwargs, out, float_bytes)


def _signature(x):
    """A hashable stand-in for a formula's arguments: tensors by shape (a FLOP formula reads nothing else)."""
    if isinstance(x, torch.Tensor):
        return tuple(x.shape)
    if isinstance(x, (list, tuple)):
        return tuple(_signature(v) for v in x)
    if isinstance(x, dict):
        return tuple((k, _signature(v)) for k, v in x.items())
    return x if isinstance(x, (int, float, bool, str, type(None), torch.dtype)) else repr(x)


class _OpKind:
    """What one ATen overload is, worked out once per overload (the dispatch mode sees thousands of calls a step):
    its name, whether it is timed, and how its FLOPs and bytes are counted. FLOPs are cached by argument shapes
    (a formula runs torch's pytree over its arguments: as slow as the op itself at the course's sizes)."""

    __slots__ = ("name", "timed", "host_sync", "formula", "written", "gather_like", "flops_by_shape")

    def __init__(self, func, formulas: dict):
        self.name = str(func.overloadpacket)
        self.timed = launches_kernel(func) and not self.name.startswith(COLLECTIVE_NAMESPACES)
        self.host_sync = self.name in HOST_SYNC
        self.formula = formulas.get(func.overloadpacket)
        self.written = frozenset(a.name for a in func._schema.arguments if a.is_out)  # out=, or Q=/R= of qr.out
        self.gather_like = self.name in GATHER_LIKE
        self.flops_by_shape: dict = {}

    def flops(self, args, kwargs, out) -> float:
        if self.formula is None:
            return 0.0
        key = (_signature(args), _signature(kwargs))
        flops = self.flops_by_shape.get(key)
        if flops is None:
            flops = self.flops_by_shape[key] = float(self.formula(*args, **kwargs, out_val=out))
        return flops

    def cost(self, args, kwargs, out, float_bytes: int) -> tuple[float, float]:
        read = _tensors((args, {k: v for k, v in kwargs.items() if k not in self.written} if self.written else kwargs))
        if self.gather_like:
            index = [t for t in read if not t.dtype.is_floating_point]
            nbytes = _bytes(index, float_bytes) + 2 * _bytes(_tensors(out), float_bytes)
        else:
            nbytes = _bytes(read, float_bytes) + _bytes(_tensors(out), float_bytes)
        return self.flops(args, kwargs, out), float(nbytes)


class ComputeTimer(TorchDispatchMode):
    """Sees every ATen op a rank runs (forward and backward) and advances the emulator's clock by its roofline
    time; runs the op unchanged and measures its real CPU time beside it."""

    def __init__(self, emulator: "Emulator"):
        super().__init__()
        self.emulator = emulator
        self.formulas = _flop_formulas()
        self.kinds: dict = {}  # OpOverload -> _OpKind

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = self.kinds.get(func)
        if kind is None:
            kind = self.kinds[func] = _OpKind(func, self.formulas)
        emu = self.emulator
        if (not kind.timed or getattr(emu._local, "internal", False)
                or (emu.ledger is not None and emu.ledger.inside_op)):
            return func(*args, **kwargs)  # no kernel, or part of a collective (gloo's own copies): no compute time
        t0 = time.perf_counter()
        out = func(*args, **kwargs)
        cpu_s = time.perf_counter() - t0
        flops, nbytes = kind.cost(args, kwargs, out, emu.cluster.float_bytes)
        emu.compute(kind.name, flops, nbytes, cpu_s)
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
    """One rank's virtual clock on ``cluster``. Built and installed by the worker when ``launch(..., cluster=)``
    is given; lessons read it through ``ctx.emulator`` (or ``emulator.current()``)."""

    def __init__(self, cluster: Cluster, rank: int, world_size: int):
        self.cluster, self.rank, self.world_size = check(cluster, world_size), rank, world_size
        self.flop_scale = 1.0  # scaled(): the workload-matched mode
        self.byte_scale = 1.0
        self._replay_depth = 0
        self._lock = threading.RLock()
        self._local = threading.local()
        self._main = threading.get_ident()
        self._main_clock = _Clock(0.0, 0.0)
        self._link_free: dict[str, float] = defaultdict(float)
        self._group_ranks: dict[int, list[int]] = {}
        self.ops: dict[str, dict] = defaultdict(lambda: {"calls": 0, "flops": 0.0, "bytes": 0.0, "model_s": 0.0,
                                                          "launch_s": 0.0, "cpu_s": 0.0})
        self.comms: list[dict] = []
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

    # ---- the clock: a host that issues, a stream that executes ---------------------------------------------------
    def _clock(self) -> "_Clock":
        clock = getattr(self._local, "clock", None)
        if clock is None:
            if threading.get_ident() == self._main:
                clock = self._main_clock
            else:  # a thread nobody joined starts where the main thread is
                clock = _Clock(self._main_clock.now, self._main_clock.now)
            self._local.clock = clock
        return clock

    def now(self) -> float:
        """This thread's virtual time, seconds (0 when the ranks left the start barrier): when both its host has
        issued everything so far and its stream has run it, i.e. what a synchronize here would return."""
        return self._clock().now

    def synchronize(self) -> None:
        """The host waits for its stream (``torch.cuda.synchronize``, ``.item()``, a barrier)."""
        clock = self._clock()
        clock.host = clock.stream = clock.now

    def wait_until(self, t: float) -> float:
        """This thread's stream waits for an event at ``t`` (a transfer's completion); returns the time the
        thread's ``now`` moved (the exposed part of the wait)."""
        clock = self._clock()
        before = clock.now
        clock.stream = max(clock.stream, t)
        return clock.now - before

    def reset(self) -> None:
        """Every clock and link back to 0 (the worker calls it right after the start barrier)."""
        self._main_clock = _Clock(0.0, 0.0)
        self._local = threading.local()
        self._link_free.clear()
        self.comms.clear()
        self.ops.clear()

    def fork(self) -> float:
        """A stamp of this thread's time, for a thread that takes over work from it (``join``)."""
        return self.now()

    def join(self, stamp: float) -> None:
        """This thread continues work handed over at ``stamp`` (its host and stream move there if behind; a thread
        without a clock yet starts at ``stamp``, not where the main thread happens to be now)."""
        if getattr(self._local, "clock", None) is None and threading.get_ident() != self._main:
            self._local.clock = _Clock(stamp, stamp)
        clock = self._clock()
        clock.host, clock.stream = max(clock.host, stamp), max(clock.stream, stamp)

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
        carries ``bytes`` times its bytes; the launch and α terms are unchanged. This is the workload-matched
        mode: the toy's tensors stand for tensors ``bytes`` times larger, its GEMMs for ``flops`` times more work,
        as in the real model it stands for (``toolkit.planner.matched_scales`` gives the factors)."""
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
        """FLOPs counted so far on this rank (unscaled)."""
        with self._lock:
            return sum(row["flops"] for row in self.ops.values())

    @contextlib.contextmanager
    def graph_replay(self):
        """The ops inside run as one CUDA graph replay: the host pays one launch for all of them, none per op."""
        self._replay_depth += 1
        if self._replay_depth == 1:
            launch = self.cluster.gpu.launch_s
            self._clock().host += launch
            with self._lock:
                row = self.ops["cuda graph replay"]
                row["calls"] += 1
                row["launch_s"] += launch
        try:
            yield self
        finally:
            self._replay_depth -= 1

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

    # ---- the host and the disk: offload's copies, a CPU-side optimizer -------------------------------------
    def host_copy(self, nbytes: float, to_host: bool, tag: str = "offload", after: float = 0.0) -> "LocalTransfer":
        """A copy of ``nbytes`` between this rank's device and its host memory, on a copy engine (the PCIe link,
        one queue per direction): it starts when the stream has produced the data, the link is free and
        (``after``) an earlier copy it depends on has ended; compute goes on meanwhile. ``wait()`` on the handle
        makes the stream wait for it (the data is needed); the real copy ops belong inside ``untimed()``."""
        return self._local_transfer("d2h" if to_host else "h2d", self.cluster.host.seconds(nbytes * self.byte_scale),
                                    nbytes * self.byte_scale, tag, after=after)

    def disk_io(self, nbytes: float, write: bool, tag: str = "nvme") -> "LocalTransfer":
        """A read or write of ``nbytes`` on this rank's share of the node's NVMe drives (one queue), as
        ``host_copy``."""
        return self._local_transfer("disk", self.cluster.disk.seconds(nbytes * self.byte_scale, write),
                                    nbytes * self.byte_scale, tag, "write" if write else "read")

    def _local_transfer(self, queue: str, seconds: float, nbytes: float, tag: str, op: str | None = None,
                        after: float = 0.0):
        issue = self.now()
        if getattr(self._local, "paused", False):  # paused: the copy takes no time and is not recorded
            return LocalTransfer(self, {"op": op or queue, "tag": tag, "link": queue, "bytes": nbytes, "issue": issue,
                                        "start": issue, "local_end": issue, "done": None, "exposed": None})
        with self._lock:
            start = max(issue, self._link_free[queue], after)
            end = self._link_free[queue] = start + seconds
            rec = {"op": op or queue, "tag": tag, "link": queue, "bytes": nbytes, "issue": issue, "start": start,
                   "local_end": end, "done": None, "exposed": None}
            self.comms.append(rec)
        return LocalTransfer(self, rec)

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

    def untimed(self):
        """The ops inside take no time (the real copies behind ``host_copy`` and ``disk_io``: their time is the
        link's)."""
        return self.internal()

    # ---- compute --------------------------------------------------------------------------------------------
    def compute(self, name: str, flops: float, nbytes: float, cpu_s: float = 0.0) -> float:
        """One kernel: the host pays its launch, then the stream runs it for ``max(flops / peak, bytes / HBM)``
        (each term scaled inside ``scaled``) once both the launch and the kernels before it are done. Returns
        the roofline seconds."""
        on_host = getattr(self._local, "on_host", False)
        proc = self.cluster.cpu if on_host else self.cluster.gpu
        roof = max(self.flop_scale * flops / proc.bf16_flops, self.byte_scale * nbytes / proc.hbm_bytes_per_s)
        launch = 0.0 if self._replay_depth or on_host else proc.launch_s
        clock = self._clock()
        if on_host:  # the host computes it, after whatever it waited for
            clock.host += roof
            name = "host: " + name
        else:
            clock.host += launch
            clock.stream = max(clock.host, clock.stream) + roof
        with self._lock:
            row = self.ops[name]
            row["calls"] += 1
            row["flops"] += flops
            row["bytes"] += nbytes
            row["model_s"] += roof
            row["launch_s"] += launch
            row["cpu_s"] += cpu_s
        return roof

    # ---- communication --------------------------------------------------------------------------------------
    def ranks_of(self, group) -> list[int]:
        key = id(group)
        if key not in self._group_ranks:
            self._group_ranks[key] = (list(range(self.world_size)) if group is None or group is dist.group.WORLD
                                      else dist.get_process_group_ranks(group))
        return self._group_ranks[key]

    def _queue(self, link_name: str) -> str:
        """The queue a transfer of this thread waits in: the link's, or, from a side thread, one of its own on
        that link (NCCL: a communicator on the thread's own stream). Ordering a side thread's transfers behind
        the main thread's would follow the threads' real interleaving, not the virtual clock; contention between
        the two queues is not modelled, as between ranks."""
        if threading.get_ident() == self._main:
            return link_name
        return f"{link_name} [{threading.current_thread().name}]"

    def _transfer(self, op: str, peers: list[int], sent_bytes: float, tag: str) -> tuple[float, dict]:
        """Queue one transfer on this rank's link to ``peers``: returns (its local end, its record)."""
        link = self.cluster.link_between([self.rank] + peers, self.world_size)
        issue = self.now()
        queue = self._queue(link.name)
        with self._lock:
            start = max(issue, self._link_free[queue])
            end = start + link.seconds(sent_bytes)
            self._link_free[queue] = end
            rec = {"op": op, "tag": tag, "link": link.name, "bytes": sent_bytes, "issue": issue, "start": start,
                   "local_end": end, "done": None, "exposed": None}
            self.comms.append(rec)
        return end, rec

    def _finish(self, rec: dict, msg: "_ClockMessage") -> None:
        """The transfer of ``rec`` is waited for: this thread's stream waits for its virtual completion (a
        barrier also blocks the host)."""
        with self._side():
            start, done = msg.interval()
        rec["done"] = done
        before = self.now()
        waited = self.wait_until(done)
        # the part of the wait during which the bytes were on the wire (the rest: waiting for the peer to send)
        wire = max(0.0, done - max(start, before)) if waited > 0 else 0.0
        rec["exposed"] = (rec["exposed"] or 0.0) + waited
        rec["exposed_wire"] = rec.get("exposed_wire", 0.0) + wire
        if rec["op"] == "barrier":
            self.synchronize()

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

    def _record(self, op: str, tag: str) -> dict:
        """The record of a transfer this rank only receives (its time is the sender's)."""
        rec = {"op": op, "tag": tag, "link": None, "bytes": 0.0, "issue": self.now(), "start": None,
               "local_end": None, "done": None, "exposed": None}
        with self._lock:
            self.comms.append(rec)
        return rec

    def _returned(self, work, rec: dict, msg: "_ClockMessage", is_async: bool):
        if not is_async:
            self._finish(rec, msg)
            return work
        return EmulatedWork(self, work, rec, msg)

    def on_collective(self, op: str, group, sent: int, args, kwargs, work, is_async: bool, tag: str):
        """A collective was issued (``work``: its handle if async): its end on this rank's link, then a side
        all_reduce(MAX) of the ends on the same group gives its completion. Returns what the caller gets."""
        tensors = _tensors((args, kwargs))
        end, rec = self._transfer(op, [r for r in self.ranks_of(group) if r != self.rank],
                                  self._virtual_bytes(sent, tensors[0] if tensors else None), tag)
        with self._side():
            stamp = torch.tensor([end, rec["start"]], dtype=torch.float64)
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
        end, rec = self._transfer(op, [dst], self._virtual_bytes(sent, _tensors((args, kwargs))[0]), tag)
        with self._side():
            stamp = torch.tensor([end, rec["start"]], dtype=torch.float64)
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
        rec = self._record(op, tag)
        with self._side():
            stamp = torch.zeros(2, dtype=torch.float64)
            msg = _ClockMessage(dist.irecv(stamp, src, group=group, tag=msg_tag), stamp)
        return self._returned(work, rec, msg, is_async)

    def on_batch(self, p2p_ops: list, works: list, tag: str) -> list:
        """``batch_isend_irecv``: each op's clock message goes out after all payloads, in the same order."""
        side_ops, pending = [], []
        for p in p2p_ops:
            sending = getattr(p.op, "__name__", "") == "isend"
            with self._side():
                if sending:
                    end, rec = self._transfer("isend", [p.peer], self._virtual_bytes(
                        p.tensor.numel() * p.tensor.element_size(), p.tensor), tag)
                    stamp = torch.tensor([end, rec["start"]], dtype=torch.float64)
                else:
                    rec = self._record("irecv", tag)
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

    # ---- what the run cost ------------------------------------------------------------------------------------
    def totals(self) -> dict[str, float]:
        """Modelled seconds so far: the kernels' roofline time on the stream, the host's launches, the transfers'
        link time, the time the clocks waited for communication (exposed), and the CPU time the ops took here."""
        return {"kernels_s": sum(r["model_s"] for r in self.ops.values()),
                "launch_s": sum(r["launch_s"] for r in self.ops.values()),
                "comm_s": sum(c["local_end"] - c["start"] for c in self.comms if c["local_end"] is not None),
                "exposed_s": sum(c["exposed"] or 0.0 for c in self.comms),
                "cpu_s": sum(r["cpu_s"] for r in self.ops.values())}

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


class LocalTransfer:
    """A copy on this rank's host link or disk (``Emulator.host_copy`` / ``disk_io``): ``wait()`` makes the stream
    wait for it, ``wait_host()`` the host (a CPU-side step that reads the copied data)."""

    def __init__(self, emulator: Emulator, rec: dict):
        self._emu, self._rec = emulator, rec

    @property
    def end(self) -> float:
        return self._rec["local_end"]

    def wait(self) -> float:
        """The stream waits for the copy; returns the time the clock moved (0: it was done in time)."""
        rec, emu = self._rec, self._emu
        rec["done"] = rec["local_end"]
        before = emu.now()
        waited = emu.wait_until(rec["local_end"])
        rec["exposed"] = (rec["exposed"] or 0.0) + waited
        rec["exposed_wire"] = rec.get("exposed_wire", 0.0) + (max(0.0, rec["local_end"] - max(rec["start"], before))
                                                              if waited > 0 else 0.0)
        return waited

    def wait_host(self) -> float:
        """The host waits for the copy (its data is read by host code next)."""
        clock = self._emu._clock()
        before = clock.host
        clock.host = max(clock.host, self._rec["local_end"])
        self._rec["done"] = self._rec["local_end"]
        return clock.host - before


class _Clock:
    """One host thread's issue time and its stream's time (the stream runs what the host issued, in order)."""

    __slots__ = ("host", "stream")

    def __init__(self, host: float, stream: float):
        self.host, self.stream = host, stream

    @property
    def now(self) -> float:
        return max(self.host, self.stream)


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
