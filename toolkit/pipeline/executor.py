"""Run any ``Schedule`` for real: one process per rank, point-to-point send/recv between stages.

Each rank walks its own action list. Before an action runs, the receives it (and the next action) need
are posted as ``irecv``; outputs leave by ``isend`` right after they are computed, so transfers overlap
the following compute. Every message has its own tag, derived from (kind, stage, micro-batch, chunk),
so the order in which ranks post them cannot mismatch them::

    rank r, op a = F(s, mb)                               rank r, op a = B(s, mb)  (or I)
    ──────────────────────────                            ───────────────────────────
    x  = tokens[mb]            if s == 0                  g  = wait irecv(grad of s)    if s < last
       = wait irecv(act of s)  if stage s-1 elsewhere        = 1 (d loss)               if s == last
       = local handoff         if stage s-1 here          backward(out, g)  ──► x.grad
    out = stage_s(x)   (+ loss / m on the last stage)     isend(x.grad) to stage s-1's rank (or hand off)
    isend(out) to stage s+1's rank (or hand off)          I: weight grads queued in the WeightGradStore
    keep (x, out) for the backward                        W: pop and run them (zero-bubble split)
    R  = rebuild a checkpointed forward's activations (the ``Recompute`` hook, recompute.py)

F&B (an ``FB`` action: DualPipe's F of one micro-batch with the B of another) is overlapped: each half
waits for its own input only when it starts, and the first half's output leaves (``isend``) before the
second half computes. So while one half computes, the other half's communication is in flight — on gloo
the transfers run on gloo's own threads; with nccl they run on NCCL's streams and ``wait()`` only orders
the compute stream after them, without blocking the host. ``fb_overlap=False`` runs a pair the way torch's
``OVERLAP_F_B`` does (both inputs awaited before the pair, then the halves back to back)::

    fb_overlap=True    wait(x_F) ─ F ─ isend(out_F) ─ wait(g_B) ─ B ─ isend(dx_B)
                                   └── g_B arriving ──┘└── out_F leaving ──┘
    fb_overlap=False   wait(x_F) wait(g_B) ─ F ─ isend(out_F) ─ B ─ isend(dx_B)

Extending it: a list of hooks
-----------------------------
An extension is an ``ExecutorHook``: an object with the methods below, each a no-op on the base class, so
a hook overrides only the points it needs. The executor takes a list of them and composing extensions is
writing that list, ``PipelineExecutor(..., hooks=[VocabPasses(stage, groups), Offload(offloader)])``.
``ops()`` adds ops by name (``Recompute``: R; ``VocabPasses``: S and T; "FB": a hook that runs every F&B
pair itself, ``EPOverlap`` in ``toolkit.pipeline.ep_overlap``); an op that neither the executor (F, B, I, W)
nor a hook runs raises when the executor is built, instead of being skipped. The points, in
the order a step meets them::

    step(inputs, targets)
     ├ step_begin(inputs, targets)
     ├ for each action of this rank (F, B, I, W, a hook's op, or FB = its two halves in order):
     │    post irecvs of this action and the next (a message's shape: recv_shape(msg, shape))
     │    for each single op a (each half of an FB):
     │       wait for a's inputs                                  (before the pair if fb_overlap=False)
     │       with op_context(a):                                  every single op, around all of it
     │        F      with forward_context(a): stage_fn(a, fn)(x) ─ isend / hand off the output
     │        B, I   before_backward(a) ─ autograd backward ─ after_backward(a) ─ isend / hand off dX
     │        W      run the dW queued by a's I
     │        other  the hook's op (ops()); Recompute's R enters forward_context(a) too
     │       after_op(a)                                          every single op, F&B halves too
     │    after_action(action)                                    once per scheduled action
     ├ wait for the sends still in flight; check that nothing is left over
     └ step_end(loss) -> loss                  (step_failed() instead when the step raised)

Order, fixed: the first hook of the list is the outermost, as in nested ``with`` blocks. Going in
(``step_begin``, entering ``op_context`` and ``forward_context``, ``before_backward``) the hooks run in list
order; coming out (leaving ``forward_context`` and ``op_context``, ``after_backward``, ``after_op``,
``after_action``, ``step_end``, ``step_failed``) in reverse list order. ``stage_fn(a, fn)`` and ``recv_shape(msg, shape)`` are chained the
same way: a hook receives what the hooks after it made of the executor's own, and the first hook's result
is used. ``bind(executor)`` runs once, when the executor is built; a hook reads the executor's state from it
(``schedule``, ``rank``, ``modules``, ``meter``, ``saved``; ``inputs`` and ``targets`` during a step) and
calls its helpers (``hold``, ``recording``, ``forward_context``).

The toolkit's extensions are hooks: ``Recompute`` (recompute.py: checkpointed forwards and the R op),
``SequenceChunks`` (seq1f1b.py), ``VocabPasses`` (vocab_passes.py), ``DataParallelSeparation``
(dp_separate.py), ``EPOverlap`` (ep_overlap.py: an F&B pair's expert all-to-alls under each other's
compute), ``Offload`` (toolkit.memory.offload) and ``GraphReplay`` (toolkit.graphs.cuda_graphs).

Deferred weight gradients (``WeightGradStore``, as in DeepSeek's DualPipe): ``split_weight_grads``
swaps each ``nn.Linear`` for a ``SplitLinear``. A forward whose backward will be an I runs inside
``store.splitting()`` (the executor sets it per op), so its Linears build a node whose backward computes dX
at once and, while the store is ``deferring()``, queues a closure for dW = g^T x (and db) in *that* store
instead of computing it. Each executor owns its store; LayerNorm and embedding gradients are computed in
the I itself. The store is keyed by (stage, mb, chunk), so a W runs exactly its own I's work.

``ActivationMeter`` counts what the activations really cost: every tensor autograd saves during a
forward (``saved_tensors_hooks``), parameters excluded, each storage once (views share one), released
when the backward (or the W) that needs it is done.

The set-up the lessons share (the tiny GPT as a pipeline, micro-batches, the single-process reference,
checked and timed runs of several schedules) is in ``harness.py``.
"""
from __future__ import annotations

