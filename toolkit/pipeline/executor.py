"""Run any ``Schedule`` for real: one process per rank, point-to-point send/recv between stages.

Each rank walks its own action list. Before an action runs, the receives it (and the next action) need
are posted as ``irecv``; outputs leave by ``isend`` right after they are computed, so transfers overlap
the following compute. Every message has its own tag, derived from (kind, stage, micro-batch, chunk),
so the order in which ranks post them cannot mismatch them::

    rank r, action a = F(s, mb)                           rank r, action a = B(s, mb)  (or I)
    ──────────────────────────                            ───────────────────────────
    x  = tokens[mb]            if s == 0                  g  = wait irecv(grad of s)    if s < last
       = wait irecv(act of s)  if stage s-1 elsewhere        = 1 (d loss)               if s == last
       = local handoff         if stage s-1 here          backward(out, g)  ──► x.grad
    out = stage_s(x)   (+ loss / m on the last stage)     isend(x.grad) to stage s-1's rank (or hand off)
    isend(out) to stage s+1's rank (or hand off)          I: weight grads queued in WeightGradStore
    keep (x, out) for the backward                        W: pop and run them (zero-bubble split)

    FB = F of one micro-batch, then B of another (DualPipe's F&B; on one CPU stream they cannot overlap)
    R  = rebuild a checkpointed forward's activations (``recompute.RecomputeQueue``)

Deferred weight gradients (``WeightGradStore``, as in DeepSeek's DualPipe): ``split_weight_grads``
swaps each ``nn.Linear`` for one whose backward computes dX at once and, while the store is enabled,
queues a closure for dW = g^T x (and db) instead of computing it. LayerNorm and embedding gradients are
computed in the I itself. The store is keyed by (stage, mb, chunk), so a W runs exactly its own I's work.

``ActivationMeter`` counts what the activations really cost: every tensor autograd saves during a
forward (``saved_tensors_hooks``), parameters excluded, each storage once (views share one), released
when the backward (or the W) that needs it is done.
"""
from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from typing import Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .recompute import RecomputeQueue
from .schedule import Action, Schedule

Key = tuple[int, int, int]  # (stage, micro-batch, sequence chunk)


# ------------------------------------------------------------------------------------------------
# Deferred weight gradients
# ------------------------------------------------------------------------------------------------
class WeightGradStore:
    """dW closures queued by ``SplitLinear`` backwards while ``enabled`` (one store per process).

    ``split_forward`` is set around the forwards whose backward will be an I: only those build the custom
    autograd node; every other forward runs the plain ``F.linear`` (no Python in its backward).
    """

    enabled = False
    split_forward = False
    _cache: list[tuple[Callable[[], None], tuple[torch.Tensor, ...]]] = []
    _queue: dict[Key, list[tuple[Callable[[], None], tuple[torch.Tensor, ...]]]] = {}

    @classmethod
    def put(cls, fn: Callable[[], None], tensors: tuple[torch.Tensor, ...]) -> None:
        cls._cache.append((fn, tensors))

    @classmethod
    def flush(cls, key: Key) -> None:
        """File the closures queued since the last flush under ``key`` (call after an I)."""
        cls._queue[key], cls._cache = cls._cache, []

    @classmethod
    def held(cls, key: Key) -> list[torch.Tensor]:
        """The tensors the deferred dW of ``key`` keeps alive (inputs and output gradients of Linears)."""
        return [t for _, tensors in cls._queue.get(key, []) for t in tensors]

    @classmethod
    def pop(cls, key: Key) -> None:
        """Run the deferred dW of ``key`` (a W action)."""
        for fn, _ in cls._queue.pop(key):
            fn()

    @classmethod
    def clear(cls) -> None:
        cls.enabled, cls.split_forward, cls._cache, cls._queue = False, False, [], {}


class _SplitLinearFn(torch.autograd.Function):
    """y = x W^T + b whose backward returns dX only; dW and db go to the parameters' ``.grad`` now, or
    later from ``WeightGradStore`` while it is enabled (DualPipe's ``LinearFunc``)."""

    @staticmethod
    def forward(ctx, x, weight, bias):  # x [..., in] -> [..., out]
        ctx.save_for_backward(x)
        ctx.weight, ctx.bias = weight, bias  # the parameters themselves (saved tensors may come back as aliases)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):  # grad [..., out]
        (x,), weight, bias = ctx.saved_tensors, ctx.weight, ctx.bias

        @torch.no_grad()
        def weight_grad():
            g2, x2 = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])  # [N,out], [N,in]
            for param, g in ((weight, g2.t() @ x2), (bias, g2.sum(0) if bias is not None else None)):
                if g is not None:
                    param.grad = g if param.grad is None else param.grad.add_(g)

        if WeightGradStore.enabled:
            WeightGradStore.put(weight_grad, (grad, x))
        else:
            weight_grad()
        return grad @ weight, None, None  # dX [..., in]


