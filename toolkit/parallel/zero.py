"""ZeRO stages 0-3: data parallelism that stops keeping n copies of everything.

Every rank runs the whole model on its own micro-batch; the stages differ in what each of the
n ranks keeps at rest and which collectives a step issues (Ψ = parameters, fp32, AdamW)::

                      at rest on each rank                       collectives per step (bytes each rank sends)
              params    grads     AdamW m,v
    stage 0   Ψ         Ψ         2Ψ         backward: all-reduce grads                 2(n-1)/n·4Ψ   (= DDP)
    stage 1   Ψ         Ψ         2Ψ/n       step: reduce-scatter my local grads         (n-1)/n·4Ψ
                                                   update my 1/n, all-gather params      (n-1)/n·4Ψ   (1.0x DDP)
    stage 2   Ψ         Ψ/n       2Ψ/n       backward: reduce-scatter grads              (n-1)/n·4Ψ
                                             step: update my 1/n, all-gather params      (n-1)/n·4Ψ   (1.0x DDP)
    stage 3   Ψ/n       Ψ/n       2Ψ/n       forward:  all-gather each unit, free after  (n-1)/n·4Ψ
                                             backward: all-gather again, reduce-scatter 2(n-1)/n·4Ψ   (1.5x DDP)

Stages 1 and 2 move the same bytes (a reduce-scatter and an all-gather are, together, an all-reduce);
they differ in *when*: stage 1 keeps each rank's full local gradient until the step and reduces once
per step (however many micro-batches were accumulated), stage 2 reduce-scatters each unit's gradient
as soon as backward produces it and keeps only its shard. Stage 3's backward re-gathers only units
whose backward reads their parameters: an embedding's backward is a scatter-add of dy and never does,
so with the embedding as a unit this implementation sends less than the textbook 1.5x.

A *unit* is one child module (embedding, each block, head). Its parameters live in one flat
fp32 buffer padded to a multiple of n; rank r owns the slice [r·S, (r+1)·S), S = padded/n::

    unit buffer  [ w0 | b0 | w1 | ... | pad ]          the module's own parameters become views of it
                 [ rank 0 ][ rank 1 ]...[rank n-1]     the optimizer sees only my shard (an nn.Parameter)

The autograd entry of each unit is ``_Gather``: its forward hands the unit its full buffer (stage 3:
all-gathered from the shards; stages 0-2: the replicated copy), its backward receives the unit's full
gradient and reduces it across ranks (stage 0: all-reduce; stages 2-3: reduce-scatter into my shard;
stage 1: keep it, reduce-scatter in ``step``). ZeRO-3 frees the gathered buffer after the unit's
forward: a ``saved_tensors_hooks`` pair replaces every saved view of it by a ticket (offset, size,
stride) and, when backward first needs one, all-gathers the unit again.

Prefetch (stage 3, on by default, as FSDP2 and DeepSpeed do): the all-gather of the *next* unit is
issued, asynchronously, as soon as the current unit has its own parameters, so it travels while the
current unit computes; the next unit then only waits for what is left of it. One unit ahead, both ways::

    forward   unit i:   wait AG(i) ─► issue AG(i+1) ─► compute F(i) ─► free i
    backward  unit i:   wait AG(i) ─► issue AG(prev)─► compute B(i) ─► reduce-scatter, free i
                        (prev: the nearest earlier unit whose backward reads its parameters)

    without prefetch:   AG(i) ──► F(i) ──► AG(i+1) ──► F(i+1)       every gather on the critical path
    with prefetch:      AG(i) ──► F(i) ─────► F(i+1)                AG(i+1) runs under F(i)
                                  AG(i+1) ┘

At most two gathered units are alive at once (the one computing and the one in flight). A prefetched
buffer stays valid until the shards change: ``step()`` waits for and drops any gather still pending.
With gloo, async collectives run on the process group's own threads, so the overlap is real on CPU too.

Written to be read: one flat buffer per unit, no bucketing, no overlap of the reduce-scatter with
compute (FSDP2 adds those; ``benchmarks/bench_zero_vs_fsdp2.py`` measures what they buy).
"""
from __future__ import annotations