import contextlib
import contextvars
import time
from collections import defaultdict
from typing import Callable, ContextManager, Iterable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from .schedule import Action, Key, Schedule


def key_of(a: Action) -> Key:
    """(stage, micro-batch, chunk) of a single op."""
    return (a.stage, a.mb, a.chunk)


# ------------------------------------------------------------------------------------------------
# Deferred weight gradients
# ------------------------------------------------------------------------------------------------
_SPLITTING: contextvars.ContextVar["WeightGradStore | None"] = contextvars.ContextVar("splitting", default=None)


class WeightGradStore:
    """dW closures queued by ``SplitLinear`` backwards, one store per executor.

    ``splitting()`` is entered around the forwards whose backward will be an I: only those build the custom
    autograd node (bound to this store); every other forward runs the plain ``F.linear`` (no Python in its
    backward). ``deferring()`` is entered around an I's backward: the nodes of this store then queue their dW
    instead of computing it; ``flush(key)`` files what was queued under the I's key and ``pop(key)`` (the W)
    runs it.
    """

    def __init__(self):
        self.enabled = False  # backwards queue their dW (inside ``deferring()``)
        self._cache: list[tuple[Callable[[], None], tuple[torch.Tensor, ...]]] = []
        self._queue: dict[Key, list[tuple[Callable[[], None], tuple[torch.Tensor, ...]]]] = {}
        self.grad_ready: Callable[[torch.Tensor], None] | None = None
        """Called with each parameter right after a dW closure wrote its gradient (autograd's own accumulations
        fire ``register_post_accumulate_grad_hook`` instead); ``DataParallelSeparation`` issues buckets from it."""

    @contextlib.contextmanager
    def splitting(self):
        """Forwards inside build split nodes bound to this store (their backward can defer dW)."""
        token = _SPLITTING.set(self)
        try:
            yield self
        finally:
            _SPLITTING.reset(token)

    @contextlib.contextmanager
    def deferring(self):
        """Backwards of this store's split nodes inside queue their dW instead of computing it."""
        self.enabled = True
        try:
            yield self
        finally:
            self.enabled = False

    def put(self, fn: Callable[[], None], tensors: tuple[torch.Tensor, ...]) -> None:
        self._cache.append((fn, tensors))

    def flush(self, key: Key) -> None:
        """File the closures queued since the last flush under ``key`` (call after an I)."""
        self._queue[key], self._cache = self._cache, []

    def held(self, key: Key) -> list[torch.Tensor]:
        """The tensors the deferred dW of ``key`` keeps alive (inputs and output gradients of Linears)."""
        return [t for _, tensors in self._queue.get(key, []) for t in tensors]

    def pop(self, key: Key) -> None:
        """Run the deferred dW of ``key`` (a W action)."""
        for fn, _ in self._queue.pop(key):
            fn()

    @property
    def pending(self) -> int:
        """How many I have a W still to run."""
        return len(self._queue)

    def clear(self) -> None:
        self.enabled, self._cache, self._queue = False, [], {}


