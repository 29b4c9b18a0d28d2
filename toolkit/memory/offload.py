"""Pipeline-aware activation offload: saved tensors go to a host store after their forward and come back,
one group ahead, before their backward (Megatron-Core fine-grained offload; PipeOffload, ICML'25).

A group is what one module saves in one (stage, micro-batch, chunk) forward: ln1, qkv, core, proj, ln2,
fc1, act, fc2 of every block, embed, head, and "other" (saved outside those modules: here the loss).
Inside ``offloader.forward(key)`` saved-tensor hooks file every saved tensor under its group; when the
module returns, its group is copied to the host and the device storage released::

    forward of (stage s, mb i)                          backward of (stage s, mb i)
    ──────────────────────────                          ───────────────────────────
    ln1 ─► qkv ─► core ─► proj ─► ... ─► fc2 ─► other   other ◄─ fc2 ◄─ ... ◄─ proj ◄─ core ◄─ qkv ◄─ ln1
     │      │      │       │             │       │        │       ▲ the first unpack of a group reloads
     ▼      ▼      ▼       ▼             ▼       ▼        │       │ the group before it: prefetch
    D2H    D2H    D2H     D2H           D2H   kept if     └ reloaded when the previous backward ended
                                              B(s,i) is next   (pipeline aware: the next B is known)

Pipeline awareness (the rank's action order comes from the schedule):
- the last group of a chunk whose backward is the very next backward on this rank stays on the device
  (offloading it would stall: it is needed right away);
- when a backward ends (or a forward is followed by a backward), the last group of that next backward
  is reloaded ahead of it (prefetch across actions);
- inside a backward, unpacking the first tensor of group g starts the reload of group g-1;
- which micro-batches offload at all (``groups``): ``long_lived`` keeps those whose backward comes within k
  actions of their forward (the last rank of 1F1B: every one), as production systems do;
- how much of each forward leaves (``budget_bytes``, Megatron's per-rank budget): groups leave in forward order,
  the longest-lived first, while the forward's offloaded bytes stay within the budget; ``per_rank_budget``
  sizes it from the schedule so that every rank holds, at its peak, about what the last rank holds.

``Offload`` is the pipeline executor's hook that calls these around every forward and backward.

Policies name the modules whose saved tensors may leave (``KINDS``): a storage leaves only if every
module that saved it is in the policy. Parameters and stage inputs (leaves that require grad, held by
the executor for their gradient) are never offloaded, nor integer tensors (token ids and targets, which
the caller holds anyway). Views of one storage (q, k, v of one qkv) are
copied once and rebuilt as views.

Copies: on CUDA the D2H and H2D copies run on two side streams into a pool of pinned host buffers;
events order them against compute, and a device storage is released when its D2H event completes.
On CPU the copies are synchronous ``copy_`` calls at the same points (host RAM to host RAM: the memory
figures show where the bytes would live on a GPU, the timings the cost of the extra copies), each group's D2H
and H2D one transfer (``toolkit.runtime.portable.HostIO``): on an emulated cluster it is timed on the host link
(float bytes at the target's element size), and an unpack waits for its group's H2D on the stream — a late
reload is one whose wait moved the clock.

Resident bytes are counted with a ``MemoryTracker`` used as a storage ledger: every saved storage on the
device and every reloaded one is registered (``act``), each storage once, and leaves the count when it
is really freed (weakref finalizer); host copies are ``host``.
"""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import ContextManager, Iterable

import torch
import torch.nn as nn

from toolkit.pipeline.executor import ExecutorHook, key_of
from toolkit.pipeline.schedule import Action, Key
from toolkit.runtime.memory import MemoryTracker
from toolkit.runtime.portable import HostIO


# module name (suffix, inside a stage) -> the policy name of what it saves
KINDS = {"embed": "embed", "ln1": "ln1", "attn.qkv": "qkv", "attn.core": "core", "attn.proj": "proj", "ln2": "ln2",
         "mlp.fc1": "fc1", "mlp.act": "act", "mlp.fc2": "fc2", "head": "head"}
ALL_KINDS = ("embed", "ln1", "qkv", "core", "proj", "ln2", "fc1", "act", "fc2", "head", "other")  # other: outside
# every module above (in the GPT pipeline: the loss)
POLICIES = {"none": (), "all": ALL_KINDS, "attention": ("qkv", "core", "proj"), "mlp": ("fc1", "act", "fc2"),
            "norms": ("ln1", "ln2")}