import functools
from typing import Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

from toolkit.runtime import compat
from toolkit.runtime.memory import MemoryTracker

STAGES = (0, 1, 2, 3)
OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
adamw = functools.partial(torch.optim.AdamW, lr=1e-3, foreach=False)
"""Default optimizer factory: AdamW, one tensor at a time (the same arithmetic as on per-parameter tensors)."""


def check_stage(stage: int) -> int:
    """Return ``stage`` if it is 0, 1, 2 or 3; else raise ValueError naming it."""
    if not isinstance(stage, int) or isinstance(stage, bool) or stage not in STAGES:
        raise ValueError(f"stage={stage!r} is not a ZeRO stage; allowed: {STAGES}")
    return stage


def bytes_per_step(stage: int, numel: int, n: int, elem: int = 4, regathered: int | None = None) -> dict[str, int]:
    """Bytes one rank sends per step, by op (the table above); ``numel`` = padded Ψ.

    ``regathered`` (stage 3): how many of the padded parameters backward all-gathers again (default: all).
    """
    s = numel * elem
    ar, ag = 2 * (n - 1) * s // n, (n - 1) * s // n
    again = ag if regathered is None else (n - 1) * regathered * elem // n
    return [{"all_reduce": ar},
            {"reduce_scatter_tensor": ag, "all_gather_into_tensor": ag},
            {"reduce_scatter_tensor": ag, "all_gather_into_tensor": ag},
            {"all_gather_into_tensor": ag + again, "reduce_scatter_tensor": ag}][check_stage(stage)]


