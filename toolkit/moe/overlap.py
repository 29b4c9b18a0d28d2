"""MoE all-to-all overlap across two micro-batches: one micro-batch's dispatch/combine flies while the other computes.

Expert parallelism puts two all-to-alls in every MoE layer (dispatch before the experts, combine after). Run
one micro-batch at a time and the rank waits for each of them. Split the batch in two (A, B) and interleave::

    serial (A, then B)     compute  attn A ·········· experts A ········· attn A' ···    (· = waiting)
                           network         dispatch A           combine A
    overlapped             compute  attn A  attn B  experts A  experts B  attn A'  attn B'  ...
                           network         disp A  disp B     comb A    comb B
                                    attention of B while A dispatches, experts of A while B dispatches,
                                    experts of B while A's combine runs, the next layer's attention of A
                                    while B's combine runs; each async handle is waited on just before use

Each micro-batch's forward is a Python generator that yields every all-to-all it issues (a
:class:`~toolkit.moe.dispatcher.Pending`) and gets the result back when it is sent in. :func:`run_serial`
waits on each at once; :func:`run_interleaved` switches to the other micro-batch first. The ops of each
micro-batch are the same in both, so outputs are equal bit for bit.

The backward needs no schedule of its own: autograd's engine runs the ready node created last first, so one
``backward`` over both losses replays the interleaving in reverse, and the dispatcher issues each backward
all-to-all in one node and waits in the next (``_Wait.backward`` / ``_Start.backward``), so the other
micro-batch's backward runs in between.

Price: both micro-batches' activations are alive at once (FWD-FWD); serial gradient accumulation holds one.
Megatron's combined-1F1B overlaps the forward of one micro-batch with the backward of another instead, which
costs no extra activations. On gloo (CPU) the transfers run on gloo's worker threads, so the overlap is real
but shares the cores with the computation; on NCCL the transfers are kernels on a separate CUDA stream, which
overlap with compute kernels but take some SMs and memory bandwidth from them.

:func:`simulate` is a two-resource cost model (one compute engine, one link; not a measurement) of both
schedules, with the dispatcher's blocking count exchange as an exposed term, for the comm/compute sweep.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable, Generator

import torch
import torch.nn as nn

from toolkit.models.gpt import lm_loss

from .dispatcher import Pending, run_experts

# ---- spans and exposed communication ---------------------------------------------------------------------------
class _Mark(torch.autograd.Function):
    """Identity whose backward calls ``note()``: the moment autograd reaches this point of the graph."""

    @staticmethod
    def forward(ctx, x, note):
        ctx.note = note
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.note()
        return grad, None


@dataclass
class Tracer:
    """Times what one rank does in a step: compute segments, the plan's count exchange, and each all-to-all's
    issue and wait (through ``TokenDispatcher.trace``), forward and backward.

    ``exposed`` sums the seconds the rank spent blocked in communication calls, by kind ("a2a": issue and wait
    of dispatch/combine, also split into "issue" and "wait"; "plan": the count all-gather). With ``timeline``
    set (``ctx.timeline``), every span is also recorded there (kind, start, end; meta: schedule, dir "F"/"B",
    mb, layer, op), plus "a2a" spans from issue to the transfer's completion (the handle's future)."""

    schedule: str = ""
    timeline: object | None = None
    exposed: dict = field(default_factory=lambda: {"a2a": 0.0, "issue": 0.0, "wait": 0.0, "plan": 0.0})
    clock: Callable[[], float] = time.perf_counter

    def now(self) -> float:
        return self.timeline.now() if self.timeline is not None else self.clock()

    def _add(self, kind: str, t0: float, t1: float, **meta) -> None:
        if self.timeline is not None:
            self.timeline.add(kind, t0, t1, schedule=self.schedule, **meta)

    @contextlib.contextmanager
    def compute(self, kind: str, mb: int, layer: int | None = None, direction: str = "F", marks: bool = True):
        """Times a compute segment (``direction`` "F" or "B"); in a forward, ``seg.enter(*inputs)`` /
        ``seg.leave(*outputs)`` (identities) let its backward be timed too, from the last output gradient to the
        inputs' gradient (``marks=False``: a backward that times its segments itself)."""
        seg = _Segment(self, kind, mb, layer, marks)
        t0 = self.now()
        yield seg
        self._add(kind, t0, self.now(), dir=direction, mb=mb, layer=layer)

    def phase(self, name: str):
        """For ``TokenDispatcher.phase``: the plan's count exchange ("routing") is exposed communication."""
        return self._blocking("plan", name) if name == "routing" else contextlib.nullcontext()

    @contextlib.contextmanager
    def _blocking(self, kind: str, op: str, **meta):
        t0 = self.now()
        yield
        t1 = self.now()
        self.exposed[kind] += t1 - t0
        self._add(kind, t0, t1, op=op, **meta)

    def a2a(self, op: str, mb: int, layer: int):
        """For ``TokenDispatcher.trace``: times issue and wait of one transfer and, on the timeline, its flight."""
        @contextlib.contextmanager
        def trace(event: str, transfer):
            direction = "B" if event.startswith("grad") else "F"
            t0 = self.now()
            yield
            t1 = self.now()
            kind = event.removeprefix("grad_")
            self.exposed["a2a"] += t1 - t0
            self.exposed[kind] += t1 - t0
            self._add(kind, t0, t1, op=op, mb=mb, layer=layer, dir=direction)
            if kind == "issue" and self.timeline is not None:
                done = lambda fut: self._add("a2a", t0, self.now(), op=op, mb=mb, layer=layer, dir=direction)
                transfer.work.get_future().then(done)
        return trace


