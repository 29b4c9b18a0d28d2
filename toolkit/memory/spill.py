"""Activation spill to disk for checkpointed segments: what autograd keeps for backward goes to a
file-backed mapping, and comes back when backward unpacks it.

The source article's ``MappedCheckpoint`` (reproduced faithfully as ``ArticleMappedCheckpoint``) does not
do that::

    with open(file_path, 'wb') as f: f.write(b'\\x00' * size)   # a file of zeros is created ...
    self.mmap = mmap.mmap(-1, size)                              # ... but fileno -1 maps ANONYMOUS memory
    np.frombuffer(self.mmap, dtype=float16, count=n)[:] = ...    # every save lands at offset 0, as fp16

so nothing it saves reaches the file (the file stays zeros, the bytes stay in RAM), each save overwrites
the previous one, fp32 values are rounded to fp16, and its ``custom_checkpoint`` runs ``func`` with its
graph intact, so no activation is dropped either. ``inspect_article_snippet`` measures each of these.

``DiskSpill`` is the working version::

    forward (inside spill.hooks())                           file (pre-allocated, unlinked at creation)
    ──────────────────────────────                           ──────────────────────────────────────────
    autograd saves t ─► pack: parameter? keep it             [ region 0 | region 1 | region 2 | ... ]
                        storage seen? reuse its region          one region per saved storage, 64-byte aligned
                        else: copy its bytes to a new region    (views of one storage share it)
                        return a ticket (region, view)
    backward ─► unpack(ticket): read the region back (to the device), rebuild the view

With ``torch.utils.checkpoint`` (non-reentrant) around each block, what autograd saves outside the
recomputation is the checkpointed segments' inputs (plus what non-checkpointed modules save, e.g. the
loss), so the file receives exactly the bytes plain checkpointing would keep in memory
(``toolkit.runtime.memory.saved_activation_bytes`` counts them the same way), and the
recomputation in backward reads them back. The mapping is ``MAP_SHARED`` on the file: its pages are the
file's page cache, written back to the disk by the kernel, and can be dropped from RAM under pressure;
on a GPU the bytes leave the device at pack time, which is the saving.
"""
from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import weakref

import torch

from .nvme import FileStore, OffloadIOError
from .optim_offload import on_host

ALIGN = 64


def mapping_kind(mm: mmap.mmap) -> str:
    """What backs ``mm``, read from ``/proc/self/maps``: ``"anonymous"`` or the mapped file's path."""
    probe = ctypes.c_char.from_buffer(mm)
    addr = ctypes.addressof(probe)
    del probe  # an exported pointer would keep mm from being closed
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= addr < hi:
                path = fields[5].strip() if len(fields) > 5 else ""
                # mmap(-1, n) is MAP_SHARED|MAP_ANONYMOUS: the kernel lists it as "/dev/zero (deleted)"
                anonymous = not path or path.startswith("[") or path.startswith("/dev/zero")
                return "anonymous" if anonymous else path
    return "unknown"


class ArticleMappedCheckpoint:
    """The source article's ``MappedCheckpoint``, line for line (CPU only: its ``.cuda()`` left out)."""

    def __init__(self, file_path: str, size: int):
        import numpy as np  # noqa: F401 - the snippet's dependency
        self.file_path = file_path
        self.size = size
        # create the memory-mapped file
        with open(file_path, "wb") as f:
            f.write(b"\x00" * size)
        self.mmap = mmap.mmap(-1, size)

    def save(self, tensor: torch.Tensor) -> None:
        import numpy as np
        np_array = np.frombuffer(self.mmap, dtype=np.float16, count=tensor.numel())
        np_array[:] = tensor.cpu().numpy().flatten()

    def load(self, shape, dtype=torch.float16) -> torch.Tensor:
        import numpy as np
        np_array = np.frombuffer(self.mmap, dtype=np.float16, count=int(np.prod(shape)))
        return torch.from_numpy(np_array.reshape(shape)).to(dtype)


def _nonzero_bytes(path: str) -> int:
    with open(path, "rb") as f:
        data = f.read()
    return len(data) - data.count(0)


def inspect_article_snippet(directory: str, tensors: list[torch.Tensor], size: int | None = None) -> dict:
    """Run the article's ``MappedCheckpoint`` on ``tensors`` (saved in turn, then loaded in turn) and measure
    what happened: where the mapping lives, what reached the file, what the loads return."""
    size = size or max(t.numel() for t in tensors) * 2
    path = os.path.join(directory, f"article-ckpt-{os.getpid()}.bin")
    try:
        ckpt = ArticleMappedCheckpoint(path, size)
        kind = mapping_kind(ckpt.mmap)
        for t in tensors:
            ckpt.save(t)
        loads = [ckpt.load(tuple(t.shape), torch.float32) for t in tensors]
        file_size, nonzero = os.path.getsize(path), _nonzero_bytes(path)
        last = tensors[-1].to(torch.float16).to(torch.float32)
        out = {"mapping": kind, "file_size": file_size, "file_nonzero_bytes_after_saves": nonzero,
               "saved_bytes_requested": sum(t.numel() * t.element_size() for t in tensors),
               "bytes_reaching_file": nonzero,
               "zero_fill_bytes_written_at_init": size,
               "loads_equal_to_their_tensor": [bool(torch.equal(ld, t)) for ld, t in zip(loads, tensors)],
               "loads_equal_to_last_saved": [bool(torch.equal(ld.flatten()[:last.numel()], last.flatten()[:ld.numel()]))
                                            for ld in loads],
               "fp16_max_abs_error_of_last": float((loads[-1] - tensors[-1]).abs().max())}
        ckpt.mmap.close()
        return out
    finally:
        if os.path.exists(path):
            os.unlink(path)


