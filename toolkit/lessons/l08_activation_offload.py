"""Lesson 08, per rank: pipeline-aware activation offload under 1F1B on p = world_size ranks.

The tiny GPT is cut into p stages (``toolkit.models.split_stages``) and run with the pipeline helper's
1F1B schedule and executor (``toolkit.pipeline``). Each variant runs the same step on the same
micro-batches::

    none        nothing moves (the baseline; its saved bytes are counted the same way)
    <policy>    ActivationOffloader with that policy: all, attention, mlp, norms, or one module kind
    save_on_cpu torch.autograd.graph.save_on_cpu around each forward (no prefetch, not pipeline aware)

and reports, per rank: resident saved-activation bytes after every action and their peak (storage
ledger, each storage once), the whole rank's tensor peak (MemoryTracker: params, grads, activations,
buffers in flight), host-store bytes, copies made, late reloads, step time, and whether every
parameter gradient is bitwise equal to the baseline's.
"""
from __future__ import annotations

import contextlib
import statistics

import torch

from toolkit.memory.offload import ALL_KINDS, POLICIES, ActivationOffloader, resolve_policy
from toolkit.models import GPT, lm_loss, preset
from toolkit.pipeline.executor import PipelineExecutor, key_of
from toolkit.pipeline.harness import gpt_micro_batches, gpt_stages
from toolkit.pipeline.schedule import one_f_one_b
from toolkit.runtime.bench import measure
from toolkit.runtime.memory import MemoryTracker
from toolkit.runtime.config import require_positive_ints

PRESETS = {
    "smoke": {"model": "smoke", "n_layer": 4, "m": 4, "micro_batch": 2, "bench_steps": 2, "bench_rounds": 3},
    "default": {"model": "default", "n_layer": 4, "m": 8, "micro_batch": 4, "bench_steps": 2, "bench_rounds": 5},
    "full": {"model": "full", "n_layer": 12, "m": 16, "micro_batch": 4, "bench_steps": 5, "bench_rounds": 3},
}
DEFAULT_POLICIES = ["all", "attention", "mlp", "norms", "qkv", "core", "proj", "ln1", "ln2", "fc1", "act", "fc2"]
TIMED = ["none", "all", "attention", "save_on_cpu"]


def validate(cfg: dict, world_size: int) -> dict:
    name = cfg.get("preset", "smoke")
    if name not in PRESETS:
        raise ValueError(f"preset={name!r} is not known; allowed: {sorted(PRESETS)}")
    allowed = {"preset", "model", "n_layer", "m", "micro_batch", "seq_len", "policies", "bench_steps", "bench_rounds",
               "prefetch"}
    unknown = sorted(set(cfg) - allowed)
    if unknown:
        raise ValueError(f"unknown cfg keys {unknown}; allowed: {sorted(allowed)}")
    out = {"preset": name, "policies": DEFAULT_POLICIES, "prefetch": True, **PRESETS[name], **cfg}
    model = preset(out["model"])
    out.setdefault("seq_len", model.seq_len)
    require_positive_ints(out, "n_layer", "m", "micro_batch", "seq_len", "bench_steps", "bench_rounds")
    if world_size < 2:
        raise ValueError(f"world_size={world_size}: a pipeline needs at least 2 ranks")
    if out["n_layer"] % world_size:
        raise ValueError(f"n_layer={out['n_layer']} must be divisible by world_size={world_size} (one stage per rank)")
    if out["m"] < world_size:
        raise ValueError(f"m={out['m']} micro-batches: 1F1B needs m >= world_size={world_size}")
    if out["seq_len"] > model.seq_len:
        raise ValueError(f"seq_len={out['seq_len']} exceeds the {out['model']} model's {model.seq_len}")
    if isinstance(out["policies"], str) or not out["policies"]:
        raise ValueError(f"policies must be a non-empty list of policies, got {out['policies']!r}")
    for policy in out["policies"]:
        resolve_policy(policy)  # raises naming the unknown modules
    return out


class OffloadingExecutor(PipelineExecutor):
    """The pipeline executor with an offloader's hooks around every forward and backward (B and I alike).

    ``forward_context(key)`` (a function) wraps each forward instead when there is no offloader (e.g.
    ``save_on_cpu``); ``on_action(action)`` runs after each action (sampling).
    """

    def __init__(self, *args, offloader: ActivationOffloader | None = None, forward_context=None, on_action=None,
                 **kwargs):
        super().__init__(*args, **kwargs)
        self.offloader, self.context_fn, self.on_action = offloader, forward_context, on_action

    def forward_context(self, a):
        if a.op != "F":  # an R rebuilds activations right before their backward: nothing to send away
            return contextlib.nullcontext()
        if self.offloader:
            return self.offloader.forward(key_of(a))
        return self.context_fn(key_of(a)) if self.context_fn else contextlib.nullcontext()

    def before_backward(self, a) -> None:
        if self.offloader:
            self.offloader.backward_begin(key_of(a))

    def after_backward(self, a) -> None:
        if self.offloader:
            self.offloader.backward_end(key_of(a))

    def after_action(self, action) -> None:
        if self.on_action:
            self.on_action(action)


