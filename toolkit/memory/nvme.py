"""NVMe (disk) offload of optimizer states and of ZeRO-3 parameter shards (DeepSpeed ZeRO-Infinity's
``offload_optimizer``/``offload_param`` with ``device: nvme``), through a few pre-allocated host buffers.

One file per rank, reserved in full when it is created (``posix_fallocate``) and unlinked at once, so a
full disk is an error at start-up, never half-way through a step, and no crash leaves a file behind::

    file (rank r)   [ p_0 | m_0 | v_0 ][ p_1 | m_1 | v_1 ] ...       one region per shard and tensor,
                                                                      each a whole number of 4 KiB blocks
    host            buffer_count buffers x buffer_size elements x (m, v, p, grad)   <- all the host memory used
    device          the parameter and gradient shards (parameters too, unless offload_params)

    optimizer step: the shards cut into pieces of buffer_size elements; buffer_count buffers in flight
        I/O thread   read 0   read 1   read 2  write 0   read 3  write 1 ...     (read-ahead, write-behind)
        training          wait 0 ─ AdamW 0 ─ wait 1 ─ AdamW 1 ─ ...
    forward/backward (offload_params, ZeRO-3): a unit's shard is read just before its all-gather, and
        the next unit's (in the order the previous step asked for them) is read ahead into a free buffer.

``buffer_size`` and ``buffer_count`` are the article's knobs. Resident host bytes are
``buffer_count x buffer_size x 4 x (3 or 4)`` (plus ``buffer_count`` unit shards for offloaded
parameters) whatever the model's size: that is the point. Small buffers mean many small I/Os (a
syscall and a device round trip each) and little to overlap; ``buffer_count = 1`` means no read-ahead at
all (read, update, write, wait, in turn); large buffers or many of them buy back host memory the offload
was meant to save. A buffer is a whole number of 4 KiB blocks, so every read and write covers whole
blocks (what direct I/O requires, and no read-modify-write of a partial block).

The update is ``toolkit.memory.optim_offload.adamw_`` (torch's AdamW arithmetic, elementwise) on the host,
so states and parameters after a step are bitwise those of the in-memory run on a CPU. I/O is plain
``pread``/``pwrite`` on a worker thread (they release the GIL): on a machine with free RAM the page cache
absorbs it, so the times measured here are page-cache times unless the file system bypasses it.

Every read and write is also a ``Transfer`` (``toolkit.runtime.portable.HostIO``): on an emulated cluster one on
the cluster's NVMe drive (one queue, the file's fp32 bytes), issued when the training thread submits it, and
every copy one on the host link (``CopyEngine``); each ``result()`` the training thread waits on becomes the
host waiting for that transfer, so ``stats`` also has the step's virtual times (``v*`` keys).
"""
from __future__ import annotations

import ctypes
import os
import shutil
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from toolkit.runtime.memory import MemoryTracker

from .optim_offload import HYPER, CopyEngine, adamw_, host_update

BLOCK_BYTES = 4096
ELEM = 4  # fp32
BLOCK_ELEMS = BLOCK_BYTES // ELEM


class OffloadIOError(OSError):
    """Reserving or using the offload file failed (full disk, size limit, I/O error)."""


def round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def region_elems(numel: int) -> int:
    """Elements a shard of ``numel`` occupies in the file: whole 4 KiB blocks."""
    return round_up(numel, BLOCK_ELEMS)


def file_bytes(shard_numels: list[int], offload_params: bool) -> int:
    """Bytes of one rank's file: m, v (and p) regions of every shard."""
    return sum(region_elems(n) for n in shard_numels) * ELEM * (3 if offload_params else 2)


def staging_bytes(shard_numels: list[int], buffer_count: int, buffer_size: int, offload_params: bool) -> int:
    """Host bytes of the staging buffers (the whole host footprint of the disk offload): ``DiskAdamW.host_bytes``."""
    out = buffer_count * buffer_size * ELEM * 4  # rows m, v, p, grad (p is staged for the update in both cases)
    if offload_params:
        out += buffer_count * max(shard_numels) * ELEM  # unit shards read for the all-gathers
    return out


