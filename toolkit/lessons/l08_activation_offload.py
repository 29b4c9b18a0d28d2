"""Lesson 08, per rank: pipeline-aware activation offload under 1F1B on p = world_size ranks.

The tiny GPT is cut into p stages and run with the 1F1B schedule through the pipeline executor with the
offloader's hook (``toolkit.memory.offload.Offload``). Each variant runs the same
step on the same micro-batches::

    none            nothing moves (the baseline; its saved bytes are counted the same way)
    <policy>        ActivationOffloader with that policy, every micro-batch: all, attention, mlp, norms, or one
                    module kind
    all-long-lived  policy all, only the micro-batches whose backward comes more than ``skip_within`` actions
                    after their forward (``long_lived``): later ranks offload less, the last rank nothing
    all-budget      policy all within Megatron's per-rank budget (``per_rank_budget``): each forward sheds
                    1 - 1/k of its bytes, k the forwards the rank holds at its peak (1F1B: p - r), so every
                    rank's peak comes down toward the last rank's, and the last rank copies nothing
    save_on_cpu     torch.autograd.graph.save_on_cpu around each forward (no prefetch, not pipeline aware)

and reports, per rank: resident saved-activation bytes after every action and their peak (storage
ledger, each storage once), the whole rank's tensor peak (MemoryTracker: params, grads, activations,
buffers in flight), host-store bytes, copies made, late reloads, and whether every parameter gradient is
bitwise equal to the baseline's. Then ``TIMED`` variants are timed side by side (``bench.compare``), and, on an
emulated cluster (``launch(..., cluster=)``), once more on its clock with the copies on the host link, at the
toy's shapes and matched to ``stands_for`` (``emulated``).
"""
from __future__ import annotations

import torch

from toolkit.models import catalog, matched
from toolkit.memory.offload import (ALL_KINDS, POLICIES, ActivationOffloader, Offload, SaveOnCPU, in_flight,
                                    long_lived, per_rank_budget, resolve_policy, schedule_order)
from toolkit.models import lm_loss, preset
from toolkit.pipeline.executor import ExecutorHook, PipelineExecutor
from toolkit.pipeline.harness import PipelineSetup
from toolkit.pipeline.schedule import one_f_one_b
from toolkit.runtime.bench import compare, replayed
from toolkit.runtime.config import Param, common, require_divisible, require_ranks, resolve
from toolkit.runtime.memory import MemoryTracker

DEFAULT_POLICIES = ["all", "attention", "mlp", "norms", "qkv", "core", "proj", "ln1", "ln2", "fc1", "act", "fc2"]
LONG_LIVED, BUDGET = "all-long-lived", "all-budget"
TIMED = ["none", "all", LONG_LIVED, BUDGET, "attention", "save_on_cpu"]
HOST_LINK = ("d2h", "h2d")  # the emulator's copy engines, one each way
PARAMS = {**common("model", "n_layer", "seq_len", "m", "micro_batch", "warmup", "bench_steps", "rounds"),
          "policies": Param(list, "offload policies to run (named policies or module kinds)", of=str,
                            choices=tuple(POLICIES) + ALL_KINDS),
          "prefetch": Param(bool, "reload each group one group ahead of its backward"),
          "skip_within": Param(int, "all-long-lived: keep micro-batches whose backward is within this many actions "
                                    "of their forward", ge=0),
          "stands_for": Param(str, "the real model whose layers the emulated cluster times the toy's as (the "
                                   "workload-matched mode)", choices=("llama2-7b", "llama2-13b", "llama2-70b"))}
PRESETS = {
    "smoke": {"model": "smoke", "n_layer": 4, "seq_len": 32, "m": 4, "micro_batch": 2, "policies": DEFAULT_POLICIES,
              "prefetch": True, "skip_within": 1, "warmup": 1, "bench_steps": 1, "rounds": 3,
              "stands_for": "llama2-7b"},
    "default": {"model": "default", "n_layer": 4, "seq_len": 128, "m": 8, "micro_batch": 2,
                "policies": DEFAULT_POLICIES, "prefetch": True, "skip_within": 1, "warmup": 1, "bench_steps": 2,
                "rounds": 3, "stands_for": "llama2-7b"},
    "full": {"model": "full", "n_layer": 12, "seq_len": 1024, "m": 16, "micro_batch": 4, "policies": DEFAULT_POLICIES,
             "prefetch": True, "skip_within": 1, "warmup": 2, "bench_steps": 5, "rounds": 3,
             "stands_for": "llama2-13b"},
}


