"""The tiny GPT as a pipeline, set up once: what lessons 00, 03, 10, the tests and the benchmark share.

The engine (``executor.py``) runs any schedule on any stage modules. An *experiment* around it needs the
same few things every time, built here in one place, with one seed convention, all on ``ctx.device``::

    setup = PipelineSetup.build(model="smoke", n_layer=4, m=8, micro_batch=2, seed=0, device=ctx.device)
      model_cfg          GPTConfig of the preset, n_layer overridden
      base               GPT, weights from torch.manual_seed(seed)          ─┐ every run starts from a
      inputs, targets    m micro-batches of real tokens (toolkit.data, seed)  │ deep copy of base on the
      reference          a copy of base after one single-process step:        │ same micro-batches
      ref_loss           micro-batches in order, mean loss, grads accumulated ─┘

    records, models = measure_schedules(ctx, setup, [Job(schedule), Job(schedule, impl="torch"), ...],
                                        warmup=1, steps=3, rounds=3)
      per job   one checked step on a fresh copy: loss, largest |grad - reference grad|, saved-activation
                bytes over the step (ActivationMeter)
      all jobs  timed side by side by toolkit.runtime.bench.compare (round-robin), each on its own fresh
                copy, with per-op spans, receive waits and the ledger's p2p counts of the timed steps
      -> one record per job, keyed by structured fields: {"schedule", "impl", "fb_overlap", "meta", ...}
         find(records, schedule="dualpipev", impl="torch") picks one.

``impl="ours"`` runs ``PipelineExecutor``; ``impl="torch"`` runs torch.distributed.pipelining's own
implementation of the schedule (``torch_compare.TorchPipeline``: no spans, no activation meter).
"""
from __future__ import annotations

import copy
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable

import torch
import torch.nn as nn

from toolkit.runtime.config import require_divisible, require_ranks

from .executor import PipelineExecutor
from .recompute import Recompute
from .schedule import Schedule

IMPLS = ("ours", "torch")


