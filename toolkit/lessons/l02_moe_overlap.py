"""Lesson 02, per rank: MoE all-to-all overlap across micro-batches (``toolkit.moe.overlap``).

    model      the tiny MoE GPT, every MoE layer expert parallel over all ranks (``toolkit.moe.expert_parallel``)
    data       one step's batch of real text, split into m micro-batches
    check      one step each way on identical copies: serial (each micro-batch's forward+backward in turn),
               overlapped (forward-with-forward: forwards interleaved at every all-to-all, one backward) and fb
               (forward-under-backward: micro-batch i's forward interleaved with i-1's backward, the form combined
               1F1B and DualPipe use): losses and every gradient compared bit for bit with serial; the ledger's
               all-to-all bytes; the activation bytes autograd holds at once
    timing     bench.compare of the two steps; exposed communication = seconds the rank is blocked in the
               all-to-alls (issue + wait, forward and backward) and in the plan's count exchange, per step
    traced     one step each way with every span on the timeline (the Gantt charts)
    emulated   one step each way on the emulated cluster's clock, at the toy's shapes and matched to a real MoE
    model      the two-resource cost model fed with the rank's traced serial step's durations (the count
               exchange included, embedding and head left out), and on rank 0 the comm/compute ratio sweep

The source's own setting, Mixtral's MoE layer at its true shapes on fake tensors, is ``l02_true_shapes`` (in the
notebook's process, no ranks launched).
"""
from __future__ import annotations

import copy
import statistics
import time

import torch

from toolkit.data import batches
from toolkit.models import GPT, preset
from toolkit.moe import expert_parallel
from toolkit.moe.overlap import SCHEDULES, Tracer, activation_bytes, ratio_sweep, simulate, step
from toolkit.runtime.emulator import what_if
from toolkit.runtime.bench import compare
from toolkit.runtime.config import Param, common, require_divisible, resolve

PARAMS = {
    **common("model", "n_layer", "seq_len", "m", "micro_batch", "warmup", "bench_steps", "rounds", "seed", "n_expert",
             "top_k"),
    "d_ff": Param(int, "hidden size of each expert's MLP (0: 4 x d_model)", ge=0),
    "ratios": Param(list, "comm/compute ratios of the cost-model sweep", of=float, gt=0),
    "stands_for": Param(str, "the real MoE whose layers the emulated cluster times the toy's as (the workload-matched "
                             "mode)", choices=("mixtral-8x7b",)),
}
_SWEEP = [0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0]
PRESETS = {
    "smoke": dict(model="smoke", n_layer=2, seq_len=32, m=4, micro_batch=1, n_expert=4, top_k=2, d_ff=0, warmup=1,
                  bench_steps=2, rounds=3, seed=0, ratios=_SWEEP, stands_for="mixtral-8x7b"),
    "default": dict(model="default", n_layer=2, seq_len=64, m=8, micro_batch=1, n_expert=4, top_k=2, d_ff=0, warmup=1,
                    bench_steps=2, rounds=3, seed=0, ratios=_SWEEP, stands_for="mixtral-8x7b"),
    "full": dict(model="full", n_layer=12, seq_len=1024, m=4, micro_batch=4, n_expert=64, top_k=8, d_ff=0, warmup=3,
                 bench_steps=5, rounds=5, seed=0, ratios=_SWEEP, stands_for="mixtral-8x7b"),
}
PHASES = [("check", 3), ("timing", 6), ("traced", 1), ("emulated", 2)]


def validate(cfg: dict, world_size: int) -> dict:
    cfg = resolve(cfg, PRESETS, PARAMS)
    require_divisible("n_expert", cfg["n_expert"], world_size, "world_size", "each rank owns n_expert/world_size experts")
    if cfg["top_k"] > cfg["n_expert"]:
        raise ValueError(f"top_k={cfg['top_k']} must be in 1..n_expert={cfg['n_expert']}")
    limit = preset(cfg["model"]).seq_len
    if cfg["seq_len"] > limit:
        raise ValueError(f"seq_len={cfg['seq_len']} must be <= {limit} (the position table of model={cfg['model']!r})")
    return cfg


def build(cfg: dict):
    """The tiny MoE GPT (the same weights on every rank), expert parallel over the world."""
    torch.manual_seed(cfg["seed"])
    overrides = {"d_ff": cfg["d_ff"]} if cfg["d_ff"] else {}
    model = GPT(preset(cfg["model"], n_layer=cfg["n_layer"], n_expert=cfg["n_expert"], top_k=cfg["top_k"], **overrides))
    expert_parallel(model, codec="none")
    return model


def micro_batches(ctx, cfg: dict) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's step batch of real text as ``m`` micro-batches of ``micro_batch`` sequences."""
    m = cfg["m"]
    x, y = next(batches(m * cfg["micro_batch"], cfg["seq_len"], 1, seed=cfg["seed"] + 1, rank=ctx.rank,
                        world=ctx.world_size, device=ctx.device))
    return [(x[i::m].contiguous(), y[i::m].contiguous()) for i in range(m)]