def validate(cfg: dict, world_size: int) -> dict:
    cfg = resolve(cfg, PRESETS, PARAMS)
    require_ranks(world_size, 2, "a pipeline")
    require_divisible("n_layer", cfg["n_layer"], world_size, "world_size", "one stage per rank")
    if cfg["m"] < world_size:
        raise ValueError(f"m={cfg['m']} micro-batches: 1F1B needs m >= world_size={world_size}")
    longest = preset(cfg["model"]).seq_len
    if cfg["seq_len"] > longest:
        raise ValueError(f"seq_len={cfg['seq_len']} exceeds the {cfg['model']} model's {longest}")
    return cfg


class ResidentBytes(ExecutorHook):
    """After every action: the offloader's resident (``act``) and host bytes, appended to ``trace``."""

    def __init__(self, offloader: ActivationOffloader, trace: list[dict]):
        self.offloader, self.trace = offloader, trace

    def after_action(self, action) -> None:
        now = self.offloader.meter.current()
        self.trace.append({"action": str(action), "act": now["act"], "host": now["host"]})


def run(ctx, cfg: dict) -> dict:
    p, rank = ctx.world_size, ctx.rank
    setup = PipelineSetup.build(cfg["model"], m=cfg["m"], micro_batch=cfg["micro_batch"], n_layer=cfg["n_layer"],
                                seq_len=cfg["seq_len"], device=ctx.device)
    schedule = one_f_one_b(p, cfg["m"])
    order = schedule_order(schedule, rank)
    long = long_lived(order, cfg["skip_within"])
    inputs, targets = setup.inputs, setup.targets
    variants = ["none"] + [v for v in cfg["policies"] if v != "none"] + [LONG_LIVED, BUDGET, "save_on_cpu"]
    budget = None  # all-budget's bytes per forward: sized from what the baseline's forwards saved (below)

    def make(variant: str, trace: list | None = None):
        """(model, modules, executor, offloader) of ``variant`` on a fresh copy of the model; with ``trace``,
        the offloader's bytes after every action are appended to it."""
        model = setup.fresh()
        modules = setup.stages(model, schedule, rank)
        off, hooks = None, [SaveOnCPU()]
        if variant != "save_on_cpu":
            off = ActivationOffloader(modules, order, policy=policy_of(variant),
                                      groups=long if variant == LONG_LIVED else None, prefetch=cfg["prefetch"],
                                      budget_bytes=budget if variant == BUDGET else None)
            hooks = [Offload(off)] + ([ResidentBytes(off, trace)] if trace is not None else [])
        ex = PipelineExecutor(schedule, rank, modules, lm_loss, setup.act_shape, device=ctx.device, hooks=hooks)
        return model, modules, ex, off

    rows, samples, reference = [], {}, None
    with ctx.paused():  # memory and bitwise checks: no virtual time is read here (emulated() below)
        for i, variant in enumerate(variants):
            trace: list[dict] = []
            model, modules, ex, off = make(variant, trace)
            if ctx.device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            with MemoryTracker(list(modules.values())) as mem:
                ex.step(inputs, targets)
                mem.mark("end")
            if off is not None:
                off.synchronize()
            params = [q for module in modules.values() for q in module.parameters()]
            grads = [q.grad.clone() for q in params]
            if reference is None:
                reference = grads
            row = {"variant": variant,
                   "kinds": sorted(resolve_policy(policy_of(variant))) if variant != "save_on_cpu"
                   else ["(every saved tensor)"],
                   "grads_bitwise_equal": all(torch.equal(a, b) for a, b in zip(grads, reference)),
                   "tracker_peak_total": mem.peak["total"], "tracker_peak_act": mem.max_by_category["act"],
                   "tracker_peak_host": mem.max_by_category["host"], "param_bytes": mem.peak["param"]}
            if ctx.device.type == "cuda":
                row["cuda_max_memory_allocated"] = torch.cuda.max_memory_allocated()
            if off is not None:
                row |= {"resident_peak": off.meter.max_by_category["act"],
                        "host_peak": off.meter.max_by_category["host"], "offloaded_groups": len(off.groups), **off.stats}
                off.remove()
                samples[variant] = trace
            if variant == "none":  # one forward saves this much that could leave; the budget sheds 1 - 1/k of it
                chunk_bytes = off.stats["offloadable_bytes"] // sum(op == "F" for op, _ in order)
                budget = per_rank_budget(chunk_bytes, order)
            rows.append(row)
            ctx.progress(i + 1, len(variants) + 2, f"variant {variant}")

    base = rows[0]
    for row in rows:
        for key in ("resident_peak", "tracker_peak_total", "tracker_peak_act"):
            if key in row and base.get(key):
                row[key.replace("peak", "reduction")] = 1 - row[key] / base[key]

    # ---- step time: offload costs copies (on CPU, synchronous memcpy); variants side by side -----------------
    timed = {v: make(v) for v in TIMED if v in variants}

    def stepper(model, ex):
        def go():
            model.zero_grad(set_to_none=True)
            ex.step(inputs, targets)
        return go

    with ctx.part(len(variants), len(variants) + 2, "timing"), ctx.paused():  # wall time only: the clock is emulated()'s
        bench = compare({v: stepper(model, ex) for v, (model, _, ex, _) in timed.items()}, warmup=cfg["warmup"],
                        steps=cfg["bench_steps"], rounds=cfg["rounds"], sync=ctx.barrier, on_round=ctx.progress)
    for _, _, _, off in timed.values():
        if off is not None:
            off.remove()
    for row in rows:
        if row["variant"] in bench:
            row["bench"] = bench[row["variant"]].to_dict()
            row["step_s"] = bench[row["variant"]].mean_s
            row["step_ratio"] = bench[row["variant"]].mean_s / bench["none"].mean_s

    with ctx.part(len(variants) + 1, len(variants) + 2, "emulated"):
        emu = emulated(ctx, cfg, setup, make, stepper)

    return {"rank": rank, "p": p, "m": cfg["m"], "stages": schedule.stages_of(rank),
            "order": [f"{op}{k[1]}" for op, k in order], "skip_within": cfg["skip_within"], "prefetch": cfg["prefetch"],
            "long_lived": sorted(mb for _, mb, _ in long), "in_flight": in_flight(order), "chunk_bytes": chunk_bytes,
            "budget_bytes": budget, "emulated": emu,
            "n_params_stage": sum(q.numel() for module in setup.stages(setup.base, schedule, rank).values()
                                  for q in module.parameters()),
            "rows": rows, "samples": samples,
            "model": {"n_layer": setup.model_cfg.n_layer, "d_model": setup.model_cfg.d_model,
                      "seq_len": cfg["seq_len"], "micro_batch": cfg["micro_batch"]},
            "copies": "cuda side streams + pinned pool" if ctx.device.type == "cuda" else "synchronous copy_ (CPU)"}