def article_custom_checkpoint_saved_bytes(func, x: torch.Tensor, params: list[torch.Tensor]) -> dict:
    """Bytes autograd keeps for backward with the article's ``custom_checkpoint`` (it calls ``func`` as is)
    vs ``torch.utils.checkpoint`` around the same ``func``."""
    from torch.utils.checkpoint import checkpoint

    from toolkit.runtime.memory import saved_activation_bytes
    article, _ = saved_activation_bytes(lambda: func(x), params)
    real, _ = saved_activation_bytes(lambda: checkpoint(func, x, use_reentrant=False), params)
    return {"article_custom_checkpoint": article, "torch_checkpoint": real}


def _has_numpy() -> bool:
    try:
        import numpy  # noqa: F401
        return True
    except ImportError:
        return False


class DiskSpill:
    """Saved tensors to a pre-allocated file-backed mapping, one region per saved storage.

    ``capacity`` bytes are reserved at construction (``FileStore``: a full disk fails here, not mid-step);
    count them first with ``saved_activation_bytes`` plus ``ALIGN`` per region. Use::

        spill = DiskSpill(directory, capacity)
        with spill.hooks(params):
            loss = model(x, y)          # saved tensors go to the file
        loss.backward()                 # ... and come back
        spill.reset()                   # regions free for the next step
    """

    def __init__(self, directory: str, capacity: int, device: torch.device | str = "cpu", keep_copies: bool = False):
        self.keep_copies = keep_copies  # keep each region's bytes in memory too, so ``verify`` can compare the file
        self.store = FileStore(directory, capacity, "activation-spill")
        self.capacity = capacity
        self.device = torch.device(device)
        self.map = mmap.mmap(self.store.fd, capacity, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) \
            if capacity else None
        self.base = torch.frombuffer(self.map, dtype=torch.uint8) if capacity else torch.empty(0, dtype=torch.uint8)
        self.reset()
        self.bytes_read = 0
        self._loaded: weakref.WeakValueDictionary[int, torch.UntypedStorage] = weakref.WeakValueDictionary()

    def reset(self) -> None:
        """Forget every region (call after backward): the next forward writes from offset 0 again."""
        self.used = 0
        self.regions = 0
        self.bytes_written = 0
        self._live: dict[int, int] = {}  # storage data_ptr -> region offset, while that storage is alive
        self._copies: list[tuple[int, torch.Tensor]] = []

    def mapping(self) -> str:
        return mapping_kind(self.map)

    def _region(self, t: torch.Tensor) -> int:
        st = t.untyped_storage()
        key = st.data_ptr()
        if key in self._live:
            return self._live[key]
        n = st.nbytes()
        off = -(-self.used // ALIGN) * ALIGN
        if off + n > self.capacity:
            raise OffloadIOError(0, f"activation spill: {n:,} more bytes do not fit in the {self.capacity:,} "
                                 f"reserved in {self.store.directory} (used {self.used:,}); reserve more (count the "
                                 "saved bytes first)")
        raw = torch.empty(0, dtype=torch.uint8, device=t.device).set_(st)
        self.base[off:off + n].copy_(raw)
        if self.keep_copies:
            self._copies.append((off, raw.cpu().clone()))
        self.used, self.regions, self.bytes_written = off + n, self.regions + 1, self.bytes_written + n
        self._live[key] = off
        live = self._live
        weakref.finalize(st, lambda: live.pop(key, None) if live.get(key) == off else None)
        return off

    def pack(self, t: torch.Tensor):
        if id(t) in self._params or t.untyped_storage().data_ptr() in self._param_ptrs:
            return t
        with on_host():  # the mapping and the check copies are host memory, not activations
            off = self._region(t)
        return (off, t.untyped_storage().nbytes(), t.dtype, t.size(), t.stride(), t.storage_offset(), t.device)

    def unpack(self, ticket):
        if isinstance(ticket, torch.Tensor):
            return ticket
        off, n, dtype, size, stride, offset, device = ticket
        st = self._loaded.get(off)  # views of one storage are read back once, while any of them lives
        if st is None:
            with on_host():
                region = self.base[off:off + n]
            raw = region.to(device, copy=True)  # read back (to the device on a GPU): an activation again
            self.bytes_read += n
            st = raw.untyped_storage()
            self._loaded[off] = st
        raw = torch.empty(0, dtype=torch.uint8, device=device).set_(st)
        return raw.view(dtype).as_strided(size, stride, offset)

    @contextlib.contextmanager
    def hooks(self, params: list[torch.Tensor]):
        """Spill every tensor autograd saves inside the block, except ``params``."""
        self._params = {id(p) for p in params}
        self._param_ptrs = {p.untyped_storage().data_ptr() for p in params}
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            yield self

    def verify(self) -> bool:
        """Every region, read through the file descriptor (not the mapping), holds its storage's bytes
        (needs ``keep_copies=True``)."""
        if not self.keep_copies:
            raise ValueError("verify needs DiskSpill(..., keep_copies=True)")
        return all(os.pread(self.store.fd, c.numel(), off) == bytes(c.numpy()) if _has_numpy() else
                   os.pread(self.store.fd, c.numel(), off) == bytes(c.tolist()) for off, c in self._copies)

    def close(self) -> None:
        if self.map is not None:
            del self.base
            self.map.close()
            self.map = None
        self.store.close()