def rank_order(schedule, rank: int) -> list[tuple[str, tuple[int, int, int]]]:
    """This rank's forwards and backwards as (op, (stage, mb, chunk)), in execution order."""
    return [(p.op, (p.stage, p.mb, p.chunk)) for a in schedule.ranks[rank] for p in a.parts if p.op in ("F", "B", "I")]


def run(ctx, cfg: dict) -> dict:
    p, rank = ctx.world_size, ctx.rank
    ctx.make_grid(pp=p)
    model_cfg = preset(cfg["model"], n_layer=cfg["n_layer"], seq_len=cfg["seq_len"])
    torch.manual_seed(0)
    model = GPT(model_cfg).to(ctx.device)
    schedule = one_f_one_b(p, cfg["m"])
    modules = gpt_stages(model, schedule, rank)
    params = [q for mod in modules.values() for q in mod.parameters()]
    inputs, targets = gpt_micro_batches(cfg["m"], cfg["micro_batch"], cfg["seq_len"], seed=1)
    inputs, targets = [x.to(ctx.device) for x in inputs], [y.to(ctx.device) for y in targets]
    order = rank_order(schedule, rank)
    act_shape = (cfg["micro_batch"], cfg["seq_len"], model_cfg.d_model)

    def make(variant: str, on_action=None) -> tuple[OffloadingExecutor, ActivationOffloader | None]:
        off = None
        if variant != "save_on_cpu":
            off = ActivationOffloader(modules, order, policy=variant, prefetch=cfg["prefetch"])
        ctx_fn = (lambda key: torch.autograd.graph.save_on_cpu(pin_memory=ctx.device.type == "cuda")) \
            if variant == "save_on_cpu" else None
        ex = OffloadingExecutor(schedule, rank, modules, lm_loss, act_shape, device=ctx.device, offloader=off,
                                forward_context=ctx_fn, on_action=on_action)
        return ex, off

    def step(ex) -> None:
        for q in params:
            q.grad = None
        ex.step(inputs, targets)

    variants = ["none"] + [v for v in cfg["policies"] if v != "none"] + ["save_on_cpu"]
    rows, samples, reference = [], {}, None
    for i, variant in enumerate(variants):
        trace: list[dict] = []
        ex, off = make(variant, on_action=None)
        if off is not None:
            ex.on_action = lambda a, off=off, trace=trace: trace.append(
                {"action": str(a), "act": off.meter.current()["act"], "host": off.meter.current()["host"]})
        if ctx.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        with MemoryTracker(list(modules.values())) as mem:
            step(ex)
            mem.mark("end")
        if off is not None:
            off.synchronize()
        grads = [q.grad.clone() for q in params]
        if reference is None:
            reference = grads
        row = {"variant": variant,
               "kinds": sorted(resolve_policy(variant)) if variant != "save_on_cpu" else ["(every saved tensor)"],
               "grads_bitwise_equal": all(torch.equal(a, b) for a, b in zip(grads, reference)),
               "tracker_peak_total": mem.peak["total"], "tracker_peak_act": mem.max_by_category["act"],
               "tracker_peak_host": mem.max_by_category["host"], "param_bytes": mem.peak["param"]}
        if ctx.device.type == "cuda":
            row["cuda_max_memory_allocated"] = torch.cuda.max_memory_allocated()
        if off is not None:
            row |= {"resident_peak": off.meter.max_by_category["act"], "host_peak": off.meter.max_by_category["host"],
                    **off.stats}
            off.remove()
            samples[variant] = trace
        rows.append(row)
        ctx.progress(i + 1, len(variants) + cfg["bench_rounds"], f"variant {variant}")

    base = rows[0]
    for row in rows:
        for key in ("resident_peak", "tracker_peak_total", "tracker_peak_act"):
            if key in row and base.get(key):
                row[key.replace("peak", "reduction")] = 1 - row[key] / base[key]

    # ---- step time: offload costs copies (on CPU, synchronous memcpy); variants interleaved per round --------
    timed = [v for v in TIMED if v in variants]
    runners = {v: make(v) for v in timed}
    round_means: dict[str, list[float]] = {v: [] for v in timed}
    for r in range(cfg["bench_rounds"]):
        for v in timed:
            ex = runners[v][0]
            res = measure(lambda: step(ex), warmup=1 if r == 0 else 0, steps=cfg["bench_steps"], rounds=1)
            round_means[v].append(res.mean_s)
        ctx.progress(len(variants) + r + 1, len(variants) + cfg["bench_rounds"], "timing")
    for _, off in runners.values():
        if off is not None:
            off.remove()
    times = {v: statistics.median(ms) for v, ms in round_means.items()}
    for row in rows:
        if row["variant"] in times:
            row["step_s"] = times[row["variant"]]
            row["step_ratio"] = times[row["variant"]] / times["none"]

    return {"rank": rank, "p": p, "m": cfg["m"], "stages": sorted(modules), "order": [f"{op}{k[1]}" for op, k in order],
            "n_params_stage": sum(q.numel() for q in params), "rows": rows, "samples": samples,
            "model": {"n_layer": model_cfg.n_layer, "d_model": model_cfg.d_model, "seq_len": cfg["seq_len"],
                      "micro_batch": cfg["micro_batch"]},
            "copies": "cuda side streams + pinned pool" if ctx.device.type == "cuda" else "synchronous copy_ (CPU)"}