def check(ctx, cfg: dict, mbs) -> dict:
    """One step each way on identical models: losses and gradients bitwise, bytes, activation memory."""
    base = build(cfg)
    models = {s: copy.deepcopy(base) for s in SCHEDULES}
    losses, memory = {}, {}
    for s in SCHEDULES:
        saved = {}
        with ctx.ledger.tag(f"check/{s}"):
            losses[s] = step(models[s], mbs, s, saved=saved)
        memory[s] = {"saved_bytes": saved["bytes"]}
    grads = {s: dict((n, p.grad) for n, p in models[s].named_parameters()) for s in SCHEDULES}
    names = list(grads["serial"])
    missing = [n for n in names if any(grads[s][n] is None for s in SCHEDULES)]
    others = [s for s in SCHEDULES if s != "serial"]
    bitwise = {s: all(torch.equal(grads["serial"][n], grads[s][n]) for n in names if n not in missing) for s in others}
    max_diff = {s: max((float((grads["serial"][n] - grads[s][n]).abs().max()) for n in names if n not in missing),
                       default=0.0) for s in others}
    a2a = {s: ctx.ledger.total("sent_bytes", tag=f"check/{s}", op="all_to_all_single") for s in SCHEDULES}
    calls = {s: sum(1 for r in ctx.ledger.records if r.tag == f"check/{s}" and r.op == "all_to_all_single")
             for s in SCHEDULES}
    return {"losses": losses, "losses_bitwise": {s: losses["serial"] == losses[s] for s in others},
            "grads_bitwise": bitwise, "grads_max_abs_diff": max_diff, "params_without_grad": missing,
            "a2a_sent_bytes": a2a, "a2a_calls": calls, "memory": memory}


def timing(ctx, cfg: dict, mbs) -> dict:
    models = {s: build(cfg) for s in SCHEDULES}
    exposed = {s: [] for s in SCHEDULES}

    def candidate(s: str):
        def run():
            models[s].zero_grad(set_to_none=True)
            tracer = Tracer(s)
            step(models[s], mbs, s, tracer)
            exposed[s].append(dict(tracer.exposed))
        return run
    with ctx.ledger.tag("timing"):
        times = compare({s: candidate(s) for s in SCHEDULES}, warmup=cfg["warmup"], steps=cfg["bench_steps"],
                        rounds=cfg["rounds"], sync=ctx.barrier, on_round=lambda d, t: ctx.progress(d, t, "timing"))
    n = cfg["bench_steps"] * cfg["rounds"]
    timed = {s: v[-n:] for s, v in exposed.items()}
    return {"step_s": {s: times[s].median_s for s in SCHEDULES}, "step_mean_s": {s: times[s].mean_s for s in SCHEDULES},
            "bench": {s: times[s].to_dict() for s in SCHEDULES},
            "exposed_a2a_s": {s: statistics.median(e["a2a"] for e in timed[s]) for s in SCHEDULES},
            "exposed_plan_s": {s: statistics.median(e["plan"] for e in timed[s]) for s in SCHEDULES},
            "exposed_a2a_all_s": {s: [e["a2a"] for e in timed[s]] for s in SCHEDULES}, "models": models}


def traced(ctx, cfg: dict, mbs, models) -> dict:
    """One step each way with every span on the timeline (after a barrier, so the ranks start together)."""
    out = {}
    for s in SCHEDULES:
        models[s].zero_grad(set_to_none=True)
        ctx.barrier()
        tracer = Tracer(s, ctx.timeline)
        t0 = ctx.timeline.now()
        step(models[s], mbs, s, tracer)
        out[s] = {"step_s": ctx.timeline.now() - t0, "exposed": dict(tracer.exposed)}
    ctx.barrier()
    return out


def emulated(ctx, cfg: dict, mbs, models) -> dict | None:
    """One step each way on the emulated cluster's clock (virtual time; deterministic, so one step is the time):
    at the toy's own shapes and matched to ``cfg["stands_for"]`` (``toolkit.models.catalog``: its expert GEMMs
    and all-to-all bytes at ep = world size). Step time and exposed communication, as ``traced`` measures them."""
    from toolkit.models import catalog, matched
    emu = ctx.emulator
    if emu is None:
        return None
    ctx.reserve_for_replay()  # the bar's last quarter: the run replayed on other figures
    mc, real = models["serial"].cfg, catalog.get(cfg["stands_for"])
    tokens = cfg["micro_batch"] * cfg["seq_len"]
    toy_op = matched.moe_layer_op(tokens, mc.d_model, mc.d_ff, mc.top_k, ctx.world_size, emu.cluster.float_bytes)
    real_op = matched.spec_moe_op(real, real.seq_len, ctx.world_size)
    scales = matched.matched_scales(toy_op, real_op)
    link = "intra" if emu.cluster.per_node(ctx.world_size) >= ctx.world_size else "inter"  # what the EP group spans
    out = {"cluster": emu.cluster.name, "gpu": emu.cluster.gpu.name, "link": getattr(emu.cluster, link).name,
           "stands_for": cfg["stands_for"], "scales": scales, "real_op": matched.op_times(real_op, emu.cluster, link)}
    for view, factors in (("own shapes", {}), ("matched", scales)):
        out[view] = {}
        with emu.scaled(**factors):
            for s in SCHEDULES:
                models[s].zero_grad(set_to_none=True)
                ctx.barrier()
                tracer = Tracer(s, clock=emu.now)
                t0 = emu.now()
                with emu.window(f"{view}/{s}"):
                    step(models[s], mbs, s, tracer)
                out[view][s] = {"step_s": emu.now() - t0, "exposed": dict(tracer.exposed)}
        ctx.progress(1 if view == "own shapes" else 2, 2, f"emulated: {view}")
    out["sensitivity"] = ctx.replay(matched_shares, grid=what_if(cfg["preset"]))
    return out