class _SplitLinearFn(torch.autograd.Function):
    """y = x W^T + b whose backward returns dX only; dW and db go to the parameters' ``.grad`` now, or
    later from its ``WeightGradStore`` while that store is deferring (DualPipe's ``LinearFunc``)."""

    @staticmethod
    def forward(ctx, x, weight, bias, store):  # x [..., in] -> [..., out]
        ctx.save_for_backward(x)
        ctx.weight, ctx.bias, ctx.store = weight, bias, store  # the parameters themselves (saved tensors may alias)
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
                    if ctx.store.grad_ready is not None:
                        ctx.store.grad_ready(param)

        if ctx.store.enabled:
            ctx.store.put(weight_grad, (grad, x))
        else:
            weight_grad()
        return grad @ weight, None, None, None  # dX [..., in]


class SplitLinear(nn.Linear):
    """``nn.Linear`` whose weight gradient can be deferred to a W action (see ``WeightGradStore``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        store = _SPLITTING.get()
        if store is not None:
            return _SplitLinearFn.apply(x, self.weight, self.bias, store)
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
# Hooks
# ------------------------------------------------------------------------------------------------
class ExecutorHook:
    """One extension of ``PipelineExecutor``; every method is a no-op here (module docstring: where each
    runs, and in which order when there are several hooks)."""

    def bind(self, executor: "PipelineExecutor") -> None:
        """Called once, when ``executor`` is built with this hook."""
        self.executor = executor

    def ops(self) -> dict[str, Callable[[Action], None]]:
        """The ops this hook runs, ``{op: function(action)}`` (e.g. ``{"R": self.recompute}``; "FB": every F&B
        pair, both halves, through the executor's ``wait_inputs``, ``forward_input`` / ``forward_output``,
        ``backward_input`` / ``backward_output``)."""
        return {}

    def recv_shape(self, msg: Action, shape: tuple[int, ...]) -> tuple[int, ...]:
        """Shape of the incoming activation or gradient ``msg`` (``shape``: what the executor would use)."""
        return shape

    def stage_fn(self, a: Action, fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
        """What the forward ``a`` computes, given what it would compute otherwise (``fn``)."""
        return fn

    def step_begin(self, inputs: list[torch.Tensor], targets: list[torch.Tensor]) -> None:
        """Before the first action of a step."""

    def op_context(self, a: Action) -> ContextManager:
        """Entered around every single op (F, B, I, W, a hook's op; each half of an F&B), its sends included."""
        return contextlib.nullcontext()

    def forward_context(self, a: Action) -> ContextManager:
        """Entered around the compute of every F (and of Recompute's R; ``a.op`` tells which)."""
        return contextlib.nullcontext()

    def before_backward(self, a: Action) -> None:
        """Before the autograd backward of every B and I."""

    def after_backward(self, a: Action) -> None:
        """After the autograd backward of every B and I (before its input gradient is sent)."""

    def after_op(self, a: Action) -> None:
        """After every single op: F, B, I, W, a hook's op, and each half of an F&B."""

    def after_action(self, action: Action) -> None:
        """After every scheduled action (once for an F&B, after both halves)."""

    def step_end(self, loss: float | None) -> float | None:
        """After the last send of a step completed; returns the step's loss (``loss``: the executor's)."""
        return loss

    def step_failed(self) -> None:
        """The step raised: release what ``step_begin`` started, without waiting for other ranks."""


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
            by m, so the gradients are those of the mean loss over the batch (None when a hook's
            ``stage_fn`` computes the loss).
        act_shape, dtype: shape and dtype of the activation between stages (one micro-batch).
        peers: global rank of each pipeline rank (default: pipeline rank = global rank).
        timeline: a ``toolkit.runtime.Timeline``; each single op becomes a span (kind = op; the halves of
            an F&B carry ``pair="F&B"`` in their meta).
        meter: count saved-activation bytes (``ActivationMeter``) and sample them after every action into
            ``memory`` as (seconds since the step started, live bytes).
        fb_overlap: overlap the halves of an F&B with each other's communication (module docstring).
        trace: keep ``trace``, the order of this rank's posts, waits, ops and sends in the last step
            (``[("post" | "wait" | "op" | "send", "3F1"), ...]``; messages are named by their receive).
        hooks: the extensions, ``ExecutorHook`` objects, in the order the module docstring describes.

    After a step, ``waits`` lists the receives this rank waited for (``{"msg", "stage", "mb", "chunk",
    "seconds", "pair"}``: seconds blocked, ``pair`` whether the receive feeds a half of an F&B; plus ``"start"``
    on the timeline's clock when there is a timeline): the exposed communication. Hooks may add theirs.
    """

    def __init__(self, schedule: Schedule, rank: int, modules: dict[int, nn.Module], loss_fn: Callable | None,
                 act_shape: tuple[int, ...], dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 peers: list[int] | None = None, group=None, timeline=None, meter: bool = False,
                 fb_overlap: bool = True, trace: bool = False, hooks: Sequence[ExecutorHook] = ()):
        if sorted(modules) != schedule.stages_of(rank):
            raise ValueError(f"rank {rank} got stages {sorted(modules)}, schedule puts {schedule.stages_of(rank)} here")
        self.schedule, self.rank, self.modules, self.loss_fn = schedule, rank, modules, loss_fn
        self.act_shape, self.dtype, self.device = tuple(act_shape), dtype, torch.device(device)
        self.peers = peers or list(range(schedule.p))
        self.group, self.timeline, self.fb_overlap = group, timeline, fb_overlap
        self.last = schedule.n_stages - 1
        self.hooks = list(hooks)
        self.ops: dict[str, Callable[[Action], None]] = {"F": self.forward, "B": self.backward, "I": self.backward,
                                                         "W": self.weight}
        for hook in self.hooks:
            for op, fn in hook.ops().items():
                if op in self.ops:
                    raise ValueError(f"{type(hook).__name__} runs op {op!r}, which is already run "
                                     f"({self.ops[op].__qualname__})")
                self.ops[op] = fn
        if schedule.checkpointed and "R" not in self.ops:
            raise ValueError(f"schedule {schedule.name!r} checkpoints forwards: pass hooks=[Recompute()] "
                             "(toolkit.pipeline.recompute), which checkpoints them and rebuilds their activations")
        unknown = sorted({part.op for a in schedule.ranks[rank] for part in a.parts} - set(self.ops))
        if unknown:
            raise ValueError(f"nothing runs ops {unknown} of schedule {schedule.name!r}: the executor runs F, B, I "
                             f"and W, the hooks {[type(h).__name__ for h in self.hooks]} run "
                             f"{sorted(set(self.ops) - set('FBIW'))}")
        self.weight_grads = WeightGradStore()
        self._split = {key_of(x) for a in schedule.ranks[rank] for x in a.parts if x.op == "I"}
        if self._split:
            for module in modules.values():
                split_weight_grads(module)
        params = [p for module in modules.values() for p in module.parameters()]
        self.meter = ActivationMeter(params) if meter else None
        self.memory: list[tuple[float, int]] = []
        self.waits: list[dict] = []
        self.trace: list[tuple[str, str]] | None = [] if trace else None
        for hook in self.hooks:
            hook.bind(self)

    # -- what hooks call ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def forward_context(self, a: Action):
        """Every hook's ``forward_context(a)``, the first hook's outermost."""
        with contextlib.ExitStack() as stack:
            for hook in self.hooks:
                stack.enter_context(hook.forward_context(a))
            yield

    def hold(self, key: Key, tensors: list[torch.Tensor]) -> None:
        """Count ``tensors`` as activations held by ``key`` (when the meter is on)."""
        if self.meter:
            self.meter.hold(key, tensors)

    def recording(self, key: Key) -> ContextManager:
        """Count every tensor autograd saves inside the block as held by ``key`` (when the meter is on)."""
        return self.meter.recording(key) if self.meter else contextlib.nullcontext()

    # -- messages ---------------------------------------------------------------------------------
    # A message is named by its receive (``Schedule.recvs``): RECV_F(s, mb, c) is stage s's input activation,
    # RECV_B(s, mb, c) the gradient of stage s's output. Local handoffs use the same names.
    def _tag(self, msg: Action) -> int:
        s = self.schedule
        return (((msg.op == "RECV_B") * s.n_stages + msg.stage) * s.m + msg.mb) * s.k + msg.chunk

    def recv_shape(self, msg: Action) -> tuple[int, ...]:
        """Shape of an incoming activation or gradient: ``act_shape``, unless a hook says otherwise."""
        shape = self.act_shape
        for hook in reversed(self.hooks):
            shape = hook.recv_shape(msg, shape)
        return shape

    def _source(self, msg: Action) -> int:
        return self.schedule.stage_rank[msg.stage - 1 if msg.op == "RECV_F" else msg.stage + 1]

    def _log(self, what: str, x: Action) -> None:
        if self.trace is not None:
            self.trace.append((what, str(x)))

    def _post_recvs(self, action: Action) -> None:
        for msg in (m for part in action.parts for m in self.schedule.recvs(part)):
            if msg not in self._inbox:
                buf = torch.empty(self.recv_shape(msg), dtype=self.dtype, device=self.device)
                work = dist.irecv(buf, self.peers[self._source(msg)], group=self.group, tag=self._tag(msg))
                self._inbox[msg] = (work, buf)
                self._log("post", msg)

    def wait_inputs(self, a: Action) -> None:
        """Block until the remote inputs of single op ``a`` have arrived (so its span is compute only)."""
        for msg in self.schedule.recvs(a):
            work, buf = self._inbox[msg]
            if work is not None:
                start, vstart = time.perf_counter(), self._vnow()
                work.wait()
                end = time.perf_counter()
                self._inbox[msg] = (None, buf)
                self._log("wait", msg)
                wait = {"msg": msg.op, "stage": msg.stage, "mb": msg.mb, "chunk": msg.chunk, "seconds": end - start,
                        "pair": self._pair is not None}
                if self.timeline is not None:
                    wait["start"] = start - self.timeline.origin
                if vstart is not None:  # on the emulated cluster's clock: the wait, and its part with bytes in flight
                    wait["vseconds"] = self._vnow() - vstart
                    wait["vwire_s"] = getattr(work, "exposed", (0.0, 0.0))[1]
                self.waits.append(wait)

    def _vnow(self) -> float | None:
        return self.timeline.vnow() if self.timeline is not None else None

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
            self._log("send", msg)

    # -- the ops ----------------------------------------------------------------------------------
    def stage_fn(self, a: Action) -> Callable[[torch.Tensor], torch.Tensor]:
        """What the forward of ``a`` computes: the stage module, plus loss / m on the last stage, as the
        hooks' ``stage_fn`` change it."""
        module = self.modules[a.stage]
        if a.stage != self.last:
            fn = module
        else:
            target, m = self.targets[a.mb], self.schedule.m
            fn = lambda x: self.loss_fn(module(x), target) / m  # noqa: E731
        for hook in reversed(self.hooks):
            fn = hook.stage_fn(a, fn)
        return fn

    def forward(self, a: Action) -> None:
        """F: the stage's forward on its input; the output goes to the next stage (or the loss is kept)."""
        x = self.forward_input(a)
        fn = self.stage_fn(a)
        with self.forward_context(a), self.recording(key_of(a)):
            out = fn(x)
        self.forward_output(a, x, out)

    def forward_input(self, a: Action) -> torch.Tensor:
        """The input of forward ``a``: its tokens on stage 0, else the activation received (or handed off)."""
        return self.inputs[a.mb] if a.stage == 0 else self._take(Action("RECV_F", *key_of(a))).requires_grad_()

    def forward_output(self, a: Action, x: torch.Tensor, out: torch.Tensor) -> None:
        """Keep (input, output) of forward ``a`` for its backward; send the output on (or keep the loss)."""
        self.saved[key_of(a)] = (x, out)
        if a.stage == self.last:
            self._losses.append(out.detach())
        else:
            self._give(Action("RECV_F", a.stage + 1, a.mb, a.chunk), out.detach())

    def backward(self, a: Action) -> None:
        """B (dX and dW) or I (dX now, dW queued for its W); the input gradient goes to the previous stage."""
        x, out, grad = self.backward_input(a)
        for hook in self.hooks:
            hook.before_backward(a)
        with self.weight_grads.deferring() if a.op == "I" else contextlib.nullcontext():
            torch.autograd.backward(out, grad)
        for hook in reversed(self.hooks):
            hook.after_backward(a)
        self.backward_output(a, x)

    def backward_input(self, a: Action) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(input, output) its forward kept and the gradient of that output (None on the last stage: the loss)."""
        key = key_of(a)
        x, out = self.saved.pop(key)
        return x, out, None if a.stage == self.last else self._take(Action("RECV_B", *key))

    def backward_output(self, a: Action, x: torch.Tensor) -> None:
        """After backward ``a``: release its activations, file an I's deferred dW, send dX on (``x.grad``)."""
        key = key_of(a)
        if self.meter:
            self.meter.release(key)
        if a.op == "I":
            self.weight_grads.flush(key)
            self.hold(key, self.weight_grads.held(key))
        if a.stage > 0:
            self._give(Action("RECV_B", a.stage - 1, a.mb, a.chunk), x.grad)

    def weight(self, a: Action) -> None:
        """W: the weight gradients an earlier I deferred."""
        key = key_of(a)
        self.weight_grads.pop(key)
        if self.meter:
            self.meter.release(key)

    # -- running actions --------------------------------------------------------------------------
    def splitting(self, a: Action) -> ContextManager:
        """What single op ``a`` runs inside: ``weight_grads.splitting()`` when it is the forward (or the I) of a
        micro-batch whose backward is split into I and W, nothing otherwise."""
        return self.weight_grads.splitting() if key_of(a) in self._split else contextlib.nullcontext()

    def run_op(self, a: Action) -> None:
        """Run single op ``a`` (its inputs have arrived) and record its span."""
        start, vstart = time.perf_counter(), self._vnow()
        with contextlib.ExitStack() as around:
            for hook in self.hooks:
                around.enter_context(hook.op_context(a))
            around.enter_context(self.splitting(a))
            self.ops[a.op](a)
        self._log("op", a)
        if self.timeline is not None:
            if self.device.type == "cuda":  # spans measure the kernels, not their launch; the compute stream
                torch.cuda.current_stream(self.device).synchronize()  # only: NCCL's transfers stay in flight
            meta = {"stage": a.stage, "mb": a.mb, "chunk": a.chunk}
            if self._pair is not None:
                meta["pair"] = "F&B"
                meta["with"] = str(self._pair)
            self.timeline.add(a.op, start - self.timeline.origin, self.timeline.now(), vstart=vstart,
                              vend=self._vnow(), label=str(a), **meta)

    def run_action(self, action: Action) -> None:
        """Run one scheduled action: a single op, or both halves of an F&B (module docstring); a hook whose
        ``ops()`` names "FB" runs every F&B itself."""
        self._pair = action if action.sub else None
        if action.sub and "FB" in self.ops:
            self.ops["FB"](action)
        else:
            if not self.fb_overlap:
                for a in action.parts:
                    self.wait_inputs(a)
            for a in action.parts:
                self.wait_inputs(a)  # F&B, overlapped: the second half's input arrived while the first computed
                self.run_op(a)
                for hook in reversed(self.hooks):
                    hook.after_op(a)
        self._pair = None
        for hook in reversed(self.hooks):
            hook.after_action(action)

    # -- the step ---------------------------------------------------------------------------------
    def step(self, inputs: list[torch.Tensor], targets: list[torch.Tensor]) -> float | None:
        """One training step over the m micro-batches: accumulates gradients into ``.grad`` (not zeroed
        here). ``inputs[mb]`` are stage 0's inputs, ``targets[mb]`` the last stage's; a rank only reads
        the ones its stages use. Returns the mean loss on the rank holding the last stage, else None
        (a hook's ``step_end`` may return another)."""
        self.inputs, self.targets = inputs, targets
        self.saved: dict[Key, tuple[torch.Tensor, torch.Tensor]] = {}  # (input, output) of each F until its B
        self._local: dict[Action, torch.Tensor] = {}
        self._inbox: dict[Action, tuple] = {}
        self._outbox: list[tuple] = []
        self._losses: list[torch.Tensor] = []
        self._pair: Action | None = None
        self.memory, self.waits = [], []
        if self.trace is not None:
            self.trace = []
        self.weight_grads.clear()
        for hook in self.hooks:
            hook.step_begin(inputs, targets)
        try:
            self._run_actions()
        except BaseException:
            for hook in reversed(self.hooks):
                hook.step_failed()
            raise
        loss = float(sum(self._losses)) if self._losses else None
        for hook in reversed(self.hooks):
            loss = hook.step_end(loss)
        return loss

    def _run_actions(self) -> None:
        acts = self.schedule.ranks[self.rank]
        step_start = time.perf_counter()
        for i, action in enumerate(acts):
            self._post_recvs(action)
            if i + 1 < len(acts):
                self._post_recvs(acts[i + 1])  # prefetch: the next action's inputs arrive while this one runs
            self.run_action(action)
            if self.meter:
                self.memory.append((time.perf_counter() - step_start, self.meter.live))
            self._outbox = [(w, t) for w, t in self._outbox if not completed(w)]
        for work, _ in self._outbox:
            work.wait()
        leftovers = len(self.saved) + len(self._inbox) + len(self._local)
        if leftovers or self.weight_grads.pending:
            raise RuntimeError(f"rank {self.rank}: step ended with {leftovers} unconsumed tensors and "
                               f"{self.weight_grads.pending} pending W: the schedule is inconsistent")


def completed(work) -> bool:
    """True (and the send closed, so the ledger times it) if an async op has completed."""
    if work.is_completed():
        work.wait()
        return True
    return False