def memory_per_rank(stage: int, numel: int, n: int, elem: int = 4) -> dict[str, int]:
    """Bytes at rest on one rank after backward, by category (the table above); ``numel`` = padded Ψ."""
    s = numel * elem
    return [{"params": s, "grads": s, "optim": 2 * s},
            {"params": s, "grads": s, "optim": 2 * s // n},
            {"params": s, "grads": s // n, "optim": 2 * s // n},
            {"params": s // n, "grads": s // n, "optim": 2 * s // n}][check_stage(stage)]


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages under ``tensors`` (views counted once; DTensors by their local shard)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def optimizer_state(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's state tensors, leaving out 0-dim ones (AdamW's 4-byte ``step`` counters)."""
    return [v for state in optimizer.state.values() for v in state.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0]


def default_units(model: nn.Module) -> list[nn.Module]:
    """The model's children that hold parameters, with ModuleLists expanded (embed, block 0..L-1, head)."""
    if any(True for _ in model.parameters(recurse=False)):
        raise ValueError("model has parameters of its own (outside its child modules); pass units= explicitly")
    units = []
    for child in model.children():
        units += list(child) if isinstance(child, nn.ModuleList) else [child]
    return [u for u in units if any(True for _ in u.parameters())]


class _Gather(torch.autograd.Function):
    """Forward: the unit's full flat parameters. Backward: the unit's full gradient, reduced across ranks."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, unit: "_FlatUnit") -> torch.Tensor:
        ctx.unit = unit
        return unit.gather_params()  # [padded]

    @staticmethod
    def backward(ctx, grad_full: torch.Tensor):
        return ctx.unit.reduce_grads(grad_full), None


class _FlatUnit:
    """One module's parameters as one flat buffer, padded to a multiple of the group size, sharded by rank."""

    def __init__(self, module: nn.Module, stage: int, group, names: dict[int, str], index: int = 0,
                 owner: "ZeroDataParallel | None" = None):
        self.module, self.stage, self.group = module, stage, group
        self.index, self.owner = index, owner
        self._pending: tuple[torch.Tensor, object, str, dict] | None = None  # stage 3: (buffer, work, phase, times)
        self.n, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.slots: list[tuple[nn.Module, str, torch.Size]] = []  # (owner module, attribute, shape)
        self.names: list[str] = []
        params = []
        for sub in module.modules():
            for attr, p in list(sub._parameters.items()):
                if p is None:
                    continue
                if id(p) not in names:
                    raise ValueError(f"parameter {attr!r} of {type(sub).__name__} is tied to another one; "
                                     "tied parameters are not supported")
                self.slots.append((sub, attr, p.shape))
                self.names.append(names.pop(id(p)))
                params.append(p)
        # an embedding's backward is a scatter-add of dy: it saves no parameter, so stage 3 needn't re-gather it
        self.backward_reads_params = not all(isinstance(sub, nn.Embedding) for sub, _, _ in self.slots)
        self.numel = sum(p.numel() for p in params)
        self.padded = self.numel if stage == 0 else -(-self.numel // self.n) * self.n
        self.sizes = [p.numel() for p in params] + [self.padded - self.numel]
        flat = torch.zeros(self.padded, dtype=params[0].dtype, device=params[0].device)
        torch.cat([p.detach().reshape(-1) for p in params], out=flat[:self.numel])
        self.shard_numel = self.padded if stage == 0 else self.padded // self.n
        lo = 0 if stage == 0 else self.rank * self.shard_numel
        self.lo, self.hi = lo, lo + self.shard_numel
        if stage < 3:  # replicated buffer; my shard is a view of it, so the optimizer updates it in place
            self.full: torch.Tensor | None = flat
            self.shard = nn.Parameter(flat[self.lo:self.hi])
        else:  # only my shard stays; the full buffer exists only inside this unit's forward and backward
            self.full = None
            self.shard = nn.Parameter(flat[self.lo:self.hi].clone())
        self.grad_full: torch.Tensor | None = None  # stage 1: my local full gradient, reduced in step()
        self._full_ptr = 0  # stage 3: storage of the gathered buffer of the forward now running
        self._regathered: torch.Tensor | None = None  # stage 3: gathered again for backward
        self._saved_hooks = None
        self._t_forward: float | None = None  # timeline: when this unit's forward / backward began
        self._t_backward: float | None = None
        # stage 3: where the shard's values come from when it is not resident (NVMe offload sets this,
        # toolkit.memory.nvme.DiskParams); None: from ``self.shard``
        self.shard_source: Callable[[], torch.Tensor] | None = None
        for sub, attr, _ in self.slots:
            del sub._parameters[attr]
        self._set_views(None if stage == 3 else flat)
        module.register_forward_pre_hook(self._pre_forward)
        module.register_forward_hook(self._post_forward)

    # ---- forward --------------------------------------------------------------------------------
    def _set_views(self, full: torch.Tensor | None) -> None:
        """Point the module's parameter attributes at slices of ``full`` (None: not materialized)."""
        chunks = full.split(self.sizes) if full is not None else [None] * len(self.slots)
        for (sub, attr, shape), chunk in zip(self.slots, chunks):
            setattr(sub, attr, None if chunk is None else chunk.view(shape))

    def _pre_forward(self, module, args) -> None:
        if self.owner is not None:
            self.owner._event("forward", self.index)
        full = _Gather.apply(self.shard, self)  # [padded], part of the autograd graph
        self._set_views(full)
        if self.owner is not None:
            self._t_forward = self.owner._now()  # compute starts once the parameters are here
        if self.stage == 3 and self.owner is not None and self.owner.prefetch:
            nxt = self.owner._next_forward(self)
            if nxt is not None:
                nxt.start_gather("fwd")  # travels while this unit computes
        if self.stage == 3 and torch.is_grad_enabled():
            self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self._saved_hooks.__enter__()

    def _post_forward(self, module, args, output) -> None:
        if self._saved_hooks is not None:
            self._saved_hooks.__exit__(None, None, None)
            self._saved_hooks = None
        # stage 3: drop the last references to the gathered buffer; stages 0-2: plain views (no graph)
        self._set_views(None if self.stage == 3 else self.full)
        if self.owner is not None:
            self.owner._event("forward_done", self.index)
            self.owner._span("F", self._t_forward, unit=self.index)

    def gather_params(self) -> torch.Tensor:
        if self.stage < 3:
            return self.full.view(-1)
        full = self.take_gather("fwd")
        self._full_ptr = full.untyped_storage().data_ptr()
        return full

    def _all_gather(self) -> torch.Tensor:
        """Blocking all-gather of the whole unit (used outside forward and backward, e.g. for checkpoints)."""
        full = torch.empty(self.padded, dtype=self.shard.dtype, device=self.shard.device)
        shard = self.shard.detach() if self.shard_source is None else self.shard_source()
        compat.all_gather_single(full, shard, group=self.group)
        _classify(full, "param")
        return full

    # ---- stage 3: gathers issued ahead (prefetch) and taken when the unit needs them ----------------
    def start_gather(self, phase: str) -> None:
        """Issue the async all-gather of this unit's parameters (no-op if one is already in flight)."""
        if self._pending is not None:
            return
        owner = self.owner
        full = torch.empty(self.padded, dtype=self.shard.dtype, device=self.shard.device)
        times = {"issued": owner._now() if owner else 0.0}
        shard = self.shard.detach() if self.shard_source is None else self.shard_source()
        work = compat.all_gather_single(full, shard, group=self.group, async_op=True)
        if owner is not None and owner.timeline is not None:
            try:  # completion time, stamped by the process group's thread when the data has arrived
                work.get_future().then(lambda _f: times.setdefault("done", owner._now()))
            except (RuntimeError, AttributeError):  # a backend without futures: wait() closes the span
                pass
        _classify(full, "param")
        self._pending = (full, work, phase, times)
        if owner is not None:
            owner._event("gather", self.index, phase, "prefetch")

    def take_gather(self, phase: str) -> torch.Tensor:
        """This unit's full parameters [padded]: the prefetched buffer once it has arrived, else gathered now."""
        owner = self.owner
        if self._pending is None:  # nobody prefetched it: gather on demand, on the critical path
            start = owner._now() if owner else 0.0
            full = self._all_gather()
            if owner is not None:
                owner._event("gather", self.index, phase, "demand")
                end = owner._now()
                owner._span("AG", start, end, unit=self.index, phase=phase, how="demand")
                owner._span("wait", start, end, unit=self.index, phase=phase)
            return full
        full, work, _, times = self._pending
        self._pending = None
        start = owner._now() if owner else 0.0
        work.wait()  # only what is left of the transfer is exposed
        if owner is not None:
            owner._event("wait", self.index, phase)
            end = owner._now()
            owner._span("AG", times["issued"], min(times.get("done", end), end), unit=self.index, phase=phase,
                        how="prefetch")
            owner._span("wait", start, end, unit=self.index, phase=phase)
        return full

    def drain(self) -> None:
        """Wait for and drop a gather still in flight (its data is stale once the shards are updated)."""
        if self._pending is not None:
            self._pending[1].wait()
            self._pending = None

    # ---- stage 3: keep tickets, not parameters, for backward -----------------------------------------
    def _pack(self, t: torch.Tensor):
        if t.untyped_storage().data_ptr() != self._full_ptr:
            return t  # an activation: saved as usual
        return (t.storage_offset(), t.size(), t.stride())

    def _unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        if self._regathered is None:  # first use in this backward: gather the unit once more
            owner = self.owner
            if owner is not None:
                owner._event("backward", self.index)
            self._regathered = self.take_gather("bwd")
            if owner is not None:
                self._t_backward = owner._now()
            if owner is not None and owner.prefetch:
                prev = owner._next_backward(self)
                if prev is not None:
                    prev.start_gather("bwd")  # travels while this unit's backward computes
        offset, size, stride = packed
        return self._regathered.as_strided(size, stride, offset)

    # ---- backward -------------------------------------------------------------------------------
    def reduce_grads(self, grad_full: torch.Tensor) -> torch.Tensor | None:
        """Backward of the unit: return what my shard's ``.grad`` receives (stage 1: nothing yet)."""
        if self.stage == 1:  # keep the local gradient (summed over micro-batches); step() reduces it once
            self.grad_full = grad_full if self.grad_full is None else self.grad_full + grad_full
            _classify(self.grad_full, "grad")
            return None
        grad = grad_full.contiguous().div_(self.n)  # [padded]; average: divide first, as DDP does
        if self.stage == 0:
            dist.all_reduce(grad, group=self.group)
            return grad
        self._regathered = None  # stage 3: backward of this unit is done, free the gathered parameters
        owner = self.owner
        if owner is None or self.stage != 3:
            return self._reduce_scatter(grad)
        start = owner._now()
        if self._t_backward is not None:
            owner._span("B", self._t_backward, start, unit=self.index)
            self._t_backward = None
        shard = self._reduce_scatter(grad)
        owner._event("reduce", self.index)
        owner._span("RS", start, owner._now(), unit=self.index)
        return shard

    def _reduce_scatter(self, grad: torch.Tensor) -> torch.Tensor:
        shard = torch.empty(self.shard_numel, dtype=grad.dtype, device=grad.device)  # [padded/n]
        compat.reduce_scatter_single(shard, grad, group=self.group)
        return shard

    def reduce_scatter_grads(self) -> None:
        """Stage 1, at the step: average my local full gradient over ranks, keep my shard of it."""
        if self.grad_full is not None:
            self.shard.grad = self._reduce_scatter(self.grad_full.div_(self.n))

    def all_gather_params(self) -> None:
        """Stages 1-2, after the step: every rank fetches the shards it did not update."""
        compat.all_gather_single(self.full, self.shard.detach(), group=self.group)


def _classify(t: torch.Tensor, category: str) -> None:
    """Tell an active MemoryTracker what a buffer is (gathered params are params, not activations)."""
    tracker = MemoryTracker.active()
    if tracker is not None:
        tracker.register(t, category)


class ZeroDataParallel(nn.Module):
    """Data parallelism with ZeRO stage 0 (plain DP), 1, 2 or 3 (see the module docstring).

    ::

        zdp = ZeroDataParallel(GPT(cfg), stage=3)          # model built identically on every rank
        loss = zdp(idx, targets); loss.backward()          # collectives happen in the hooks
        zdp.step()                                         # AdamW on my shard (+ all-gather for stages 1-2)

    Args:
        model: the model; its parameters are moved into per-unit flat buffers (the module is modified).
        optimizer_factory: ``f(list_of_shards) -> Optimizer``; default AdamW(lr=1e-3, foreach=False).
        stage: 0, 1, 2 or 3.
        group: the data-parallel process group (default: the world).
        units: modules whose parameters form one flat buffer each (default :func:`default_units`), in the
            order their forwards run (the prefetch order).
        prefetch: stage 3 only: issue the next unit's all-gather one unit ahead, forward and backward.
        timeline: a ``toolkit.runtime.timeline.Timeline`` (``now()``, ``add()``) to record stage 3's spans:
            "F" and "B" per unit (compute), "AG" (all-gather from issue to arrival), "wait" (time blocked on
            a gather: the exposed communication) and "RS" (reduce-scatter), each with ``unit`` in its meta.

    ``trace`` (stage 3) lists what happened in program order, for tests and teaching:
    ``("forward", i)``, ``("forward_done", i)``, ``("gather", i, "fwd" | "bwd", "prefetch" | "demand")``,
    ``("wait", i, phase)``, ``("backward", i)`` (its first use of the parameters) and ``("reduce", i)``.
    """

    def __init__(self, model: nn.Module, optimizer_factory: OptimizerFactory = adamw, stage: int = 1,
                 group=None, units: list[nn.Module] | None = None, prefetch: bool = True, timeline=None):
        super().__init__()
        self.stage = check_stage(stage)
        if not isinstance(prefetch, bool):
            raise ValueError(f"prefetch must be True or False, got {prefetch!r}")
        self.prefetch = prefetch and self.stage == 3
        self.timeline = timeline
        self.trace: list[tuple] = []  # stage 3, in program order: ("forward", i), ("gather", i, phase, how), ...
        self.group = group if group is not None else dist.group.WORLD
        self.n = dist.get_world_size(self.group)
        units = default_units(model) if units is None else units
        names = {id(p): name for name, p in model.named_parameters()}
        self.units = [_FlatUnit(u, self.stage, self.group, names, i, self) for i, u in enumerate(units)]
        if names:
            raise ValueError(f"parameters outside every unit: {sorted(names.values())}")
        self.module = model
        self.shards = nn.ParameterList([u.shard for u in self.units])
        self.optimizer = optimizer_factory(list(self.shards))

    # ---- prefetch order and the record of what happened ----------------------------------------------
    def _next_forward(self, unit: _FlatUnit) -> _FlatUnit | None:
        """The unit whose forward follows ``unit``'s: the next in ``units`` (given in execution order)."""
        return self.units[unit.index + 1] if unit.index + 1 < len(self.units) else None

    def _next_backward(self, unit: _FlatUnit) -> _FlatUnit | None:
        """The nearest earlier unit whose backward gathers its parameters again (backward runs in reverse)."""
        return next((u for u in reversed(self.units[:unit.index]) if u.backward_reads_params), None)

    def _now(self) -> float:
        return self.timeline.now() if self.timeline is not None else 0.0

    def _event(self, *event) -> None:
        if self.stage == 3:
            self.trace.append(event)

    def _span(self, kind: str, start: float, end: float | None = None, **meta) -> None:
        if self.timeline is not None and self.stage == 3:
            self.timeline.add(kind, start, self._now() if end is None else end, **meta)

    @property
    def numel(self) -> int:
        """Ψ: parameters of the model, unpadded."""
        return sum(u.numel for u in self.units)

    @property
    def padded_numel(self) -> int:
        """Ψ after padding each unit to a multiple of the group size (what the collectives move)."""
        return sum(u.padded for u in self.units)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def closed_forms(self) -> dict[str, dict[str, int]]:
        """What this instance should send per step and hold after backward: {"bytes": {op: ...}, "memory": {...}}."""
        again = sum(u.padded for u in self.units if u.backward_reads_params)
        return {"bytes": bytes_per_step(self.stage, self.padded_numel, self.n, regathered=again),
                "memory": memory_per_rank(self.stage, self.padded_numel, self.n)}

    @torch.no_grad()
    def step(self) -> None:
        """Optimizer step on my shards, clear gradients, then (stages 1-2) all-gather the updated params."""
        if self.stage == 1:
            for u in self.units:
                u.reduce_scatter_grads()
        for u in self.units:
            u.drain()  # a gather still in flight holds the old parameters
        self.optimizer.step()
        self.zero_grad()
        if self.stage in (1, 2):
            for u in self.units:
                u.all_gather_params()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop all gradients (always set to None: sharded buffers are cheap to re-create)."""
        self.optimizer.zero_grad(set_to_none=True)
        for u in self.units:
            u.grad_full = None

    def memory_by_category(self) -> dict[str, int]:
        """Bytes of distinct storages on this rank: params, grads, optimizer state (0-dim counters left out)."""
        return {"params": storage_bytes([u.full for u in self.units] + list(self.shards)),
                "grads": storage_bytes([u.grad_full for u in self.units] + [p.grad for p in self.shards]),
                "optim": storage_bytes(optimizer_state(self.optimizer))}

    @torch.no_grad()
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter by its original name, unsharded (stage 3 all-gathers: collective, every rank calls)."""
        out = {}
        for u in self.units:
            full = u.full if u.stage < 3 else u._all_gather()
            for name, chunk, (_, _, shape) in zip(u.names, full.split(u.sizes), u.slots):
                out[name] = chunk.view(shape).clone()
        return out
