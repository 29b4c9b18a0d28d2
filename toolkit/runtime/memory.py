"""Tensor memory by category, over time, counted from tensor storages (never RSS).

::

    with MemoryTracker(model, optimizer) as mem:        every op's outputs ──► __torch_dispatch__
        mem.mark("forward mb0")                                │ new storage? weakref + finalizer,
        loss = model(x); loss.backward()                       │ counted once however many views
        mem.mark("optimizer")                                  ▼
        optimizer.step()                          counters[category] += storage.nbytes()
                                                  finalizer (storage freed) ──► queue ──► counters -= nbytes
    mem.peak            bytes by category at the overall peak of "total"
    mem.max_by_category each category's own maximum
    mem.samples         [{"t", "label", "param", "grad", "optim", "act", "comm", "host", "total"}, ...]

Categories (each storage is in exactly one):

- ``param``  the model's parameters and buffers;
- ``grad``   storages that are some parameter's ``.grad`` (found by a post-accumulate-grad hook and
  re-checked at every mark);
- ``optim``  the optimizer's ``state`` tensors, and everything allocated inside ``optimizer.step()``
  while it lives (torch's MemTracker does the same);
- ``act``    everything else allocated inside the tracker: activations, backward temporaries, and
  gradients until autograd hands them to a parameter;
- ``comm``   buffers you ``register(t, "comm")`` (bucketed gradients, all-gather outputs...);
- ``host``   copies kept in a host store (offloaded activations, CPU optimizer state); reported but
  not part of ``total``, which is meant as the device's resident bytes.

Counted: storages created inside the context, those of the model / optimizer / ``register``, and a
storage built outside from the first op that returns a view of it (torch's MemTracker counts the
same storages; tests/test_memory_tracker.py checks the peaks agree byte for byte on the tiny GPT). Frees are seen through weakref
finalizers on the storages and applied before the next op is counted, so the peak is exact at op
granularity. Bytes are exact ``nbytes`` of each storage; on CUDA the caching allocator rounds blocks
up to 512 B and keeps freed blocks, so ``summary()`` also reports ``torch.cuda.max_memory_allocated``.
"""
from __future__ import annotations

import collections
import contextlib
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