def policy_of(variant: str) -> str:
    """The offload policy a variant runs (``all-long-lived`` and ``all-budget`` are ``all`` on fewer groups)."""
    return "all" if variant in (LONG_LIVED, BUDGET) else variant


def emulated(ctx, cfg: dict, setup: PipelineSetup, make, stepper) -> dict | None:
    """The ``TIMED`` variants once more on the emulated cluster's clock, one step each (virtual time is
    deterministic: one step is the time), at the toy's own shapes and matched to ``cfg["stands_for"]`` (its
    layers' GEMMs and activations, ``toolkit.models.matched.dense_layer_op``; the copies carry the matched bytes too).
    Per view and variant: the step, the late reloads (reloads whose wait moved the stream's clock) and their
    wait in all, and the seconds and bytes the host link carried each way (D2H, H2D)."""
    emu = ctx.emulator
    if emu is None:
        return None
    ctx.reserve_for_replay()  # the bar's last quarter: the run replayed on other figures
    real = catalog.get(cfg["stands_for"])
    scales = matched.matched_scales(setup.layer_op(emu.cluster.float_bytes), matched.layer_op(real, real.seq_len))
    out = {"cluster": emu.cluster.name, "gpu": emu.cluster.gpu.name, "host_link": emu.cluster.host.name,
           "stands_for": cfg["stands_for"], "scales": scales}
    for i, (view, factors) in enumerate((("toy", {}), ("matched", scales))):
        runs, link_s, link_bytes = {v: make(v) for v in TIMED}, {}, {}

        def on_link(variant: str, step):
            """``step``, noting the seconds each copy engine was busy during it, and the bytes it carried."""
            def go():
                first = len(emu.comms)
                step()
                copies = [c for c in emu.comms[first:] if c["link"] in HOST_LINK]
                link_s[variant] = {q: sum(c["local_end"] - c["start"] for c in copies if c["link"] == q)
                                   for q in HOST_LINK}
                link_bytes[variant] = {q: sum(c["bytes"] for c in copies if c["link"] == q) for q in HOST_LINK}
            return go

        with emu.scaled(**factors):
            bench = compare({v: on_link(v, stepper(model, ex)) for v, (model, _, ex, _) in runs.items()}, warmup=0,
                            steps=1, rounds=1, trim=0, sync=ctx.barrier, clock="virtual", label=f"emulated {view}")
        out[view] = {}
        for v, (_, _, _, off) in runs.items():
            out[view][v] = {"bench": bench[v].to_dict(), "step_s": bench[v].mean_s, "link_s": link_s[v],
                            "link_bytes": link_bytes[v],
                            **({k: off.stats[k] for k in ("late_reloads", "reload_wait_s", "offloaded_bytes")}
                               if off is not None else {})}
            if off is not None:
                off.remove()
        ctx.progress(i + 1, 2, f"emulated: {view}")
    out["sensitivity"] = ctx.replay(lambda clocks: {v: replayed(clocks, f"emulated matched/{v}") for v in TIMED})
    return out