class SplitLinear(nn.Linear):
    """``nn.Linear`` whose weight gradient can be deferred to a W action (see ``WeightGradStore``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if WeightGradStore.split_forward:
            return _SplitLinearFn.apply(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def split_weight_grads(module: nn.Module) -> nn.Module:
    """Turn every ``nn.Linear`` in ``module`` into a ``SplitLinear`` in place (parameters unchanged)."""
    for sub in module.modules():
        if type(sub) is nn.Linear:
            sub.__class__ = SplitLinear
    return module


# ------------------------------------------------------------------------------------------------
# Activation bytes
# ------------------------------------------------------------------------------------------------
class ActivationMeter:
    """Live bytes of saved activations on this rank, by (stage, mb, chunk); each storage counted once."""

    def __init__(self, params: Iterable[torch.Tensor]):
        self._params = {p.untyped_storage().data_ptr() for p in params}
        self._storages: dict[int, list[int]] = {}  # data_ptr -> [nbytes, references]
        self._owned: dict[Key, set[int]] = defaultdict(set)
        self.live = self.peak = 0

    def hold(self, key: Key, tensors: Iterable[torch.Tensor]) -> None:
        """Count ``tensors`` as held by ``key`` (until ``release(key)``)."""
        for t in tensors:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr in self._params or ptr in self._owned[key] or storage.nbytes() == 0:
                continue
            self._owned[key].add(ptr)
            entry = self._storages.setdefault(ptr, [storage.nbytes(), 0])
            if entry[1] == 0:
                self.live += entry[0]
            entry[1] += 1
        self.peak = max(self.peak, self.live)

    @contextlib.contextmanager
    def recording(self, key: Key):
        """Count every tensor autograd saves inside the block as held by ``key``."""
        def pack(t):
            self.hold(key, (t,))
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield

    def release(self, key: Key) -> None:
        for ptr in self._owned.pop(key, ()):
            entry = self._storages[ptr]
            entry[1] -= 1
            if entry[1] == 0:
                self.live -= entry[0]
                del self._storages[ptr]


# ------------------------------------------------------------------------------------------------
# The executor
# ------------------------------------------------------------------------------------------------
class PipelineExecutor:
    """Runs one rank's part of ``schedule`` on the stage modules this rank holds.

    Args:
        schedule: the schedule (all ranks pass the same one).
        rank: this rank's position in the pipeline (0..p-1).
        modules: ``{stage: module}`` for the stages ``schedule.stage_rank`` puts on this rank.
        loss_fn: ``loss_fn(output_of_last_stage, target) -> scalar``; each micro-batch's loss is divided
            by m, so the gradients are those of the mean loss over the batch.
        act_shape, dtype: shape and dtype of the activation between stages (one micro-batch).
        peers: global rank of each pipeline rank (default: pipeline rank = global rank).
        timeline: a ``toolkit.runtime.Timeline``; each action becomes a span (kind = op, "F&B" for FB).
        meter: count saved-activation bytes (``ActivationMeter``) and sample them after every action into
            ``memory`` as (seconds since the step started, live bytes).

    Extending it (``seq1f1b.Seq1F1BExecutor`` does): override ``recv_shape(msg)`` for messages of other
    shapes, ``_stage_fn(action)`` for what a forward computes (it includes the loss on the last stage), and
    ``handlers`` (op -> method) to add or wrap ops; ``_forward``, ``_backward`` and ``_hold`` are the
    pieces to wrap. These names are kept stable.
    """

    def __init__(self, schedule: Schedule, rank: int, modules: dict[int, nn.Module], loss_fn: Callable,
                 act_shape: tuple[int, ...], dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 peers: list[int] | None = None, group=None, timeline=None, meter: bool = False):
        if sorted(modules) != schedule.stages_of(rank):
            raise ValueError(f"rank {rank} got stages {sorted(modules)}, schedule puts {schedule.stages_of(rank)} here")
        self.schedule, self.rank, self.modules, self.loss_fn = schedule, rank, modules, loss_fn
        self.act_shape, self.dtype, self.device = tuple(act_shape), dtype, torch.device(device)
        self.peers = peers or list(range(schedule.p))
        self.group, self.timeline = group, timeline
        self.last = schedule.n_stages - 1
        self._split = {(x.stage, x.mb, x.chunk) for a in schedule.ranks[rank] for x in a.parts if x.op == "I"}
        if self._split:
            for module in modules.values():
                split_weight_grads(module)
        params = [p for module in modules.values() for p in module.parameters()]
        self.meter = ActivationMeter(params) if meter else None
        self.memory: list[tuple[float, int]] = []

    # -- messages ---------------------------------------------------------------------------------
    # A message is named by its receive (``Schedule.recvs``): RECV_F(s, mb, c) is stage s's input activation,
    # RECV_B(s, mb, c) the gradient of stage s's output. Local handoffs use the same names.
    def _tag(self, msg: Action) -> int:
        s = self.schedule
        return (((msg.op == "RECV_B") * s.n_stages + msg.stage) * s.m + msg.mb) * s.k + msg.chunk

    def recv_shape(self, msg: Action) -> tuple[int, ...]:
        """Shape of an incoming activation or gradient (override for sequence chunks of varying length)."""
        return self.act_shape

    def _source(self, msg: Action) -> int:
        return self.schedule.stage_rank[msg.stage - 1 if msg.op == "RECV_F" else msg.stage + 1]

    def _post_recvs(self, a: Action) -> None:
        for msg in (m for part in a.parts for m in self.schedule.recvs(part)):
            if msg not in self._inbox:
                buf = torch.empty(self.recv_shape(msg), dtype=self.dtype, device=self.device)
                work = dist.irecv(buf, self.peers[self._source(msg)], group=self.group, tag=self._tag(msg))
                self._inbox[msg] = (work, buf)

    def _wait_recvs(self, a: Action) -> None:
        """Block until the remote inputs of ``a`` have arrived (so the action's span is compute only)."""
        for msg in (m for part in a.parts for m in self.schedule.recvs(part)):
            work, buf = self._inbox[msg]
            if work is not None:
                work.wait()
                self._inbox[msg] = (None, buf)

    def _take(self, msg: Action) -> torch.Tensor:
        """The tensor named ``msg``, handed off locally or received."""
        if msg in self._local:
            return self._local.pop(msg)
        work, buf = self._inbox.pop(msg)
        if work is not None:
            work.wait()
        return buf

    def _give(self, msg: Action, tensor: torch.Tensor) -> None:
        """Deliver ``msg`` to the rank of its stage: a local handoff or an isend."""
        dst = self.schedule.stage_rank[msg.stage]
        if dst == self.rank:
            self._local[msg] = tensor
        else:
            tensor = tensor.contiguous()
            work = dist.isend(tensor, self.peers[dst], group=self.group, tag=self._tag(msg))
            self._outbox.append((work, tensor))

    # -- compute ----------------------------------------------------------------------------------
    def _stage_fn(self, a: Action) -> Callable[[torch.Tensor], torch.Tensor]:
        module = self.modules[a.stage]
        if a.stage != self.last:
            return module
        target, m = self._targets[a.mb], self.schedule.m
        return lambda x: self.loss_fn(module(x), target) / m

    def _forward(self, a: Action) -> None:
        key = (a.stage, a.mb, a.chunk)
        x = self._inputs[a.mb] if a.stage == 0 else self._take(Action("RECV_F", *key)).requires_grad_()
        fn = self._stage_fn(a)
        if key in self.schedule.recomputed:  # activations rebuilt later by an R action
            out = self._recompute.forward(key, fn, x)
            self._hold(key, [self._recompute.input_of(key)])
        elif key in self.schedule.checkpointed:  # recomputed inside the backward
            out = checkpoint(fn, x, use_reentrant=False)
            self._saved[key] = (x, out)
            self._hold(key, [x])
        else:
            with self.meter.recording(key) if self.meter else contextlib.nullcontext():
                out = fn(x)
            self._saved[key] = (x, out)
        if a.stage == self.last:
            self._losses.append(out.detach())
        else:
            self._give(Action("RECV_F", a.stage + 1, a.mb, a.chunk), out.detach())

    def _recompute_action(self, a: Action) -> None:
        key = (a.stage, a.mb, a.chunk)
        with self.meter.recording(key) if self.meter else contextlib.nullcontext():
            self._saved[key] = self._recompute.recompute(key)

    def _backward(self, a: Action) -> None:
        key = (a.stage, a.mb, a.chunk)
        x, out = self._saved.pop(key)
        grad = None if a.stage == self.last else self._take(Action("RECV_B", *key))
        WeightGradStore.enabled = a.op == "I"
        try:
            torch.autograd.backward(out, grad)
        finally:
            WeightGradStore.enabled = False
        if self.meter:
            self.meter.release(key)
        if a.op == "I":
            WeightGradStore.flush(key)
            self._hold(key, WeightGradStore.held(key))
        if a.stage > 0:
            self._give(Action("RECV_B", a.stage - 1, a.mb, a.chunk), x.grad)

    def _weight(self, a: Action) -> None:
        key = (a.stage, a.mb, a.chunk)
        WeightGradStore.pop(key)
        if self.meter:
            self.meter.release(key)

    def _hold(self, key: Key, tensors: list[torch.Tensor]) -> None:
        if self.meter:
            self.meter.hold(key, tensors)

    def run_action(self, a: Action) -> None:
        """Run one action (both halves of an FB). Subclasses add ops by extending ``handlers``."""
        for part in a.parts:
            WeightGradStore.split_forward = (part.stage, part.mb, part.chunk) in self._split
            try:
                self.handlers[part.op](self, part)
            finally:
                WeightGradStore.split_forward = False

    handlers: dict[str, Callable] = {"F": _forward, "B": _backward, "I": _backward, "W": _weight,
                                     "R": _recompute_action}

    # -- the step ---------------------------------------------------------------------------------
    def step(self, inputs: list[torch.Tensor], targets: list[torch.Tensor]) -> float | None:
        """One training step over the m micro-batches: accumulates gradients into ``.grad`` (not zeroed
        here). ``inputs[mb]`` are stage 0's inputs, ``targets[mb]`` the last stage's; a rank only reads
        the ones its stages use. Returns the mean loss on the rank holding the last stage, else None."""
        self._inputs, self._targets = inputs, targets
        self._saved: dict[Key, tuple[torch.Tensor, torch.Tensor]] = {}
        self._local: dict[Action, torch.Tensor] = {}
        self._inbox: dict[Action, tuple] = {}
        self._outbox: list[tuple] = []
        self._losses: list[torch.Tensor] = []
        self._recompute = RecomputeQueue()
        self.memory = []
        WeightGradStore.clear()
        acts = self.schedule.ranks[self.rank]
        step_start = time.perf_counter()
        for i, a in enumerate(acts):
            self._post_recvs(a)
            if i + 1 < len(acts):
                self._post_recvs(acts[i + 1])  # prefetch: the next action's inputs arrive while this one runs
            self._wait_recvs(a)
            start = time.perf_counter()
            self.run_action(a)
            if self.device.type == "cuda" and self.timeline is not None:
                torch.cuda.synchronize(self.device)  # spans measure the kernels, not their launch
            if self.timeline is not None:
                t0 = start - self.timeline.origin
                meta = {"stage": a.stage, "mb": a.mb, "chunk": a.chunk} if not a.sub else \
                    {"stage": f"{a.sub[0].stage}|{a.sub[1].stage}", "mb": f"{a.sub[0].mb}|{a.sub[1].mb}"}
                self.timeline.add("F&B" if a.op == "FB" else a.op, t0, self.timeline.now(), label=str(a), **meta)
            if self.meter:
                self.memory.append((time.perf_counter() - step_start, self.meter.live))
            self._outbox = [(w, t) for w, t in self._outbox if not _finished(w)]
        for work, _ in self._outbox:
            work.wait()
        leftovers = len(self._saved) + len(self._inbox) + len(self._local) + len(self._recompute)
        if leftovers or WeightGradStore._queue:
            raise RuntimeError(f"rank {self.rank}: step ended with {leftovers} unconsumed tensors and "
                               f"{len(WeightGradStore._queue)} pending W: the schedule is inconsistent")
        return float(sum(self._losses)) if self._losses else None


def _finished(work) -> bool:
    """True (and the send closed, so the ledger times it) if an isend has completed."""
    if work.is_completed():
        work.wait()
        return True
    return False


# ------------------------------------------------------------------------------------------------
# The tiny GPT as a pipeline (used by the lessons, tests and benchmark)
# ------------------------------------------------------------------------------------------------
def gpt_micro_batches(m: int, micro_batch: int, seq_len: int, seed: int = 0
                      ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """m micro-batches of real tokens (``toolkit.data``): inputs and next-token targets, each [b, T]."""
    from toolkit.data import batches
    x, y = next(batches(m * micro_batch, seq_len, 1, seed=seed))
    return list(x.split(micro_batch)), list(y.split(micro_batch))


def gpt_stages(model: nn.Module, schedule: Schedule, rank: int) -> dict[int, nn.Module]:
    """Cut ``model`` into ``schedule.n_stages`` stages and return this rank's (sharing parameters)."""
    from toolkit.models import split_stages
    stages = split_stages(model, schedule.n_stages)
    return {s: stages[s] for s in schedule.stages_of(rank)}


def reference_step(model: nn.Module, inputs: list[torch.Tensor], targets: list[torch.Tensor]) -> float:
    """The single-process reference: micro-batches in order, mean loss, gradients accumulated."""
    from toolkit.models import lm_loss
    total = 0.0
    for x, y in zip(inputs, targets):
        loss = lm_loss(model(x), y) / len(inputs)
        loss.backward()
        total += loss.item()
    return total


def grad_diff(model: nn.Module, reference: nn.Module, modules: Iterable[nn.Module]) -> float:
    """Largest |grad - reference grad| over the parameters of ``modules`` (one rank's stages)."""
    mine = {id(p) for module in modules for p in module.parameters()}
    ref = dict(reference.named_parameters())
    worst = 0.0
    for name, p in model.named_parameters():
        if id(p) in mine:
            if p.grad is None:
                raise RuntimeError(f"{name} has no gradient after the pipeline step")
            worst = max(worst, (p.grad.cpu() - ref[name].grad.cpu()).abs().max().item())
    return worst


def selfcheck(ctx, cfg: dict) -> dict:
    """Per rank: run each schedule of ``cfg["schedules"]`` (names of ``make_schedule``, or ``"torch:NAME"``
    for torch's order run by this executor, or ``"torch-impl:NAME"`` for torch's own implementation) once on
    the tiny GPT and compare with the single-process reference.

    ``launch("toolkit.pipeline.executor:selfcheck", 2, {"schedules": ["1f1b", "dualpipev"], "m": 4})``
    returns per rank ``{name: {"loss", "ref_loss", "grad_diff", "peak_act_bytes"}}``.
    """
    import copy

    from toolkit.models import GPT, lm_loss, preset

    from .schedule import from_torch, make_schedule
    from .torch_compare import TorchPipeline

    p, m, b = ctx.world_size, cfg.get("m", 2 * ctx.world_size), cfg.get("micro_batch", 2)
    model_cfg = preset(cfg.get("model", "smoke"), n_layer=cfg.get("n_layer", 2 * p))
    inputs, targets = gpt_micro_batches(m, b, model_cfg.seq_len, seed=cfg.get("seed", 0))
    torch.manual_seed(cfg.get("seed", 0))
    base = GPT(model_cfg)
    reference = copy.deepcopy(base)
    ref_loss = reference_step(reference, inputs, targets)
    out = {}
    for name in cfg["schedules"]:
        kind, _, plain = name.rpartition(":")
        schedule = from_torch(plain, p, m) if kind else make_schedule(plain, p, m)
        model = copy.deepcopy(base)
        modules = gpt_stages(model, schedule, ctx.rank)
        peak = None
        if kind == "torch-impl":
            loss = TorchPipeline(plain, modules, schedule.n_stages, m, lm_loss).step(inputs, targets)
        else:
            executor = PipelineExecutor(schedule, ctx.rank, modules, lm_loss, (b, model_cfg.seq_len, model_cfg.d_model),
                                        timeline=ctx.timeline, meter=True)
            loss = executor.step(inputs, targets)
            peak = executor.meter.peak
        out[name] = {"loss": loss, "ref_loss": ref_loss, "grad_diff": grad_diff(model, reference, modules.values()),
                     "peak_act_bytes": peak}
    return out


def measure_schedules(ctx, jobs: dict[str, tuple[Schedule, str]], base: nn.Module, inputs: list[torch.Tensor],
                      targets: list[torch.Tensor], reference: nn.Module, *, warmup: int = 1, steps: int = 3,
                      rounds: int = 3, trim: int = 1) -> tuple[dict[str, dict], dict[str, nn.Module]]:
    """Run and time several schedules on fresh copies of ``base`` (on every rank, collectively).

    ``jobs`` maps a name to (schedule, impl); impl ``"ours"`` is ``PipelineExecutor``, ``"torch"`` torch's own
    implementation of the schedule (``TorchPipeline``; no spans, no bytes). For each job, one checked step:
    loss, largest gradient difference from ``reference`` (already stepped on the same micro-batches) and the
    saved-activation bytes over the step. Then the timing, *round-robin*: every round runs ``steps`` steps of
    each job in turn (the order rotating), so all jobs see the same machine load; ``warmup`` untimed steps
    first. Returns (numbers per job, the checked model per job).

    Numbers: ``loss``, ``grad_diff``, ``peak_act_bytes``, ``act_bytes`` ([seconds into the step, live bytes]
    per action), ``bench`` (``toolkit.runtime.bench.BenchResult`` fields: trimmed mean of round means...),
    ``spans`` (the last timed step, absolute times aligned across ranks) and ``op_seconds`` ({"F@3": median
    seconds over the timed steps, ...}; F&B keys are "F&B@sf|sb").
    """
    import copy
    import statistics

    from toolkit.models import lm_loss
    from toolkit.runtime.bench import BenchResult
    from toolkit.runtime.timeline import Timeline

    from .torch_compare import TorchPipeline

    inputs, targets = [x.to(ctx.device) for x in inputs], [y.to(ctx.device) for y in targets]

    def fresh(schedule: Schedule, impl: str) -> tuple[nn.Module, Callable[[], object], PipelineExecutor | None]:
        model = copy.deepcopy(base).to(ctx.device)
        modules = gpt_stages(model, schedule, ctx.rank)
        if impl == "torch":
            runner = TorchPipeline(schedule.name, modules, schedule.n_stages, schedule.m, lm_loss, ctx.device)
            return model, lambda: runner.step(inputs, targets), None
        executor = PipelineExecutor(schedule, ctx.rank, modules, lm_loss, (*inputs[0].shape, base.cfg.d_model),
                                    device=ctx.device)
        return model, lambda: executor.step(inputs, targets), executor

    out, checked, timed = {}, {}, {}
    for name, (schedule, impl) in jobs.items():
        model, run_step, executor = fresh(schedule, impl)
        if executor is not None:
            executor.meter = ActivationMeter(model.parameters())
        loss = run_step()
        out[name] = {"name": schedule.name, "impl": impl, "loss": loss,
                     "grad_diff": grad_diff(model, reference, gpt_stages(model, schedule, ctx.rank).values()),
                     "peak_act_bytes": executor.meter.peak if executor else None,
                     "act_bytes": [list(x) for x in executor.memory] if executor else []}
        checked[name] = model
        model, run_step, executor = fresh(schedule, impl)
        if executor is not None:
            executor.timeline = Timeline(ctx.rank)
            executor.timeline.origin = ctx.timeline.origin  # aligned across ranks by the launch barrier
        timed[name] = (model, run_step, executor, [], [])  # ..., step times, step start marks

    names = list(jobs)
    for rnd in range(-1, rounds):  # round -1: the warm-up
        ctx.progress(rnd + 1, rounds, "timing " + ", ".join(names))
        for name in names[rnd % len(names):] + names[:rnd % len(names)]:
            model, run_step, _, times, marks = timed[name]
            ctx.barrier()
            for _ in range(warmup if rnd < 0 else steps):
                model.zero_grad(set_to_none=True)
                marks.append(ctx.timeline.now())
                start = time.perf_counter()
                run_step()
                if rnd >= 0:
                    times.append(time.perf_counter() - start)
    ctx.barrier()
    for name, (_, _, executor, times, marks) in timed.items():
        means = [statistics.fmean(times[i * steps:(i + 1) * steps]) for i in range(rounds)]
        kept = sorted(means)[trim:rounds - trim] if rounds > 2 * trim else means
        std = statistics.pstdev(times)
        out[name]["bench"] = BenchResult(statistics.fmean(kept), statistics.median(times), std,
                                         std / statistics.fmean(times), means, times).to_dict()
        if executor is not None:
            spans = executor.timeline.to_json()
            by_key: dict[str, list[float]] = defaultdict(list)
            for s in spans[warmup * len(executor.schedule.ranks[ctx.rank]):]:  # the timed steps
                by_key[f"{s['kind']}@{s['meta']['stage']}"].append(s["end"] - s["start"])
            out[name]["op_seconds"] = {k: statistics.median(v) for k, v in by_key.items()}
            out[name]["spans"] = [s for s in spans if s["start"] >= marks[-1]]
    return out, checked