# ------------------------------------------------------------------------------------------------
# The pieces
# ------------------------------------------------------------------------------------------------
def gpt_micro_batches(m: int, micro_batch: int, seq_len: int, seed: int = 0, device=None
                      ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """m micro-batches of real tokens (``toolkit.data``): inputs and next-token targets, each [b, T]."""
    from toolkit.data import batches
    x, y = next(batches(m * micro_batch, seq_len, 1, seed=seed, device=device))
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


def grads_bitwise_equal(model: nn.Module, other: nn.Module, modules: Iterable[nn.Module]) -> bool:
    """Whether every parameter of ``modules`` (part of ``model``) has exactly the gradient of the same
    parameter in ``other`` (a copy of the same model)."""
    mine = {id(p) for module in modules for p in module.parameters()}
    theirs = dict(other.named_parameters())
    return all(torch.equal(p.grad, theirs[name].grad) for name, p in model.named_parameters() if id(p) in mine)


def check_stage_per_rank(cfg: dict, world_size: int, what: str) -> None:
    """The checks of a lesson whose ``world_size`` ranks each run one pipeline stage of the tiny GPT of ``cfg``
    (``n_layer``, ``m``, ``d_model``, ``n_head``); ``what`` says what needs the ranks. ValueError naming the
    parameter, before any process starts."""
    require_ranks(world_size, 2, what)
    require_divisible("n_layer", cfg["n_layer"], world_size, "world_size", "layers per stage")
    if cfg["m"] < world_size:
        raise ValueError(f"m={cfg['m']} micro-batches is fewer than the {world_size} stages; need m >= {world_size}")
    require_divisible("d_model", cfg["d_model"], cfg["n_head"], "n_head", "heads split the hidden size")


# ------------------------------------------------------------------------------------------------
# The set-up object
# ------------------------------------------------------------------------------------------------
@dataclass
class PipelineSetup:
    """Model, data and single-process reference of one pipeline experiment (see the module docstring)."""

    model_cfg: object
    base: nn.Module
    inputs: list[torch.Tensor]
    targets: list[torch.Tensor]
    reference: nn.Module
    ref_loss: float
    seed: int
    device: torch.device

    @classmethod
    def build(cls, model: str = "smoke", *, m: int, micro_batch: int, n_layer: int | None = None, seed: int = 0,
              device: torch.device | str = "cpu", **overrides) -> "PipelineSetup":
        """The ``model`` preset of ``toolkit.models`` (``n_layer`` and other fields overridden), weights from
        ``torch.manual_seed(seed)``, m micro-batches of ``micro_batch`` sequences drawn with ``seed``, and
        the reference step, everything on ``device``."""
        from toolkit.models import GPT, preset
        if n_layer is not None:
            overrides["n_layer"] = n_layer
        model_cfg = preset(model, **overrides)
        device = torch.device(device)
        inputs, targets = gpt_micro_batches(m, micro_batch, model_cfg.seq_len, seed=seed, device=device)
        torch.manual_seed(seed)
        base = GPT(model_cfg).to(device)
        reference = copy.deepcopy(base)
        ref_loss = reference_step(reference, inputs, targets)
        return cls(model_cfg, base, inputs, targets, reference, ref_loss, seed, device)

    @property
    def m(self) -> int:
        return len(self.inputs)

    @property
    def act_shape(self) -> tuple[int, int, int]:
        """Shape of one micro-batch's activation between stages: [micro_batch, seq_len, d_model]."""
        return (*self.inputs[0].shape, self.model_cfg.d_model)

    def layer_op(self, elem: int = 2) -> dict[str, float]:
        """``toolkit.matched.dense_layer_op`` of one of this model's layers on one micro-batch: the toy side of a
        workload-matched run (``matched.matched_scales(setup.layer_op(...), matched.layer_op(real, real.seq_len))``)."""
        from toolkit.models import matched
        batch, seq, d_model = self.act_shape
        return matched.dense_layer_op(batch * seq, d_model, self.model_cfg.d_ff, elem)

    def fresh(self) -> nn.Module:
        """A copy of the base model (no gradients yet)."""
        return copy.deepcopy(self.base)

    def stages(self, model: nn.Module, schedule: Schedule, rank: int) -> dict[int, nn.Module]:
        return gpt_stages(model, schedule, rank)

    def executor(self, schedule: Schedule, rank: int, model: nn.Module | None = None, **kwargs
                 ) -> tuple[nn.Module, PipelineExecutor]:
        """(model, executor) for ``rank``: a fresh copy of the base (or ``model``) cut for ``schedule``;
        ``kwargs`` go to ``PipelineExecutor`` (meter, timeline, fb_overlap, hooks, ...). A schedule that
        checkpoints forwards gets the ``Recompute`` hook first."""
        from toolkit.models import lm_loss
        model = self.fresh() if model is None else model
        hooks = [*([Recompute()] if schedule.checkpointed else []), *kwargs.pop("hooks", ())]
        ex = PipelineExecutor(schedule, rank, self.stages(model, schedule, rank), lm_loss, self.act_shape,
                              device=self.device, hooks=hooks, **kwargs)
        return model, ex

    def torch_runner(self, schedule: Schedule, rank: int, model: nn.Module | None = None):
        """(model, runner) with torch.distributed.pipelining's implementation of ``schedule``."""
        from toolkit.models import lm_loss

        from .torch_compare import TorchPipeline
        model = self.fresh() if model is None else model
        runner = TorchPipeline(schedule.meta.get("torch_name", schedule.name), self.stages(model, schedule, rank),
                               schedule.n_stages, schedule.m, lm_loss, self.device)
        return model, runner

    def grad_diff(self, model: nn.Module, schedule: Schedule, rank: int) -> float:
        """Largest |grad - reference grad| over this rank's stages of ``model``."""
        return grad_diff(model, self.reference, self.stages(model, schedule, rank).values())


# ------------------------------------------------------------------------------------------------
# Checked and timed runs
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Job:
    """One thing to run: a schedule, by our executor (``"ours"``) or by torch (``"torch"``)."""

    schedule: Schedule
    impl: str = "ours"
    fb_overlap: bool = True
    """ours: overlap the halves of an F&B with each other's communication (``PipelineExecutor``)."""
    options: dict = field(default_factory=dict, hash=False, compare=False)
    """more ``PipelineExecutor`` keyword arguments (ours)."""

    def __post_init__(self):
        if self.impl not in IMPLS:
            raise ValueError(f"impl={self.impl!r} is not known; allowed: {IMPLS}")

    @property
    def fields(self) -> dict:
        """What identifies this job's record."""
        return {"schedule": self.schedule.name, "impl": self.impl,
                "fb_overlap": self.fb_overlap if self.impl == "ours" else None, "meta": dict(self.schedule.meta)}

    @property
    def label(self) -> str:
        return f"{self.schedule.name}|{self.impl}" + ("" if self.fb_overlap or self.impl != "ours" else "|fb-seq")


def find(records: list[dict], **fields) -> dict:
    """The one record whose fields equal ``fields`` (e.g. ``schedule="dualpipev", impl="torch"``)."""
    hits = [r for r in records if all(r.get(k) == v for k, v in fields.items())]
    if len(hits) != 1:
        have = [{k: r.get(k) for k in ("schedule", "impl", "fb_overlap")} for r in records]
        raise KeyError(f"{len(hits)} records match {fields}; have {have}")
    return hits[0]


def check_step(ctx, setup: PipelineSetup, job: Job) -> tuple[dict, nn.Module]:
    """One step of ``job`` on a fresh copy of the base: loss, grad_diff against the reference, and (ours)
    the saved-activation bytes over the step. Returns (record, the stepped model)."""
    schedule = job.schedule
    if job.impl == "torch":
        model, runner = setup.torch_runner(schedule, ctx.rank)
        loss, peak, samples = runner.step(setup.inputs, setup.targets), None, []
    else:
        model, ex = setup.executor(schedule, ctx.rank, meter=True, fb_overlap=job.fb_overlap, **job.options)
        loss, peak = ex.step(setup.inputs, setup.targets), ex.meter.peak
        samples = [{"seconds": t, "bytes": b} for t, b in ex.memory]
    record = {**job.fields, "loss": loss, "grad_diff": setup.grad_diff(model, schedule, ctx.rank),
              "peak_act_bytes": peak, "act_bytes": samples}
    return record, model


class _Candidate:
    """One job's timed step for ``bench.compare``: a fresh copy, its spans, waits and ledger tag per step."""

    def __init__(self, ctx, setup: PipelineSetup, job: Job, warmup: int):
        from toolkit.runtime.timeline import Timeline
        self.ctx, self.setup, self.job, self.warmup, self.calls = ctx, setup, job, warmup, 0
        self.steps: list[dict] = []  # per timed step: spans, waits
        self.vsteps: list[dict] = []  # the same, of the steps on the emulated cluster's clock (measure_schedules)
        self.virtual_pass, self.virtual_calls = False, 0
        self.executor = None
        if job.impl == "torch":
            self.model, runner = setup.torch_runner(job.schedule, ctx.rank)
        else:
            timeline = Timeline(ctx.rank)
            timeline.origin = ctx.timeline.origin  # aligned across ranks by the launch barrier
            timeline.virtual = ctx.timeline.virtual  # the emulated cluster's clock, if any
            self.model, runner = setup.executor(job.schedule, ctx.rank, timeline=timeline,
                                                fb_overlap=job.fb_overlap, **job.options)
            self.executor = runner
        self.runner = runner

    @property
    def tag(self) -> str:
        return "pipeline:" + self.job.label

    def __call__(self) -> None:
        self.calls += 1
        self.virtual_calls += self.virtual_pass
        timed = self.calls > self.warmup
        self.model.zero_grad(set_to_none=True)
        with self.ctx.ledger.tag(self.tag + (":warmup" if not timed else ":virtual" if self.virtual_pass else "")):
            self.runner.step(self.setup.inputs, self.setup.targets)
        if self.executor is not None:
            if timed:
                step = {"spans": self.executor.timeline.to_json(), "waits": list(self.executor.waits)}
                (self.vsteps if self.virtual_pass else self.steps).append(step)
            self.executor.timeline.spans.clear()

    def summary(self) -> dict:
        """Op times, the last timed step's spans and waits, exposed receive time and p2p counts per step."""
        ledger = [r for r in self.ctx.ledger.records if r.tag == self.tag and r.op in ("isend", "irecv")]
        timed_steps = self.calls - self.warmup - self.virtual_calls
        out = {"p2p": {"calls": len(ledger) / timed_steps,
                       "sent_bytes": sum(r.sent_bytes for r in ledger) / timed_steps,
                       "recv_bytes": sum(r.recv_bytes for r in ledger) / timed_steps,
                       "recv_open_s": sum(r.seconds for r in ledger if r.op == "irecv") / timed_steps}}
        if self.executor is None:
            return out
        out.update(self._op_times(self.steps, "start", "end", "op_seconds"))
        vsteps = self.vsteps or self.steps  # a virtual pass, or timed steps that ran on the emulated cluster's clock
        if any("vstart" in s for st in vsteps for s in st["spans"]):
            out.update(self._op_times(vsteps, "vstart", "vend", "op_vseconds"))
            out["exposed_recv_vs"] = statistics.median([sum(w["vseconds"] for w in st["waits"]) for st in vsteps])
            out["exposed_wire_vs"] = statistics.median([sum(w["vwire_s"] for w in st["waits"]) for st in vsteps])
        exposed = [sum(w["seconds"] for w in st["waits"]) for st in self.steps]
        by_msg: dict[tuple, list[float]] = defaultdict(list)
        for st in self.steps:
            for w in st["waits"]:
                by_msg[(w["msg"], w["stage"], w["mb"], w["chunk"], w["pair"])].append(w["seconds"])
        out.update({
            "spans": self.steps[-1]["spans"] if self.steps else [],
            "waits": self.steps[-1]["waits"] if self.steps else [],
            "exposed_recv_s": statistics.median(exposed) if exposed else 0.0,
            "recv_waits": [{"msg": k[0], "stage": k[1], "mb": k[2], "chunk": k[3], "pair": k[4],
                            "seconds": statistics.median(v)} for k, v in by_msg.items()],
            "timed_steps": len(self.steps)})
        return out


    @staticmethod
    def _op_times(steps: list[dict], start: str, end: str, key: str) -> dict:
        """Median duration per (op, stage) over ``steps``, F&B pairs as their halves' compute."""
        per_op: dict[tuple, list[float]] = defaultdict(list)
        for st in steps:
            pairs: dict[str, list[dict]] = defaultdict(list)
            for s in st["spans"]:
                per_op[(s["kind"], s["meta"]["stage"])].append(s[end] - s[start])
                if s["meta"].get("pair"):
                    pairs[s["meta"]["with"]].append(s)
            for halves in pairs.values():  # an F&B: its two halves' compute (not the wait between them)
                stages = tuple(h["meta"]["stage"] for h in halves)
                per_op[("F&B", stages)].append(sum(h[end] - h[start] for h in halves))
        return {key: [{"op": op, "stage": list(stage) if isinstance(stage, tuple) else stage,
                       "seconds": statistics.median(v)} for (op, stage), v in sorted(per_op.items(), key=str)]}


def measure_schedules(ctx, setup: PipelineSetup, jobs: list[Job], *, warmup: int = 1, steps: int = 3,
                      rounds: int = 3, trim: int = 1, label: str = "schedules") -> tuple[list[dict], list[nn.Module]]:
    """Check and time ``jobs`` on every rank (collectively; all ranks pass the same jobs).

    Per job, one checked step (``check_step``); then all jobs timed side by side with
    ``toolkit.runtime.bench.compare`` (``warmup`` untimed steps each, then ``rounds`` rounds of ``steps``
    steps, the order rotating), each on its own fresh copy. Returns one record per job, in order, and the
    model of each checked step. Progress (``ctx.progress``) counts pipeline steps, checked, warm-up and timed,
    over this call; wrap the call in ``ctx.part`` to make it one slice of a longer run. A record holds
    ``check_step``'s fields and:

    On an emulated cluster the virtual clock is deterministic: a step started from clocks a barrier aligned takes
    the same virtual time every time. With more than one timed step, the checked steps and the timed rounds
    therefore run paused (``ctx.paused()``: wall time without the emulator's Python on every op), and one more
    step per job, after a barrier, runs on the emulated cluster's clock for the virtual fields (``bench["virtual"]``,
    ``op_vseconds``, ``exposed_recv_vs``, ``exposed_wire_vs``), as the lessons' emulated sections time theirs; a
    single timed step carries both clocks. Each job's steps on the clock are the emulator windows
    ``{label}/{job.label}#i`` (``replayed_steps`` reads them back from a replay of the run).

    - ``bench``: ``BenchResult`` fields (trimmed mean of the round means, median, std, stability, ...);
    - ``p2p``: per timed step, from the ledger: ``calls``, ``sent_bytes``, ``recv_bytes``, ``recv_open_s``
      (each receive's time from its post to its arrival being waited for);
    - ours only: ``op_seconds`` (``[{"op", "stage", "seconds"}]``, medians over the timed steps; F&B pairs
      as ``{"op": "F&B", "stage": [forward stage, backward stage]}``, their halves' compute), ``spans``
      and ``waits`` of the last timed step (times aligned across ranks), ``exposed_recv_s`` (median over the
      timed steps of the time this rank blocked on receives) and ``recv_waits`` (per received message, the
      median time blocked on it: ``{"msg", "stage", "mb", "chunk", "pair", "seconds"}``).
    """
    from toolkit.runtime.bench import compare

    if len({job.label for job in jobs}) != len(jobs):
        raise ValueError(f"jobs repeat: {[job.label for job in jobs]}")
    records, models = [], []
    split = ctx.emulator is not None and steps * rounds > 1
    # progress in pipeline steps, the unit of time here: one checked step per job, then warm-up and rounds (and
    # the virtual pass)
    per_round = len(jobs) * steps
    units = len(jobs) * (1 + warmup + split) + rounds * per_round
    with ctx.paused(split):
        for i, job in enumerate(jobs):
            record, model = check_step(ctx, setup, job)
            records.append(record)
            models.append(model)
            ctx.progress(i + 1, units, "checked " + job.label)
        candidates = {job.label: _Candidate(ctx, setup, job, warmup) for job in jobs}

        def timed(done: int, total: int) -> None:  # after the warm-up (done = 0), then after each round
            ctx.progress(units - (total - done) * per_round - split * len(jobs), units,
                         f"timing every schedule, round {done}/{total}")

        results = compare(candidates, warmup=warmup, steps=steps, rounds=rounds, trim=trim, sync=ctx.barrier,
                          on_round=timed, label=None if split else label)
    if split:  # one step per job on the emulated cluster's clock
        for candidate in candidates.values():
            candidate.virtual_pass = True
        virtual = compare(candidates, warmup=0, steps=1, rounds=1, trim=0, sync=ctx.barrier, label=label)
        ctx.progress(units, units, "one step per schedule on the emulated cluster")
    for record, (label, candidate) in zip(records, candidates.items()):
        record["bench"] = results[label].to_dict()
        if split:
            record["bench"]["virtual"] = virtual[label].virtual.to_dict()
        record.update(candidate.summary())
    return records, models


def replayed_steps(clocks, jobs, label: str = "schedules") -> dict[str, float]:
    """Each job's step (its slowest rank) in a replay of the run (``Emulator.sensitivity``), as
    ``measure_schedules(..., label=label)`` timed it on the emulated cluster's clock."""
    from toolkit.runtime.bench import replayed
    return {job: replayed(clocks, f"{label}/{job}") for job in jobs}


def wait_spans(waits: list[dict], rank: int) -> list[dict]:
    """A record's receive ``waits`` as timeline spans (kind ``"wait"``) of ``rank``, to draw beside its ops."""
    return [{"rank": rank, "kind": "wait", "start": w["start"], "end": w["start"] + w["seconds"],
             "meta": {"stage": w["stage"], "mb": w["mb"], "msg": w["msg"]}} for w in waits if "start" in w]