def resolve_policy(policy: str | Iterable[str]) -> frozenset[str]:
    """A named policy (``POLICIES``) or an iterable of module kinds (``ALL_KINDS``) -> the kinds to offload."""
    if isinstance(policy, str):
        if policy in POLICIES:
            return frozenset(POLICIES[policy])
        policy = [policy]
    kinds = frozenset(policy)
    unknown = sorted(kinds - set(ALL_KINDS))
    if unknown:
        raise ValueError(f"offload policy names unknown modules {unknown}; allowed: module kinds {list(ALL_KINDS)} "
                         f"or a named policy {sorted(POLICIES)}")
    return kinds


@dataclass(eq=False)
class _Stored:
    """One storage of a chunk: resident (``device``) and/or in the host store (``host``).

    It belongs to the latest group that saved it (the first one the backward reaches).
    """

    nbytes: int
    copy_bytes: float  # what a copy moves on the target (floats at its element size: HostIO.nbytes)
    kinds: set[str]
    offloadable: bool
    ref: weakref.ref
    group: "_Group"
    device: torch.Tensor | None = None  # uint8 [nbytes] over the whole storage
    host: torch.Tensor | None = None  # uint8 [nbytes], pinned on CUDA
    pending: int = 0  # saved entries not unpacked yet
    event: object = None  # its last copy (D2H, then H2D): a CUDA event, elsewhere a portable.Transfer


@dataclass(eq=False)
class _Saved:
    """What autograd keeps instead of a saved tensor: where its bytes are and how to rebuild the view."""

    group: "_Group"
    stored: _Stored
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


@dataclass(eq=False)
class _Group:
    key: Key
    index: int  # forward order inside its chunk
    stored: list[_Stored] = field(default_factory=list)
    prefetched: bool = False  # its backward has started the reload of the next group


