"""Lesson 03, per rank: does DualPipeV stagger expert-parallel and pipeline traffic on the links? (emulated cluster)

    4 ranks = pp 2 pipeline ranks x ep 2 expert-parallel replicas, one emulated node
    the tiny GPT's MoE variant, every MoE layer expert parallel over the ep group (``toolkit.moe.expert_parallel``),
    run by interleaved 1F1B and by DualPipeV (both 2 x pp stages), one step each after a warm-up, virtual time:
        the step, and per kind of transfer (pipeline p2p, EP all-to-all) the link's busy time and the time
        transfers waited in the rank's queue behind another one (start - issue)
    at the toy's own shapes and matched to Mixtral 8x7B's expert layers (``toolkit.models.matched.moe_layer_op``)

Each rank's p2p and all-to-alls share its NVLink queue on the emulated cluster (``toolkit.runtime.emulator``), so
two transfers that meet wait for each other: the seed's claim is that DualPipeV's order keeps them apart.
"""
from __future__ import annotations

import torch

from toolkit.models import catalog, matched
from toolkit.data import batches
from toolkit.models import GPT, lm_loss, preset, split_stages
from toolkit.moe import expert_parallel
from toolkit.pipeline.executor import PipelineExecutor
from toolkit.pipeline.schedule import check_layout, make_schedule
from toolkit.runtime.config import Param, common, resolve

WORLD_SIZE = 4  # the generated bad-input tests validate at this size
SCHEDULES = ("interleaved", "dualpipev")
PARAMS = {**common("model", "n_layer", "m", "micro_batch"),
          "stands_for": Param(str, "the real MoE the matched run times the toy's expert layers as",
                              choices=("mixtral-8x7b",))}
PRESETS = {"smoke": {"model": "smoke", "n_layer": 4, "m": 4, "micro_batch": 2, "stands_for": "mixtral-8x7b"},
           "default": {"model": "smoke", "n_layer": 4, "m": 8, "micro_batch": 2, "stands_for": "mixtral-8x7b"},
           "full": {"model": "default", "n_layer": 8, "m": 16, "micro_batch": 4, "stands_for": "mixtral-8x7b"}}
KINDS = {"isend": "p2p", "all_to_all_single": "all-to-all"}


def validate(cfg: dict, world_size: int) -> dict:
    cfg = resolve(cfg, PRESETS, PARAMS)
    if world_size != 4:
        raise ValueError(f"world_size={world_size}: the link experiment runs on 4 ranks (pp 2 x ep 2)")
    check_layout("dualpipev", 2, cfg["m"], cfg["n_layer"])  # pp = 2: the schedule says what it needs
    return cfg


def run(ctx, cfg: dict) -> dict:
    emu = ctx.emulator
    if emu is None:
        raise ValueError("the link experiment needs the emulated cluster: launch(..., cluster=...)")
    grid = ctx.make_grid(pp=2, dp=2)
    mc = preset(cfg["model"], n_layer=cfg["n_layer"], n_expert=4, top_k=2)
    x, y = next(batches(cfg["m"] * cfg["micro_batch"], mc.seq_len, 1, seed=1, rank=grid.rank_in("dp"), world=2,
                        device=ctx.device))
    inputs, targets = list(x.split(cfg["micro_batch"])), list(y.split(cfg["micro_batch"]))
    real = catalog.get(cfg["stands_for"])
    toy_op = matched.moe_layer_op(cfg["micro_batch"] * mc.seq_len, mc.d_model, mc.d_ff, mc.top_k, 2,
                                  emu.cluster.float_bytes)
    scales = matched.matched_scales(toy_op, matched.spec_moe_op(real, real.seq_len, 2))
    return {"pp_rank": grid.rank_in("pp"), "stands_for": cfg["stands_for"], "scales": scales,
            "cluster": emu.cluster.name, "link": emu.cluster.intra.name,
            "own shapes": _steps(ctx, cfg, mc, grid, inputs, targets, {}),
            "matched": _steps(ctx, cfg, mc, grid, inputs, targets, scales)}


def _steps(ctx, cfg, mc, grid, inputs, targets, scales: dict) -> dict:
    """One step per schedule on the virtual clock (``scales``: the workload-matched mode)."""
    emu, r = ctx.emulator, grid.rank_in("pp")
    out = {}
    for name in SCHEDULES:
        schedule = make_schedule(name, 2, cfg["m"])
        torch.manual_seed(0)
        model = GPT(mc).to(ctx.device)
        expert_parallel(model, group=grid.group("dp"))
        stages = split_stages(model, schedule.n_stages)
        ex = PipelineExecutor(schedule, r, {s: stages[s] for s in schedule.stages_of(r)}, lm_loss,
                              (cfg["micro_batch"], mc.seq_len, mc.d_model), device=ctx.device,
                              peers=grid.ranks("pp"), group=grid.group("pp"))
        ex.step(inputs, targets)  # warm-up
        model.zero_grad(set_to_none=True)
        ctx.barrier()
        tag = f"links:{name}:{'matched' if scales else 'own'}"
        t0 = emu.now()
        with ctx.ledger.tag(tag), emu.scaled(**scales):
            loss = ex.step(inputs, targets)
            emu.synchronize()
        queued, busy = {}, {}
        for c in emu.comms:
            if c["tag"] == tag and c["local_end"] is not None and c["op"] in KINDS:
                kind = KINDS[c["op"]]
                queued[kind] = queued.get(kind, 0.0) + (c["start"] - c["issue"])
                busy[kind] = busy.get(kind, 0.0) + (c["local_end"] - c["start"])
        out[name] = {"step_s": emu.now() - t0, "loss": loss, "queued_s": queued, "busy_s": busy}
        ctx.progress(SCHEDULES.index(name) + 1, len(SCHEDULES), f"{name}, {'matched' if scales else 'own shapes'}")
    return out