def check_buffers(buffer_count: int, buffer_size: int, name_count: str = "buffer_count",
                  name_size: str = "buffer_size") -> None:
    """ValueError unless both are positive ints and ``buffer_size`` is a whole number of 4 KiB blocks."""
    for name, v in ((name_count, buffer_count), (name_size, buffer_size)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if buffer_size % BLOCK_ELEMS:
        lo = max(buffer_size // BLOCK_ELEMS, 1) * BLOCK_ELEMS
        raise ValueError(f"{name_size}={buffer_size} elements does not divide into the {BLOCK_BYTES}-byte blocks the "
                         f"state is laid out in ({BLOCK_ELEMS} fp32 elements each): use a multiple of {BLOCK_ELEMS}, "
                         f"e.g. {lo} or {lo + BLOCK_ELEMS}")


def check_directory(path: str | os.PathLike, need_bytes: int, name: str = "nvme_path") -> Path:
    """The directory offload files go to, checked before any process starts.

    ValueError naming ``name`` when it does not exist, is not a directory, cannot take a new file (tried
    for real: permission bits do not tell root or a read-only mount), or has less free space than
    ``need_bytes``.
    """
    p = Path(path)
    if not p.exists():
        raise ValueError(f"{name}={str(path)!r} does not exist; give an existing directory on the disk to offload to")
    if not p.is_dir():
        raise ValueError(f"{name}={str(path)!r} is not a directory")
    try:
        with tempfile.TemporaryFile(dir=p):
            pass
    except OSError as e:
        raise ValueError(f"{name}={str(path)!r} is not writable ({e.strerror})") from None
    free = shutil.disk_usage(p).free
    if free < need_bytes:
        raise ValueError(f"{name}={str(path)!r} has {free:,} bytes free; the offload files need {need_bytes:,} "
                         "(pre-allocated in full at start)")
    return p


def _buffer(t: torch.Tensor):
    """A writable buffer-protocol view of a contiguous CPU tensor's bytes (for os.preadv / os.pwrite)."""
    return (ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr())


class FileStore:
    """One pre-allocated file in ``directory``, unlinked as soon as it exists; byte-addressed reads and writes,
    synchronous or on one I/O thread. Counts bytes and the time the I/O calls take.

    Raises ``OffloadIOError`` (with the path, the size and the system's reason) when the space cannot be
    reserved; the file is gone in every case. Several ``DiskAdamW`` may share one store (``store=``).
    """

    def __init__(self, directory: str | os.PathLike, nbytes: int, label: str = "offload"):
        self.directory, self.nbytes, self.label = str(directory), nbytes, label
        self.fd = self._open()
        self.bytes_read = self.bytes_written = 0
        self.reads = self.writes = 0
        self.io_seconds = 0.0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{label}-io")

    def _open(self) -> int:
        try:
            fd = os.open(self.directory, os.O_TMPFILE | os.O_RDWR, 0o600)  # never has a name
        except (OSError, AttributeError):
            fd, name = tempfile.mkstemp(dir=self.directory, prefix=f"toolkit-{self.label}-")
            os.unlink(name)
        try:
            if self.nbytes:
                os.posix_fallocate(fd, 0, self.nbytes)
        except OSError as e:
            os.close(fd)
            raise OffloadIOError(e.errno, f"{self.label}: reserving {self.nbytes:,} bytes in {self.directory} failed: "
                                 f"{e.strerror}; the disk filled (or hit a size limit) after the start-up check. "
                                 "No file was left behind.") from None
        return fd

    # ---- I/O ---------------------------------------------------------------------------------------
    def read(self, t: torch.Tensor, offset: int) -> None:
        """Fill contiguous CPU tensor ``t`` from the file at byte ``offset``."""
        self._io(os.preadv, t, offset, "read")

    def write(self, t: torch.Tensor, offset: int) -> None:
        """Write contiguous CPU tensor ``t`` to the file at byte ``offset``."""
        self._io(os.pwritev, t, offset, "write")

    def _io(self, call, t: torch.Tensor, offset: int, kind: str) -> None:
        n = t.numel() * t.element_size()
        if offset < 0 or offset + n > self.nbytes:
            raise OffloadIOError(0, f"{self.label}: {kind} of {n} bytes at {offset} is outside the {self.nbytes}-byte file")
        start, done, buf = time.perf_counter(), 0, memoryview(_buffer(t)).cast("B")
        while done < n:
            try:
                got = call(self.fd, [buf[done:]], offset + done)
            except OSError as e:
                raise OffloadIOError(e.errno, f"{self.label}: {kind} of {n:,} bytes in {self.directory} failed: "
                                     f"{e.strerror}") from None
            if got == 0:
                raise OffloadIOError(0, f"{self.label}: {kind} at {offset + done} returned 0 bytes")
            done += got
        self.io_seconds += time.perf_counter() - start
        if kind == "read":
            self.bytes_read, self.reads = self.bytes_read + n, self.reads + 1
        else:
            self.bytes_written, self.writes = self.bytes_written + n, self.writes + 1

    def submit(self, fn, *args) -> Future:
        """Run ``fn(*args)`` on the I/O thread (in submission order)."""
        return self._pool.submit(fn, *args)

    def counters(self) -> dict:
        return {"bytes_read": self.bytes_read, "bytes_written": self.bytes_written, "reads": self.reads,
                "writes": self.writes, "io_seconds": self.io_seconds}

    def allocated_bytes(self) -> int:
        """Bytes the file system has reserved for the file (its blocks)."""
        return os.fstat(self.fd).st_blocks * 512

    def close(self) -> None:
        if self.fd >= 0:
            self._pool.shutdown(wait=True)
            os.close(self.fd)
            self.fd = -1

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class DiskAdamW(torch.optim.Optimizer):
    """AdamW with m and v (and, for ``DiskParams``, the parameter shards) in a ``FileStore``.

    The step streams every shard in pieces of ``buffer_size`` elements through ``buffer_count`` host buffers
    (see the module docstring). ``stats`` holds, per step: bytes read and written, the seconds the training
    thread waited for reads and for the final writes (exposed I/O), the seconds of AdamW arithmetic, and
    the seconds the I/O thread was busy.
    """

    def __init__(self, params, directory: str | os.PathLike, buffer_count: int = 2, buffer_size: int = 1 << 16,
                 offload_params: bool = False, lr: float = HYPER["lr"], betas=HYPER["betas"], eps: float = HYPER["eps"],
                 weight_decay: float = HYPER["weight_decay"], store: FileStore | None = None):
        check_buffers(buffer_count, buffer_size)
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.params = [p for g in self.param_groups for p in g["params"]]
        self.buffer_count, self.buffer_size, self.offload_params = buffer_count, buffer_size, offload_params
        self.copies = CopyEngine(self.params[0].device)
        numels = [p.numel() for p in self.params]
        self.kinds = ("p", "m", "v") if offload_params else ("m", "v")
        self.offsets: list[dict[str, int]] = []
        off = 0
        for n in numels:
            regions = {}
            for k in self.kinds:
                regions[k] = off
                off += region_elems(n) * ELEM
            self.offsets.append(regions)
        if store is not None and store.nbytes < off:
            raise ValueError(f"store has {store.nbytes:,} bytes; this optimizer's state needs {off:,}")
        self.owns_store = store is None  # a shared store (e.g. a benchmark of buffer settings) is closed by its owner
        self.store = FileStore(directory, off, "nvme-optimizer") if store is None else store
        # rows: m, v, p, grad; pinned on CUDA so the grad/param rows can be copied asynchronously
        self.buffers = [self.copies.host_empty(4 * buffer_size).view(4, buffer_size) for _ in range(buffer_count)]
        self.pieces = [(i, lo, min(lo + buffer_size, n)) for i, n in enumerate(numels) for lo in range(0, n, buffer_size)]
        self.steps = 0
        self.stats: list[dict] = []
        self.params_on_disk: "DiskParams | None" = None
        tracker = MemoryTracker.active()
        if tracker is not None:
            self.register(tracker)

    def register(self, tracker: MemoryTracker) -> None:
        """Count the staging buffers (and the parameter read-ahead slots) as ``host`` in ``tracker``."""
        for b in self.buffers + (self.params_on_disk.slots if self.params_on_disk is not None else []):
            tracker.register(b, "host")

    def host_bytes(self) -> int:
        """Resident host bytes: the staging buffers (and the parameter read-ahead slots)."""
        out = sum(b.untyped_storage().nbytes() for b in self.buffers)
        if self.params_on_disk is not None:
            out += self.params_on_disk.host_bytes()
        return out

    def disk_bytes(self) -> int:
        return self.store.nbytes

    def _offset(self, i: int, kind: str, lo: int) -> int:
        return self.offsets[i][kind] + lo * ELEM

    def _piece_io(self, j: int, b: int, io) -> None:
        """Read (``io = store.read``) or write (``store.write``) piece ``j``'s m, v (and p) rows of buffer ``b``."""
        i, lo, hi = self.pieces[j]
        buf = self.buffers[b]
        for row, kind in ((0, "m"), (1, "v"), (2, "p")):
            if kind in self.kinds:
                io(buf[row, :hi - lo], self._offset(i, kind, lo))

    def _piece_bytes(self, j: int) -> int:
        """Bytes of piece ``j``'s rows in the file (m, v and, with ``offload_params``, p): what one I/O moves."""
        i, lo, hi = self.pieces[j]
        return (hi - lo) * ELEM * len(self.kinds)

    def _disk(self, j: int, write: bool):
        """Piece ``j``'s read or write on the disk, issued now (the store's thread does the I/O)."""
        io = self.copies.io
        return io.disk_write(self._piece_bytes(j)) if write else io.disk_read(self._piece_bytes(j))

    def read_state(self, i: int) -> dict[str, torch.Tensor]:
        """Shard ``i``'s m and v (and p) read back from the file (for checks)."""
        n = self.params[i].numel()
        out = {}
        for kind in self.kinds:
            t = torch.empty(n)
            self.store.read(t, self._offset(i, kind, 0))
            out[{"m": "exp_avg", "v": "exp_avg_sq", "p": "param"}[kind]] = t
        return out

    def write_param(self, i: int, values: torch.Tensor) -> None:
        """Put shard ``i``'s parameter values in the file (``DiskParams`` does, once, at start)."""
        self.store.write(values.detach().reshape(-1).cpu().contiguous(), self._offset(i, "p", 0))

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("DiskAdamW.step does not take a closure")
        hyper = {k: self.param_groups[0][k] for k in ("lr", "betas", "eps", "weight_decay")}
        c, store = self.copies, self.store
        before, moved = store.counters(), dict(c.moved)
        clock = c.io.virtual_step(("read_wait_s", "write_wait_s", "copy_wait_s"))
        wait_read = wait_write = compute = 0.0
        free = list(range(self.buffer_count))  # buffers not holding a piece
        pending_write: dict[int, tuple[Future, object]] = {}  # buffer -> its write-behind (and its disk transfer)
        reading: dict[int, tuple[int, Future, object]] = {}  # piece -> (buffer, read, its disk transfer)
        pieces = [j for j, (i, _, _) in enumerate(self.pieces) if self.params[i].grad is not None]
        issued = 0

        def issue() -> None:
            nonlocal issued, wait_write
            b = free.pop(0)
            if b in pending_write:  # the buffer's last piece must be on disk before it is refilled
                t0 = time.perf_counter()
                fut, written = pending_write.pop(b)
                fut.result()
                clock.wait(written, "write_wait_s", host=True)
                wait_write += time.perf_counter() - t0
            j = pieces[issued]
            reading[j] = (b, store.submit(self._piece_io, j, b, store.read), self._disk(j, write=False))
            issued += 1

        for k, j in enumerate(pieces):
            while issued < len(pieces) and free and issued < k + self.buffer_count:
                issue()
            b, fut, read = reading.pop(j)
            t0 = time.perf_counter()
            fut.result()
            clock.wait(read, "read_wait_s", host=True)  # the host update reads the state
            wait_read += time.perf_counter() - t0
            i, lo, hi = self.pieces[j]
            p, buf, n = self.params[i], self.buffers[b], hi - lo
            t0 = time.perf_counter()
            m, v, pp, g = buf[0, :n], buf[1, :n], buf[2, :n], buf[3, :n]
            down = c.copy(g, p.grad.reshape(-1)[lo:hi], "d2h")
            if not self.offload_params:
                down = c.copy(pp, p.detach().view(-1)[lo:hi], "d2h")
            if c.cuda:
                torch.cuda.current_stream(c.device).synchronize()  # the rows must have landed for the host update
            clock.wait(down, "copy_wait_s", host=True)
            with host_update():
                adamw_(pp, g, m, v, self.steps, **hyper)
            if not self.offload_params:
                up = c.copy(p.detach().view(-1)[lo:hi], pp, "h2d")
                if c.cuda:
                    torch.cuda.current_stream(c.device).synchronize()  # before the buffer is written and refilled
                clock.wait(up, "copy_wait_s", host=True)
            compute += time.perf_counter() - t0
            pending_write[b] = (store.submit(self._piece_io, j, b, store.write), self._disk(j, write=True))
            free.append(b)
        t0 = time.perf_counter()
        for fut, written in pending_write.values():
            fut.result()
            clock.wait(written, "write_wait_s", host=True)
        wait_write += time.perf_counter() - t0
        c.join()
        self.steps += 1
        after = store.counters()
        self.stats.append({"bytes_read": after["bytes_read"] - before["bytes_read"],
                           "bytes_written": after["bytes_written"] - before["bytes_written"],
                           "io_seconds": after["io_seconds"] - before["io_seconds"], "wait_read_s": wait_read,
                           "wait_write_s": wait_write, "compute_s": compute, "pieces": len(pieces),
                           "io_calls": after["reads"] + after["writes"] - before["reads"] - before["writes"],
                           **{k: c.moved[k] - moved[k] for k in moved},
                           **{f"v{k}": t for k, t in (clock.done() or {}).items()}})
        if self.params_on_disk is not None:
            self.params_on_disk.new_step()

    def close(self) -> None:
        if self.owns_store:
            self.store.close()


class DiskParams:
    """ZeRO-3 parameter shards kept in a ``DiskAdamW``'s file instead of memory.

    Each unit's shard is written to the file and its storage released (``resize_(0)``: the parameter keeps
    its shape, so autograd and the optimizer still see it). The unit's ``shard_source`` then reads it back
    just before each all-gather (forward, and backward's re-gather), into one of ``buffer_count`` slots; the
    units the previous step asked for next are read ahead into the free slots.
    """

    def __init__(self, zdp, optimizer: DiskAdamW):
        if zdp.stage != 3:
            raise ValueError(f"offload_params needs ZeRO stage 3 (sharded parameters), got stage {zdp.stage}")
        if not optimizer.offload_params:
            raise ValueError("the DiskAdamW was built without offload_params=True: its file has no parameter regions")
        self.opt, self.units = optimizer, zdp.units
        self.copies = optimizer.copies
        index = {id(p): i for i, p in enumerate(optimizer.params)}
        self.index = [index[id(u.shard)] for u in self.units]
        width = max(u.shard_numel for u in self.units)
        self.slots = [self.copies.host_empty(width) for _ in range(optimizer.buffer_count)]
        self.slot_of: dict[int, tuple[int, Future, object]] = {}  # unit -> (slot, read, its emulated transfer)
        self.order: list[int] = []  # the order units were asked for in the previous step
        self.asked: list[int] = []  # ... and in this one
        self.served_slot: int | None = None
        self.bytes_read = 0
        self.last_step_bytes = 0  # read for the all-gathers of the last forward and backward
        self._mark = 0
        for k, u in enumerate(self.units):
            optimizer.write_param(self.index[k], u.shard)
            u.shard.data.untyped_storage().resize_(0)
            u.shard_source = lambda k=k: self.fetch(k)
        optimizer.params_on_disk = self
        tracker = MemoryTracker.active()
        if tracker is not None:
            for s in self.slots:
                tracker.register(s, "host")

    def host_bytes(self) -> int:
        return sum(s.untyped_storage().nbytes() for s in self.slots)

    def new_step(self) -> None:
        """The optimizer wrote new values: forget read-aheads, keep this step's order for the next."""
        for _, fut, _ in self.slot_of.values():
            fut.result()
        self.slot_of.clear()
        self.last_step_bytes, self._mark = self.bytes_read - self._mark, self.bytes_read
        self.order, self.asked, self.served_slot = self.asked or self.order, [], None

    def _read(self, k: int, slot: int) -> None:
        u = self.units[k]
        self.opt.store.read(self.slots[slot][:u.shard_numel], self.opt._offset(self.index[k], "p", 0))
        self.bytes_read += u.shard_numel * ELEM

    def _start(self, k: int) -> None:
        busy = {s for s, _, _ in self.slot_of.values()} | ({self.served_slot} if self.served_slot is not None else set())
        free = [s for s in range(len(self.slots)) if s not in busy]
        if free and k not in self.slot_of:
            read = self.copies.io.disk_read(self.units[k].shard_numel * ELEM)
            self.slot_of[k] = (free[0], self.opt.store.submit(self._read, k, free[0]), read)

    def fetch(self, k: int) -> torch.Tensor:
        """Unit ``k``'s shard values, for its all-gather (read now, or taken from a read-ahead)."""
        self.served_slot = None  # the previous all-gather has finished with its slot (collectives are synchronous)
        if k not in self.slot_of:
            self._start(k)
        if k not in self.slot_of:  # every slot holds a read-ahead this step did not ask for: drop one
            stale = next(iter(self.slot_of))
            self.slot_of.pop(stale)[1].result()
            self._start(k)
        slot, fut, read = self.slot_of.pop(k)
        fut.result()
        pos = len(self.asked)
        self.asked.append(k)
        self.served_slot = slot
        ahead = self.order[pos + 1:pos + len(self.slots)] if self.order[pos:pos + 1] == [k] else []
        for nxt in ahead:
            self._start(nxt)
        values = self.slots[slot][:self.units[k].shard_numel]
        if self.copies.cuda:
            dev = torch.empty_like(values, device=self.copies.device)
            self.copies.copy(dev, values, "h2d")  # synchronous enough: the all-gather runs on the same stream after it
            torch.cuda.current_stream(self.copies.device).synchronize()  # the slot is refilled by the I/O thread
            return dev
        read.wait_host()  # the shard goes up once read; the all-gather after it waits for both
        io = self.copies.io
        with io.to_device() as up:  # here the all-gather reads the slot itself
            up.add(io.nbytes(values.numel(), values.dtype))
        up.wait()
        return values