def matched_shares(clocks) -> dict[str, float]:
    """From a replay of the run (``Emulator.sensitivity``): each schedule's matched step (slowest rank) and the
    all-to-all time it exposes (worst rank), and fb's exposed share of its step."""
    out = {}
    for s in SCHEDULES:
        w = [c.window(f"matched/{s}", ops={"all_to_all_single"}) for c in clocks]
        out[f"{s}_s"], out[f"{s}_exposed_s"] = max(x["s"] for x in w), max(x["exposed_s"] for x in w)
    out["fb_share"] = out["fb_exposed_s"] / out["fb_s"]
    out["serial_share"] = out["serial_exposed_s"] / out["serial_s"]
    return out


def durations(spans: list[dict], schedule: str) -> dict:
    """Mean seconds per micro-batch and layer of each forward piece in one traced step (the count exchange
    "plan" is forward only and carries no direction), and what the cost model leaves out: seconds per step
    of embedding and head (forward and backward)."""
    everything = [s for s in spans if s["meta"].get("schedule") == schedule]
    mine = [s for s in everything if s["meta"].get("dir") == "F"]
    mean = lambda xs: statistics.fmean(xs) if xs else 0.0
    pick = lambda kind, op=None, among=mine: [s["end"] - s["start"] for s in among if s["kind"] == kind
                                              and (op is None or s["meta"].get("op") == op)]
    return {"attn": mean(pick("attn")), "experts": mean(pick("experts")),
            "dispatch": mean(pick("wait", "dispatch")) + mean(pick("issue", "dispatch")),
            "combine": mean(pick("wait", "combine")) + mean(pick("issue", "combine")),
            "plan": mean(pick("plan", among=everything)),
            "embed_head_step": sum(pick("embed", among=everything)) + sum(pick("head", among=everything))}


def run(ctx, cfg: dict) -> dict:
    clock = [time.perf_counter()]
    lap = lambda: clock.append(time.perf_counter()) or clock[-1] - clock[-2]
    mbs = micro_batches(ctx, cfg)
    with ctx.paused():  # the real run: the emulated cluster's clock is read in emulated() only
        ctx.phase("check")
        out = {"rank": ctx.rank, "world_size": ctx.world_size, "config": cfg,
               "tokens_per_mb": cfg["micro_batch"] * cfg["seq_len"], "check": check(ctx, cfg, mbs)}
        phase_s = {"check": lap()}
        ctx.phase("timing")
        t = timing(ctx, cfg, mbs)
        models = t.pop("models")
        out["timing"] = t
        phase_s["timing"] = lap()
        ctx.phase("traced")
        ctx.timeline.spans.clear()
        out["traced"] = traced(ctx, cfg, mbs, models)
        phase_s["traced"] = lap()
    ctx.phase("emulated")
    out["emulated"] = emulated(ctx, cfg, mbs, models)
    phase_s["emulated"] = lap()
    out["phase_s"] = phase_s
    out["spans"] = ctx.timeline.to_json()
    d = durations(out["spans"], "serial")
    mc = models["serial"].cfg
    out["durations"] = d
    bwd = 2.0  # backward ≈ 2 x forward compute
    out["cost_model"] = {s: simulate(d["attn"], d["experts"], d["dispatch"], d["combine"], mc.n_layer, cfg["m"], s,
                                     bwd, plan=d["plan"]) for s in SCHEDULES}
    out["sweep"] = ratio_sweep(cfg["ratios"], layers=mc.n_layer, m=cfg["m"]) if ctx.rank == 0 else None
    tokens = cfg["micro_batch"] * cfg["seq_len"]
    out["activation_model_bytes"] = activation_bytes(tokens, mc.d_model, mc.d_ff, mc.top_k, mc.n_layer,
                                                     cfg["seq_len"], mc.n_head)
    out["model"] = {"d_model": mc.d_model, "d_ff": mc.d_ff, "n_layer": mc.n_layer, "n_head": mc.n_head,
                    "n_expert": mc.n_expert, "top_k": mc.top_k}
    return out