class ActivationOffloader:
    """Saved-tensor hooks per (stage, micro-batch, chunk) that offload by policy, aware of the schedule.

    Args:
        modules: ``{stage: module}`` this rank runs (e.g. ``toolkit.models.Stage``); their parameters are
            never offloaded, their submodules named in ``KINDS`` label what they save.
        order: this rank's actions as ``[(op, (stage, mb, chunk)), ...]`` with op ``"F"`` or ``"B"`` (or ``"I"``),
            in execution order (e.g. from ``toolkit.pipeline.schedule``).
        policy: which modules' saved tensors leave the device (``resolve_policy``).
        groups: only these (stage, mb, chunk) offload (default: all of this rank's); each must be in ``order``.
        prefetch: reload one group ahead (False: reload each group when its backward first needs it).
        min_bytes: keep storages smaller than this resident (Megatron skips tensors under 1M elements).
        budget_bytes: at most this many bytes leave per forward (None: no limit): its groups leave in forward
            order, the longest-lived first, while they fit; the first that does not fit and every later one
            stay (``per_rank_budget`` sizes it per rank).
    """

    def __init__(self, modules: dict[int, nn.Module], order: list[tuple[str, Key]], policy="all",
                 groups: Iterable[Key] | None = None, prefetch: bool = True, min_bytes: int = 0,
                 budget_bytes: int | None = None):
        if budget_bytes is not None and (isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int)
                                         or budget_bytes < 0):
            raise ValueError(f"budget_bytes must be None (no limit) or an int >= 0 (bytes offloaded per forward), "
                             f"got {budget_bytes!r}")
        self.budget_bytes = budget_bytes
        self.kinds = resolve_policy(policy)
        self.order = [(op, tuple(key)) for op, key in order]
        mine = {key for _, key in self.order}
        self.groups = mine if groups is None else {tuple(g) for g in groups}
        missing = sorted(self.groups - mine)
        if missing:
            raise ValueError(f"offload asked for (stage, mb, chunk) {missing} that this rank's schedule does not "
                             f"run; this rank runs {sorted(mine)}")
        self.prefetch, self.min_bytes = prefetch, min_bytes
        self.cuda = any(p.is_cuda for m in modules.values() for p in m.parameters())
        self.meter = MemoryTracker(every_op=False)  # not entered: a ledger of the storages registered below
        self._param_ptrs = {p.untyped_storage().data_ptr() for m in modules.values() for p in m.parameters()}
        self._key: Key | None = None
        self._kind: list[str] = []
        self._seq, self._keep_last, self._held = 0, False, None
        self._spent, self._over_budget = 0, False  # bytes offloaded by the current forward; a group did not fit
        self._by_storage: dict[int, _Stored] = {}  # id(untyped storage) -> _Stored, during one forward
        self._live: dict[Key, dict[int, _Group]] = {}  # key -> group index (forward order) -> group
        self._pool: dict[int, list[torch.Tensor]] = {}
        self._inflight: list[tuple[object, list[torch.Tensor]]] = []  # (event, tensors to keep until it completes)
        self.stats = {"offloaded_bytes": 0, "reloaded_bytes": 0, "wasted_copy_bytes": 0, "late_reloads": 0,
                      "on_demand_reloads": 0, "kept_last": 0, "reload_wait_s": 0.0, "offloadable_bytes": 0}
        """``late_reloads``: reloads the backward had to wait for — on the emulated cluster the copies whose wait
        moved the stream's clock (``reload_wait_s``: by how much, in all), on a plain run the reloads that were not
        issued ahead (the only evidence a CPU run has). ``on_demand_reloads``: reloads issued only when the
        backward needed them (not ahead), in any run. ``offloadable_bytes``: bytes saved by the forwards that a
        policy could move (any policy; parameters, stage inputs, integers and storages under ``min_bytes`` aside)."""
        self.io = HostIO()  # the copies off CUDA (timed on the emulated host link, when there is one)
        if self.cuda:
            self.d2h, self.h2d = torch.cuda.Stream(), torch.cuda.Stream()
        self._hooks = []
        for module in modules.values():
            self._install(module)

    # ---- module hooks: which module is saving; a group ends where a module starts or ends ------------------
    def _install(self, module: nn.Module) -> None:
        for name, sub in module.named_modules():
            kind = next((k for suffix, k in KINDS.items() if name == suffix or name.endswith("." + suffix)), None)
            if kind:
                self._hooks.append(sub.register_forward_pre_hook(lambda m, a, k=kind: self._enter(k)))
                self._hooks.append(sub.register_forward_hook(lambda m, a, o: self._exit()))

    def _enter(self, kind: str) -> None:
        self._boundary()
        self._kind.append(kind)

    def _exit(self) -> None:
        self._kind.pop()
        self._boundary()

    def _boundary(self) -> None:
        """The group filled since the last boundary is complete: offload it (or hold it back one group)."""
        if self._key is None:
            return
        group = self._live[self._key].get(self._seq)
        self._seq += 1
        if group is None or group.key not in self.groups:
            return
        if self._keep_last:  # this chunk's backward is next: offload each group only once a later one exists
            if self._held is not None:
                self._offload(self._held)
            self._held = group
        else:
            self._offload(group)

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()

    # ---- the schedule -------------------------------------------------------------------------------
    def _next_backward(self, after: int) -> Key | None:
        return next((key for op, key in self.order[after + 1:] if op in ("B", "I")), None)

    def _index(self, op: str, key: Key) -> int:
        for i, (o, k) in enumerate(self.order):
            if k == key and (o == op or (op == "B" and o == "I")):
                return i
        raise ValueError(f"{op}{key} (stage, mb, chunk) is not in this rank's schedule")

    # ---- forward: pack --------------------------------------------------------------------------------
    @contextlib.contextmanager
    def forward(self, key: Key):
        """Run the forward of ``key`` (stage, mb, chunk) inside this block."""
        key = tuple(key)
        i = self._index("F", key)  # raises for a chunk the schedule does not have
        self._key, self._live[key], self._seq, self._held, self._by_storage = key, {}, 0, None, {}
        self._spent, self._over_budget = 0, False
        # the last group of a chunk whose backward is the next one on this rank stays on the device
        self._keep_last = self._next_backward(i) == key
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
            self._boundary()
            if self._held is not None:
                self.stats["kept_last"] += 1
        finally:
            self._key, self._held, self._by_storage = None, None, {}
            self._kind.clear()
        self._poll()
        if i + 1 < len(self.order) and self.order[i + 1][0] in ("B", "I"):
            self._prefetch_backward(self.order[i + 1][1])

    def _pack(self, t: torch.Tensor):
        st = t.untyped_storage()
        if st.data_ptr() in self._param_ptrs:
            return t  # never offload parameters
        group = self._live[self._key].setdefault(self._seq, _Group(self._key, self._seq))
        kind = self._kind[-1] if self._kind else "other"
        stored = self._by_storage.get(id(st))
        if stored is None or stored.ref() is not st:  # new (or an id reused after a free)
            # stage inputs (the executor holds them for their gradient) and integer tensors (token ids,
            # targets: held by the caller) would be copied without freeing anything
            held_elsewhere = (t.requires_grad and t.grad_fn is None) or not t.is_floating_point()
            copy_bytes = self.io.nbytes(st.nbytes() // t.element_size(), t.dtype)
            stored = _Stored(st.nbytes(), copy_bytes, set(), not held_elsewhere and st.nbytes() >= self.min_bytes,
                             weakref.ref(st), group, device=_bytes_of(st))
            self._by_storage[id(st)] = stored
            group.stored.append(stored)
            self.meter.register(t, "act")
            self.stats["offloadable_bytes"] += stored.nbytes if stored.offloadable else 0
        elif stored.group is not group:  # saved again by a later module (core's output is proj's input)
            stored.group.stored.remove(stored)
            stored.group = group
            group.stored.append(stored)
        stored.kinds.add(kind)
        if stored.host is not None and not stored.kinds <= self.kinds:  # now also saved by a kept module
            stored.device = _bytes_of(st)  # it stays alive anyway: keep it, drop the copy
            self._pool.setdefault(stored.nbytes, []).append(stored.host)
            stored.host = None
            self.stats["wasted_copy_bytes"] += stored.nbytes
        stored.pending += 1
        return _Saved(group, stored, t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset())

    def _offload(self, group: _Group) -> None:
        movers = [s for s in group.stored if s.offloadable and s.kinds <= self.kinds and s.host is None]
        if not movers:
            return
        if self.budget_bytes is not None:  # groups leave in forward order while they fit; then none
            size = sum(s.nbytes for s in movers)
            self._over_budget = self._over_budget or self._spent + size > self.budget_bytes
            if self._over_budget:
                return
            self._spent += size
        if self.cuda:
            self.d2h.wait_stream(torch.cuda.current_stream())  # the activations are computed
            with torch.cuda.stream(self.d2h):
                for s in movers:
                    s.host = self._host_buffer(s.nbytes)
                    s.host.copy_(s.device, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
            self._inflight.append((event, [s.device for s in movers]))  # device memory freed once copied
            for s in movers:
                s.event = event
        else:
            with self.io.to_host() as copy:
                for s in movers:
                    s.host = self._host_buffer(s.nbytes)
                    s.host.copy_(s.device)
                    copy.add(s.copy_bytes)
            for s in movers:
                s.event = copy
        for s in movers:
            s.device = None  # the device storage is released (on CUDA: once its copy completes)
            self.stats["offloaded_bytes"] += s.nbytes

    def _host_buffer(self, nbytes: int) -> torch.Tensor:
        pool = self._pool.get(nbytes)
        tracker = MemoryTracker.active()
        if pool:
            buf = pool.pop()
            if tracker:  # a buffer from an earlier step: the active tracker would count its first copy_ as "act"
                tracker.register(buf, "host")
            return buf
        with tracker.categorize("host") if tracker else contextlib.nullcontext():
            buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.cuda)
        self.meter.register(buf, "host")
        return buf

    # ---- backward: reload and unpack -------------------------------------------------------------------
    def _reload(self, group: _Group) -> None:
        movers = [s for s in group.stored if s.host is not None and s.device is None]
        if not movers:
            return
        if self.cuda:
            with torch.cuda.stream(self.h2d):
                for ev in {id(s.event): s.event for s in movers if s.event is not None}.values():
                    self.h2d.wait_event(ev)  # its D2H copy is complete
                for s in movers:
                    s.device = torch.empty(s.nbytes, dtype=torch.uint8, device="cuda")
                    s.device.copy_(s.host, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
            for s in movers:
                s.event = event
        else:
            after = max((s.event.end for s in movers if s.event is not None), default=0.0)  # its D2H copy is done
            with self.io.to_device(after) as copy:
                for s in movers:
                    s.device = s.host.clone()
                    copy.add(s.copy_bytes)
            for s in movers:
                s.event = copy
        for s in movers:
            self.meter.register(s.device, "act")
            self.stats["reloaded_bytes"] += s.nbytes

    def _unpack(self, saved) -> torch.Tensor:
        if isinstance(saved, torch.Tensor):
            return saved
        group, s = saved.group, saved.stored
        if s.device is None:
            self.stats["late_reloads"] += not self.io.measures_waits  # not prefetched: the backward waits for it
            self.stats["on_demand_reloads"] += 1
            self._reload(s.group)
        if self.prefetch and not group.prefetched:
            group.prefetched = True
            below = [g for i, g in self._live.get(group.key, {}).items() if i < group.index]
            if below:
                self._reload(max(below, key=lambda g: g.index))  # the next group the backward reaches
        if self.cuda and s.event is not None:
            torch.cuda.current_stream().wait_event(s.event)  # its H2D copy is complete
            s.device.record_stream(torch.cuda.current_stream())  # allocated on the side stream
        elif s.event is not None:  # the stream waits for the H2D copy (on the emulated host link: it may move)
            waited = s.event.wait()
            if waited > 0:
                self.stats["late_reloads"] += 1
                self.stats["reload_wait_s"] += waited
            s.event = None
        t = torch.empty(0, dtype=saved.dtype, device=s.device.device).set_(
            s.device.untyped_storage(), saved.offset, saved.size, saved.stride)
        s.pending -= 1
        if s.pending == 0:  # autograd holds the last view now; drop ours so the storage dies with it
            s.device = None
            if s.host is not None:
                self._pool.setdefault(s.nbytes, []).append(s.host)
                s.host = None
        return t

    def backward_begin(self, key: Key) -> None:
        """Call before the backward of ``key``: its last group must be on the device."""
        key = tuple(key)
        self._index("B", key)
        groups = self._live.get(key, {})
        if groups and any(s.device is None for s in groups[max(groups)].stored):
            self.stats["late_reloads"] += not self.io.measures_waits  # measured: counted where the wait moves
            self.stats["on_demand_reloads"] += 1
            self._reload(groups[max(groups)])

    def backward_end(self, key: Key) -> None:
        """Call after the backward of ``key``: drop its groups, prefetch the next backward's last group."""
        key = tuple(key)
        for group in self._live.pop(key, {}).values():
            self._release(group)
        self._poll()
        nxt = self._next_backward(self._index("B", key))
        if nxt is not None and self.prefetch:
            self._prefetch_backward(nxt)

    def _release(self, group: _Group) -> None:
        """Its chunk's backward is over: free what is still held (a storage reloaded or kept for a saved tensor
        the backward never unpacked), give host buffers back to the pool, and break the group <-> storage
        reference cycle, so the bytes go now rather than whenever Python's cycle collector runs."""
        for s in group.stored:
            if s.host is not None:
                self._pool.setdefault(s.nbytes, []).append(s.host)
            s.device = s.host = None
        group.stored.clear()

    def _prefetch_backward(self, key: Key) -> None:
        groups = self._live.get(key, {})
        if groups:
            self._reload(groups[max(groups)])

    def _poll(self) -> None:
        """Release device storages (and host buffers) whose copies have completed."""
        self._inflight = [(ev, keep) for ev, keep in self._inflight if not ev.query()]

    def resident_bytes(self) -> int:
        """Saved activation bytes on the device now (each storage once)."""
        return self.meter.current()["act"]

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        self._inflight.clear()


def _bytes_of(st: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over a whole storage (what the copies move)."""
    return torch.empty(0, dtype=torch.uint8, device=st.device).set_(st, 0, (st.nbytes(),), (1,))


# ------------------------------------------------------------------------------------------------
# Which micro-batches to offload: by how long their activations live (pipeline-aware)
# ------------------------------------------------------------------------------------------------
def schedule_order(schedule, rank: int) -> list[tuple[str, Key]]:
    """Rank ``rank``'s forwards and backwards in ``schedule`` (``toolkit.pipeline.schedule``) as
    ``[(op, (stage, mb, chunk)), ...]`` in execution order: the ``order`` an ``ActivationOffloader`` takes."""
    return [(part.op, (part.stage, part.mb, part.chunk)) for a in schedule.ranks[rank] for part in a.parts
            if part.op in ("F", "B", "I")]


def long_lived(order: list[tuple[str, Key]], skip_within: int) -> set[Key]:
    """The (stage, mb, chunk) worth offloading: those whose backward comes more than ``skip_within`` actions
    after their forward in this rank's order. What production systems do instead of offloading everything::

        1F1B, p = 4      rank 0: F0 F1 F2 F3 B0 F4 B1 ...   F(i) ──► B(i): 4 to 7 actions   offload
                         rank 3: F0 B0 F1 B1 ...            F(i) ──► B(i): 1 action        skip

    Activations that come back at once cost two copies and free memory only for a moment, so later ranks
    (whose activations live one F→B) offload less and the last rank of 1F1B nothing (Megatron offloads
    ``pp_rank * delta`` fewer bytes on higher ranks; PipeOffload offloads by lifetime). 0 keeps everything.
    """
    if not isinstance(skip_within, int) or isinstance(skip_within, bool) or skip_within < 0:
        raise ValueError(f"skip_within must be an int >= 0 (actions between a forward and its backward), "
                         f"got {skip_within!r}")
    forward = {key: i for i, (op, key) in enumerate(order) if op == "F"}
    return {key for i, (op, key) in enumerate(order) if op in ("B", "I") and i - forward[key] > skip_within}


def in_flight(order: list[tuple[str, Key]]) -> int:
    """The most (stage, mb, chunk) whose forward has run and whose backward has not, at any point of ``order``:
    how many micro-batches' activations the rank holds at its peak (1F1B: p - r on rank r)."""
    held = peak = 0
    for op, _ in order:
        held += 1 if op == "F" else -1 if op in ("B", "I") else 0
        peak = max(peak, held)
    return peak


def per_rank_budget(chunk_bytes: int, order: list[tuple[str, Key]]) -> int:
    """The ``budget_bytes`` that brings this rank's peak down to what one forward saves, ``chunk_bytes``: at its
    peak it holds k = ``in_flight(order)`` forwards, so each sheds 1 - 1/k of its bytes (formula)::

        1F1B, p = 4        k    each forward sheds        held at the peak
          rank 0           4    3/4 of chunk_bytes         4 x 1/4 = 1 chunk
          rank 1           3    2/3                        3 x 1/3 = 1 chunk
          rank 3 (last)    1    nothing                    1 chunk

    Megatron's rule is the same shape with a knob: rank r keeps ``r * delta`` more bytes on the device
    (``delta_offload_bytes_across_pp_ranks``); here the amount comes from the schedule. What stays of each
    forward is its last groups, the ones its backward reaches first (see ``budget_bytes``)."""
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 0:
        raise ValueError(f"chunk_bytes must be an int >= 0 (bytes one forward saves), got {chunk_bytes!r}")
    k = in_flight(order)
    return chunk_bytes - chunk_bytes // k if k else 0


# ------------------------------------------------------------------------------------------------
# The executor hooks
# ------------------------------------------------------------------------------------------------

class Offload(ExecutorHook):
    """The pipeline executor's hook for an ``ActivationOffloader``: around every forward (F, not R: an R
    rebuilds activations right before their backward, nothing to send away) ``offloader.forward(key)``, around
    every backward (B and I alike, also as halves of an F&B) ``backward_begin`` / ``backward_end``::

        PipelineExecutor(schedule, rank, modules, loss_fn, act_shape, hooks=[Offload(offloader)])
    """

    def __init__(self, offloader: ActivationOffloader):
        self.offloader = offloader

    def forward_context(self, a: Action) -> ContextManager:
        return self.offloader.forward(key_of(a)) if a.op == "F" else contextlib.nullcontext()

    def before_backward(self, a: Action) -> None:
        self.offloader.backward_begin(key_of(a))

    def after_backward(self, a: Action) -> None:
        self.offloader.backward_end(key_of(a))


class SaveOnCPU(ExecutorHook):
    """torch's ``save_on_cpu`` around every forward: every saved tensor (parameters included) to the host, back
    when its backward unpacks it (no prefetch, not pipeline aware; the baseline lesson 08 compares with).

    On a GPU both copies run on the compute stream (pinned: ``copy_(non_blocking=True)`` in pack, ``.to(device,
    non_blocking=True)`` in unpack), so every kernel after them waits. On a CPU they move nothing (``.cpu()`` of a
    CPU tensor is the tensor); on the emulated cluster each is timed as on the GPU: a transfer of the saved
    tensor's bytes on the host link that the stream waits for, D2H in pack, H2D in unpack."""

    def forward_context(self, a: Action) -> ContextManager:
        if a.op != "F":
            return contextlib.nullcontext()
        hooks = torch.autograd.graph.save_on_cpu(pin_memory=self.executor.device.type == "cuda")
        io = HostIO()

        def copied(hook, to_host: bool):
            def run(x):
                with io.to_host() if to_host else io.to_device() as copy:
                    out = hook(x)
                    t = x if to_host else out
                    copy.add(io.nbytes(t.numel(), t.dtype))
                copy.wait()
                return out
            return run

        return torch.autograd.graph.saved_tensors_hooks(copied(hooks.pack_hook, True),
                                                        copied(hooks.unpack_hook, False))