def get_untyped_storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages behind ``t``: its own, or those of a wrapper subclass's inner tensors (DTensor).

    (torch.distributed._tools has the same helper, but importing that package pulls in inductor: ~1 s per rank.)
    """
    pending, storages = [t], []
    while pending:
        obj = pending.pop()
        if is_traceable_wrapper_subclass(obj):
            attrs, _ = obj.__tensor_flatten__()
            pending.extend(v for v in (getattr(obj, a) for a in attrs) if isinstance(v, torch.Tensor))
        elif hasattr(obj, "untyped_storage"):
            storages.append(obj.untyped_storage())
    return storages


CATEGORIES = ("param", "grad", "optim", "act", "comm", "host")
DEVICE_CATEGORIES = CATEGORIES[:-1]  # the ones summed into "total"


@dataclass(eq=False)
class _Storage:
    """What the tracker remembers of one live storage (the storage itself only weakly)."""

    key: int
    ref: weakref.ref
    nbytes: int
    category: str
    device: str


class MemoryTracker(TorchDispatchMode):
    """Counts live tensor bytes by category while active; see the module docstring.

    Args:
        model: module(s) whose parameters (``param``) and their ``.grad`` (``grad``) are classified.
        optimizer: optimizer(s) whose ``state`` tensors are ``optim``; its ``step()`` is hooked.
        every_op: append a sample after every op that allocates (True) or only at ``mark`` (False).
            The peak is exact either way.
    """

    _active: list["MemoryTracker"] = []

    def __init__(self, model: nn.Module | list[nn.Module] | None = None, optimizer=None, every_op: bool = True):
        super().__init__()
        self.models = [] if model is None else list(model) if isinstance(model, (list, tuple)) else [model]
        self.optimizers = ([] if optimizer is None else
                           list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer])
        self.every_op = every_op
        self.counters = dict.fromkeys(CATEGORIES, 0)
        self.samples: list[dict] = []
        self.peak: dict[str, int] = {**dict.fromkeys(CATEGORIES, 0), "total": 0}
        self.max_by_category: dict[str, int] = {**dict.fromkeys(CATEGORIES, 0), "total": 0}
        self.label = ""
        self.peak_label = ""
        self.cuda_max_allocated: int | None = None
        self._live: dict[int, _Storage] = {}
        self._freed: collections.deque[_Storage] = collections.deque()  # appended by finalizers
        self._alloc_category: list[str] = []  # stack: what new storages are (``categorize``)
        self._handles: list = []
        self._last_total = -1

    # ---- public API -------------------------------------------------------------------------------
    def register(self, tensor: torch.Tensor, category: str) -> None:
        """Count ``tensor``'s storage as ``category`` (e.g. ``"comm"``) from now until it is freed.

        Also works on a tracker that is never entered: it is then a ledger of exactly the storages
        registered (each once, dropped when freed), e.g. the saved activations of an offloader.
        """
        if category not in CATEGORIES:
            raise ValueError(f"category={category!r} is not known; allowed: {CATEGORIES}")
        self._drain()
        self._classify(tensor, category)
        self._observe()

    def mark(self, label: str) -> None:
        """Label the samples that follow; re-classify params, grads and optimizer state; take a sample."""
        self._drain()
        self._scan()
        self.label = label
        self._sample(force=True)

    @contextlib.contextmanager
    def categorize(self, category: str):
        """Storages allocated inside this block are ``category`` (e.g. a host store's copies: ``"host"``)."""
        if category not in CATEGORIES:
            raise ValueError(f"category={category!r} is not known; allowed: {CATEGORIES}")
        self._alloc_category.append(category)
        try:
            yield
        finally:
            self._alloc_category.pop()

    @classmethod
    def active(cls) -> "MemoryTracker | None":
        """The innermost tracker now active in this process, if any (for libraries that want to label)."""
        return cls._active[-1] if cls._active else None

    def current(self) -> dict[str, int]:
        """Bytes by category right now (and ``total``)."""
        self._drain()
        return {**self.counters, "total": self._total()}

    def summary(self) -> dict:
        """JSON-able: peak (by category at the overall peak), max by category, current, sample count."""
        out = {"peak": dict(self.peak), "peak_label": self.peak_label, "max_by_category": dict(self.max_by_category),
               "current": self.current(), "n_samples": len(self.samples)}
        if self.cuda_max_allocated is not None:
            out["cuda_max_memory_allocated"] = self.cuda_max_allocated
        return out

    # ---- context ---------------------------------------------------------------------------------
    def __enter__(self) -> "MemoryTracker":
        for model in self.models:
            for p in model.parameters():
                self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))
        for opt in self.optimizers:
            if hasattr(opt, "register_step_pre_hook"):
                self._handles.append(opt.register_step_pre_hook(lambda *a: self._alloc_category.append("optim")))
                self._handles.append(opt.register_step_post_hook(self._after_step))
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        self._scan()
        self._sample(force=True)
        MemoryTracker._active.append(self)
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        MemoryTracker._active.remove(self)
        self._alloc_category.clear()  # an optimizer step that raised never popped its "optim"
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._drain()
        self._scan()
        self._sample(force=True)
        if torch.cuda.is_available():
            self.cuda_max_allocated = torch.cuda.max_memory_allocated()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._drain()
        category = self._alloc_category[-1] if self._alloc_category else "act"
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t, category)
        self._observe()
        return out

    # ---- internals ---------------------------------------------------------------------------------
    def _total(self) -> int:
        return sum(self.counters[c] for c in DEVICE_CATEGORIES)

    def _track(self, t: torch.Tensor, category: str) -> list[_Storage]:
        """Start counting ``t``'s storages (as ``category``) unless they are counted already."""
        recs = []
        for st in get_untyped_storages(t):  # one storage, or the inner ones of a wrapper subclass (DTensor)
            if st.device.type == "meta":  # fake tensors own no memory
                continue
            rec = self._live.get(id(st))
            if rec is not None and rec.ref() is st:
                if rec.nbytes != st.nbytes():  # resized in place (FSDP frees/regrows unsharded params so)
                    self.counters[rec.category] += st.nbytes() - rec.nbytes
                    rec.nbytes = st.nbytes()
            else:
                rec = _Storage(id(st), None, st.nbytes(), category, st.device.type)
                freed = self._freed
                rec.ref = weakref.ref(st, lambda _, rec=rec: freed.append(rec))
                self._live[rec.key] = rec
                self.counters[category] += rec.nbytes
            recs.append(rec)
        return recs

    def _classify(self, t: torch.Tensor, category: str) -> None:
        for rec in self._track(t, category):
            if rec.category != category:
                self.counters[rec.category] -= rec.nbytes
                self.counters[category] += rec.nbytes
                rec.category = category

    def _drain(self) -> None:
        """Apply the frees that finalizers queued since the last op."""
        while self._freed:
            rec = self._freed.popleft()
            self.counters[rec.category] -= rec.nbytes
            if self._live.get(rec.key) is rec:
                del self._live[rec.key]

    def _scan(self) -> None:
        """Classify the model's params/buffers/grads and the optimizer's state as they are now."""
        for model in self.models:
            for p in model.parameters():
                self._classify(p, "param")
                if p.grad is not None:
                    self._classify(p.grad, "grad")
            for b in model.buffers():
                self._classify(b, "param")
        for opt in self.optimizers:
            for state in opt.state.values():
                for v in state.values():
                    if isinstance(v, torch.Tensor):
                        self._classify(v, "optim")

    def _on_grad(self, p: torch.Tensor) -> None:
        self._drain()
        self._classify(p.grad, "grad")
        self._observe()

    def _after_step(self, opt, *_) -> None:
        self._alloc_category.pop()
        self._drain()
        for state in opt.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    self._classify(v, "optim")
        self._observe()

    def _observe(self) -> None:
        total = self._total()
        for c in CATEGORIES:
            if self.counters[c] > self.max_by_category[c]:
                self.max_by_category[c] = self.counters[c]
        if total > self.peak["total"]:
            self.peak = {**self.counters, "total": total}
            self.peak_label = self.label
            self.max_by_category["total"] = total
        if self.every_op:
            self._sample()

    def _sample(self, force: bool = False) -> None:
        total = self._total()
        if force or total != self._last_total:
            self.samples.append({"t": len(self.samples), "label": self.label, **self.counters, "total": total})
            self._last_total = total


def saved_activation_bytes(forward: Callable[[], torch.Tensor], params: list[torch.Tensor]) -> tuple[int, object]:
    """Run ``forward()`` and return (bytes autograd saved for backward, forward's output).

    Parameters are not activations and are excluded; each storage is counted once.
    """
    param_storages = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        if storage.data_ptr() not in param_storages:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    return sum(seen.values()), out