class _Segment:
    def __init__(self, tracer: Tracer, kind: str, mb: int, layer: int | None, marks: bool = True):
        self.tracer, self.kind, self.mb, self.layer, self.start = tracer, kind, mb, layer, None
        self.marks = marks and tracer.timeline is not None

    def _out_note(self) -> None:
        self.start = self.tracer.now()  # the last output gradient to arrive opens the span

    def _in_note(self) -> None:
        if self.start is not None:
            self.tracer._add(self.kind, self.start, self.tracer.now(), dir="B", mb=self.mb, layer=self.layer)
            self.start = None

    def enter(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(_Mark.apply(x, self._in_note) for x in xs) if self.marks else xs

    def leave(self, *ys: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(_Mark.apply(y, self._out_note) for y in ys) if self.marks else ys


# ---- one micro-batch's forward as a generator ------------------------------------------------------------------
def moe_layers(model: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
    """(block, its ExpertParallelMoE) for every block of a tiny MoE GPT made expert parallel."""
    from .layer import ExpertParallelMoE
    layers = [(b, b.mlp) for b in model.blocks]
    if not all(isinstance(moe, ExpertParallelMoE) for _, moe in layers):
        raise ValueError("every block's mlp must be an ExpertParallelMoE (call toolkit.moe.expert_parallel first)")
    return layers


@dataclass
class _LayerCut:
    """What the segmented backward of one MoE layer needs from its forward (``micro_batch_forward(cut=...)``)."""

    x: torch.Tensor  # the layer's input, a leaf: the backward below this layer starts from its .grad
    h: torch.Tensor
    flat: torch.Tensor
    weights: torch.Tensor  # the attention segment's outputs
    dispatch_token: torch.Tensor
    expert_in: torch.Tensor  # the dispatch: its start token and its waited output (the dispatcher's nodes)
    expert_leaf: torch.Tensor  # the experts' input, a leaf
    out: torch.Tensor  # the experts' output
    combine_token: torch.Tensor
    y: torch.Tensor  # the combine: its start token and its (unpermuted) output


@dataclass
class Cut:
    """One micro-batch's forward cut at every all-to-all, for a backward that yields at each of them."""

    embed_out: torch.Tensor | None = None  # None: a pipeline stage without the embedding
    layers: list = field(default_factory=list)
    head_in: torch.Tensor | None = None  # a leaf: the last block's output (a stage without the head returns it)
    loss: torch.Tensor | None = None  # None: a pipeline stage without the head


def micro_batch_forward(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor | None, mb: int, tracer: Tracer,
                        scale: float = 1.0, cut: Cut | None = None,
                        finish: Callable[[torch.Tensor], torch.Tensor] | None = None
                        ) -> Generator[Pending, torch.Tensor, torch.Tensor]:
    """The loss of one micro-batch (times ``scale``), yielding each all-to-all it issues (its dispatchers'
    ``trace`` hook is set to ``tracer`` for each transfer; :func:`step` puts the previous hooks back)::

        embed ─► per block: attention (+ ln2, router) ─► plan ─► yield dispatch ─► experts ─► yield combine ─► residual
              ─► head, loss

    ``model`` is a whole GPT or a pipeline stage (``toolkit.models.split_stages``: ``embed`` and ``head`` may be
    None; then ``idx`` is the stage's input hidden states, and without a head the forward returns the last
    block's output). ``finish`` turns the head's output into the loss (default ``lm_loss(logits, targets) *
    scale``; a pipeline executor passes its own). ``cut`` (a :class:`Cut`): the graph is cut into segments at every
    all-to-all and what :func:`micro_batch_backward` needs is recorded there (the same ops, the same values)."""
    marks = cut is None  # a cut forward's backward times its segments itself
    x = idx
    if model.embed is not None:
        with tracer.compute("embed", mb):
            x = model.embed(idx)
        if cut is not None:
            cut.embed_out, x = x, x.detach().requires_grad_()
    for layer, (block, moe) in enumerate(moe_layers(model)):
        d = moe.dispatcher
        if cut is not None and d.dedup:
            raise ValueError("a cut forward (schedule 'fb') needs dedup=False: dedup's metadata all-to-all is not cut")
        x_in = x
        with tracer.compute("attn", mb, layer, marks=marks) as seg:
            (x,) = seg.enter(x)
            h = x + block.attn(block.ln1(x))
            flat = block.ln2(h).reshape(-1, h.shape[-1])
            weights, ids = moe.router(flat)
            h, flat, weights = seg.leave(h, flat, weights)
        plan = moe.last_plan = d.plan(moe.place(ids), weights, flat)  # collective: the counts of every rank
        d.trace = tracer.a2a("dispatch", mb, layer)
        pending = d.dispatch(flat, plan, async_op=True)
        dispatch_token = pending.token
        expert_in = yield pending
        expert_leaf = expert_in.detach().requires_grad_() if cut is not None else expert_in
        with tracer.compute("experts", mb, layer, marks=marks) as seg:
            (e_in,) = seg.enter(expert_leaf)
            (out,) = seg.leave(run_experts(moe.slots, e_in, plan.recv_counts))
        d.trace = tracer.a2a("combine", mb, layer)
        pending = d.combine(out, plan, async_op=True)
        combine_token = pending.token
        y = yield pending
        x = h + y.view_as(h)
        if cut is not None:
            cut.layers.append(_LayerCut(x_in, h, flat, weights, dispatch_token, expert_in, expert_leaf, out,
                                        combine_token, y))
            x = x.detach().requires_grad_()
    if cut is not None:
        cut.head_in = x
    if model.head is None:
        return x
    finish = finish or (lambda logits: lm_loss(logits, targets) * scale)
    with tracer.compute("head", mb, marks=marks) as seg:
        (x,) = seg.enter(x)
        (loss,) = seg.leave(finish(model.head(x)))
    if cut is not None:
        cut.loss = loss
    return loss


class _Later:
    """A backward all-to-all in flight: ``wait()`` finishes it (the dispatcher's ``_Start.backward``) and runs the
    gradient on to the segment before it."""

    def __init__(self, finish: Callable[[], torch.Tensor]):
        self.wait = finish


def micro_batch_backward(cut: Cut, mb: int, tracer: Tracer,
                         out_grad: torch.Tensor | None = None) -> Generator[_Later, torch.Tensor, None]:
    """The backward of a :class:`Cut` forward, segment by segment from the loss down, yielding at each all-to-all
    after issuing it (as the forward does), so another micro-batch's forward can compute while it flies::

        head ─► per layer, top down: combine⁻¹ (unpermute backward, issue) ─► yield ─► (wait) experts backward
              ─► dispatch⁻¹ (issue) ─► yield ─► (wait) attention backward ─► embed

    The ops are those autograd runs for ``loss.backward()`` (the dispatcher's own backward nodes, reached with
    ``torch.autograd.grad`` at the cuts), so gradients are the same; parameter gradients accumulate in ``.grad``.
    A pipeline stage without the head starts from ``out_grad``, the gradient of its output; one without the
    embedding ends with the gradient of its input in that input's ``.grad``."""
    grad = torch.autograd.grad
    if cut.loss is not None:
        with tracer.compute("head", mb, direction="B"):
            torch.autograd.backward(cut.loss)  # -> cut.head_in.grad and the head's parameters
        dx = cut.head_in.grad
    else:
        dx = out_grad
    for layer in reversed(range(len(cut.layers))):
        c = cut.layers[layer]
        # combine's backward: the unpermute's (grad of the rows and of the gate weights), then its all-to-all leaves
        with tracer.compute("unpermute", mb, layer, direction="B"):
            d_token, d_weights = grad(c.y, (c.combine_token, c.weights), dx.reshape(c.y.shape))
        d_out = yield _Later(lambda c=c, d_token=d_token: grad(c.combine_token, c.out, d_token)[0])
        with tracer.compute("experts", mb, layer, direction="B"):
            torch.autograd.backward(c.out, d_out)  # -> the experts' parameters and c.expert_leaf.grad
        d_token = grad(c.expert_in, c.dispatch_token, c.expert_leaf.grad)[0]  # dispatch's all-to-all leaves
        d_flat = yield _Later(lambda c=c, d_token=d_token: grad(c.dispatch_token, c.flat, d_token)[0])
        with tracer.compute("attn", mb, layer, direction="B"):
            torch.autograd.backward((c.h, c.flat, c.weights), (dx.reshape(c.h.shape), d_flat, d_weights))
        dx = c.x.grad
    if cut.embed_out is not None:
        with tracer.compute("embed", mb, direction="B"):
            torch.autograd.backward(cut.embed_out, dx)


def run_serial(forwards: list[Generator]) -> list[torch.Tensor]:
    """Each micro-batch to the end before the next; every all-to-all waited on as soon as it is issued."""
    out = []
    for fwd in forwards:
        try:
            pending = next(fwd)
            while True:
                pending = fwd.send(pending.wait())
        except StopIteration as stop:
            out.append(stop.value)
    return out


def run_interleaved(forwards: list[Generator]) -> list[torch.Tensor]:
    """Round-robin at every all-to-all: a micro-batch issues one, the next one computes until it issues its own,
    and the first waits on its handle only when its turn comes again (just before it needs the result)."""
    pending: list = [None] * len(forwards)
    out: list = [None] * len(forwards)
    live = list(range(len(forwards)))
    for i in live:
        pending[i] = next(forwards[i])  # every micro-batch runs to its first dispatch (no loss has zero layers)
    while live:
        for i in list(live):
            try:
                pending[i] = forwards[i].send(pending[i].wait())
            except StopIteration as stop:
                out[i] = stop.value
                live.remove(i)
    return out


def step(model: nn.Module, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], schedule: str,
         tracer: Tracer | None = None, saved: dict | None = None) -> list[float]:
    """One training step (forward and backward, gradients accumulated, no optimizer) over the micro-batches,
    ``schedule`` "serial" (each micro-batch's forward and backward in turn), "overlapped" (forwards
    interleaved, one backward over both) or "fb" (micro-batch i's forward interleaved with micro-batch i-1's
    backward, as Megatron's combined 1F1B and DualPipe's F&B do). Returns each micro-batch's loss (mean over
    micro-batches = the loss).

    ``saved`` (a dict) receives ``"bytes"``: the most activation bytes autograd holds at once, i.e. at the end of
    a forward (serial: one micro-batch's; overlapped: all of them; fb: at most two micro-batches'), parameters
    excluded."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is not allowed; allowed: {SCHEDULES}")
    tracer = tracer or Tracer(schedule)
    dispatchers = [moe.dispatcher for _, moe in moe_layers(model)]
    hooks = [(d.phase, d.trace) for d in dispatchers]
    for d, (phase, _) in zip(dispatchers, hooks):  # the tracer times the count exchange, inside the caller's phase
        d.phase = lambda name, phase=phase: _both(phase(name), tracer.phase(name))
    try:
        return _step(model, micro_batches, schedule, tracer, saved)
    finally:
        for d, (phase, trace) in zip(dispatchers, hooks):
            d.phase, d.trace = phase, trace


@contextlib.contextmanager
def _both(a, b):
    with a, b:
        yield


def _step(model, micro_batches, schedule: str, tracer: Tracer, saved: dict | None) -> list[float]:
    from toolkit.runtime.memory import saved_activation_bytes
    m, params = len(micro_batches), list(model.parameters())
    fwd = [micro_batch_forward(model, x, y, i, tracer, 1.0 / m) for i, (x, y) in enumerate(micro_batches)]
    held = []
    if schedule == "serial":
        losses = []
        for f in fwd:
            nbytes, (loss,) = saved_activation_bytes(lambda: run_serial([f]), params)
            loss.backward()
            losses.append(loss)
            held.append(nbytes)
    elif schedule == "overlapped":
        nbytes, losses = saved_activation_bytes(lambda: run_interleaved(fwd), params)
        torch.stack(losses).sum().backward()
        held.append(nbytes)
    else:  # "fb": F(0); then F(i) interleaved with B(i-1) at every all-to-all of either; then B(m-1)
        cuts = [Cut() for _ in micro_batches]
        fwd = [micro_batch_forward(model, x, y, i, tracer, 1.0 / m, cuts[i]) for i, (x, y) in enumerate(micro_batches)]
        nbytes, (loss,) = saved_activation_bytes(lambda: run_serial([fwd[0]]), params)
        losses, saved_by = [loss], [nbytes]
        for i in range(1, m):
            backward = micro_batch_backward(cuts[i - 1], i - 1, tracer)
            nbytes, (loss, _) = saved_activation_bytes(lambda: run_interleaved([fwd[i], backward]), params)
            losses.append(loss)
            saved_by.append(nbytes)
            cuts[i - 1] = None  # its activations go with it
        run_serial([micro_batch_backward(cuts[m - 1], m - 1, tracer)])
        # at most F(i)'s activations and what B(i-1) has not freed yet: the two micro-batches' (an upper bound)
        held.append(max(a + b for a, b in zip(saved_by, saved_by[1:])) if m > 1 else saved_by[0])
    if saved is not None:
        saved["bytes"] = max(held)
    return [float(loss) * m for loss in losses]


SCHEDULES = ("serial", "overlapped", "fb")


# ---- the cost model ---------------------------------------------------------------------------------------------
def simulate(attn: float, experts: float, dispatch: float, combine: float, layers: int = 1, m: int = 2,
             schedule: str = "overlapped", backward: float | tuple[float, float] = 2.0, plan: float = 0.0) -> dict:
    """Cost model (not a measurement): one compute engine and one link, each doing one thing at a time; ``schedule``
    one of :data:`SCHEDULES`.

    Per micro-batch and layer: attention ``attn`` s, the plan's count exchange ``plan`` s, ``dispatch`` s on the
    link, ``experts`` s, ``combine`` s. The count exchange is blocking: the compute engine waits ``plan`` s for it
    in both schedules (a latency: the model gives its few bytes no link time, so it does not queue behind a
    transfer in flight). The forward follows the same program as :func:`run_serial` / :func:`run_interleaved`;
    the backward is the forward reversed with compute times × ``backward`` (one factor, or attention's and the
    experts') and the same transfers (no count exchange: the plan is reused). Returns the step time, the compute time, the exposed communication (compute
    idle while a transfer it needs is in flight, plus the count exchanges), the part of it that is count
    exchange, the total communication and the overlap fraction = hidden / total."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is not allowed; allowed: {SCHEDULES}")
    b_attn, b_experts = backward if isinstance(backward, tuple) else (backward, backward)
    for name, v in (("attn", attn), ("experts", experts), ("dispatch", dispatch), ("combine", combine),
                    ("backward", b_attn), ("backward", b_experts), ("plan", plan)):
        if not v >= 0:
            raise ValueError(f"{name}={v!r} must be >= 0")
    fwd = [("compute", attn), ("plan", plan), ("comm", dispatch), ("compute", experts), ("comm", combine)] * layers
    bwd = [("comm", combine), ("compute", experts * b_experts), ("comm", dispatch), ("compute", attn * b_attn)] * layers
    state = {"compute": 0.0, "link": 0.0, "idle": 0.0}

    def run(programs: list[list], interleave: bool) -> None:
        ready = [0.0] * len(programs)  # when each micro-batch's last transfer lands
        pos = [0] * len(programs)
        order = range(len(programs))
        while any(pos[i] < len(programs[i]) for i in order):
            for i in order:
                while pos[i] < len(programs[i]):
                    kind, t = programs[i][pos[i]]
                    pos[i] += 1
                    if kind == "compute":
                        start = max(state["compute"], ready[i])
                        state["idle"] += start - state["compute"]
                        state["compute"] = start + t
                    elif kind == "plan":  # blocking: the compute engine waits for it
                        state["idle"] += t
                        state["compute"] += t
                    else:
                        start = max(state["link"], state["compute"])
                        state["link"] = ready[i] = start + t
                        if interleave:
                            break
        end = max(state["compute"], *ready)  # the program's last transfers are waited on before what follows
        state["idle"] += end - state["compute"]
        state["compute"] = end
    if schedule == "serial":
        for _ in range(m):
            run([fwd], False)
            run([bwd], False)
    elif schedule == "overlapped":
        run([list(fwd) for _ in range(m)], True)
        run([list(bwd) for _ in range(m)], True)
    else:  # fb: F(0), then F(i) with B(i-1), then B(m-1)
        run([list(fwd)], False)
        for _ in range(1, m):
            run([list(fwd), list(bwd)], True)
        run([list(bwd)], False)
    step_s = max(state["compute"], state["link"])
    exposed_plan = m * layers * plan
    total_comm = 2 * m * layers * (dispatch + combine) + exposed_plan
    compute = m * layers * (attn * (1 + b_attn) + experts * (1 + b_experts))
    exposed = step_s - compute
    return {"step_s": step_s, "compute_s": compute, "exposed_comm_s": exposed, "exposed_plan_s": exposed_plan,
            "comm_s": total_comm, "overlap_fraction": 1 - exposed / total_comm if total_comm else 0.0}


def ratio_sweep(ratios: list[float], attn: float = 1.0, experts: float = 1.0, layers: int = 4, m: int = 2,
                backward: float = 2.0) -> list[dict]:
    """Cost model over comm/compute ratios r = (dispatch + combine) / (attn + experts), split evenly: per ratio
    and schedule the step, the exposed communication, the speed-up over serial and the overlap fraction."""
    rows = []
    for r in ratios:
        c = r * (attn + experts) / 2
        res = {sched: simulate(attn, experts, c, c, layers, m, sched, backward) for sched in SCHEDULES}
        row = {"ratio": r}
        for sched, x in res.items():
            row.update({f"{sched}_s": x["step_s"], f"exposed_{sched}_s": x["exposed_comm_s"],
                        f"speedup_{sched}": res["serial"]["step_s"] / x["step_s"],
                        f"overlap_fraction_{sched}": x["overlap_fraction"]})
        rows.append(row)
    return rows


def activation_bytes(tokens: int, d_model: int, d_ff: int, top_k: int, n_layer: int, seq_len: int, n_head: int,
                     bytes_per: int = 4) -> int:
    """Rough saved-activation bytes of one micro-batch of ``tokens`` tokens through the tiny MoE GPT (a cost model:
    the per-layer tensors autograd keeps; the run measures the real number)."""
    per_token = (d_model * 6  # ln1 in/out, qkv in, proj in, residual, ln2
                 + 3 * d_model + d_model  # qkv out, attention out
                 + top_k * (d_model * 2 + d_ff * 2))  # per routed pair: expert in, fc1 out, gelu out, fc2 in/out
    attn_probs = n_head * seq_len  # causal attention probabilities per token (math kernel)
    return tokens * n_layer * (per_token + attn_probs) * bytes_per
