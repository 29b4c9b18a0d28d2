"""Lesson 10, per rank: recompute in the pipeline bubble (RiPipe) against plain checkpointing and no recompute,
on 1F1B and on interleaved 1F1B (v stages per rank)::

    1f1b                               every forward keeps its activations: rank r holds p - r micro-batches
    1f1b-recompute-inline              policy "cap": forwards beyond ``keep`` held are checkpointed; the
                                       backward recomputes after its gradient arrives (torch.utils.checkpoint)
    1f1b-recompute-bubble              the same forwards; an R action right before the backward rebuilds them
                                       while the rank waits for the gradient
    1f1b-recompute-bubble-cooldown     policy "cooldown" (bubble-aware): only the forwards whose backward runs
                                       in the rank's cool-down, where it waits anyway; R in that wait
    interleaved                        v stages per rank, no recompute: rank 0 holds (v p + p - 1) / v
    interleaved-recompute-*-cooldown   the cool-down forwards of the interleaved schedule, recomputed inline or
                                       in the bubble (some are early warm-up chunks: the peak drops)

For each: one checked step (loss, gradients bitwise against the same schedule without recompute, saved-
activation bytes over the step), then all timed side by side, round-robin (sharing the machine's load),
with per-action spans. Plus, on rank 0, the dropout check: the recompute restores the RNG state, so masks
(and gradients) repeat; recomputing without it does not. On an emulated cluster (``launch(..., cluster=)``)
every schedule also runs matched to ``stands_for`` (``emulated``): where a rank's wait for a gradient is real
idle time, the question "does the recompute hide in it" has a time answer.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from toolkit.models import catalog, matched
from toolkit.pipeline.harness import Job, PipelineSetup, grads_bitwise_equal, measure_schedules, replayed_steps
from toolkit.pipeline.recompute import RecomputeQueue
from toolkit.pipeline.schedule import interleaved_1f1b, one_f_one_b
from toolkit.runtime.config import Param, common, require_divisible, resolve

WORLD_SIZE = 4
PARAMS = {**common("model", "n_layer", "m", "micro_batch", "warmup", "bench_steps", "rounds"),
          "keep": Param(int, "micro-batches whose activations a rank may hold at once (policy 'cap')", ge=1),
          "v": Param(int, "stages per rank of the interleaved schedule", ge=2),
          "stands_for": Param(str, "the real model whose layers the emulated cluster times the toy's as (the "
                                   "workload-matched mode)", choices=("llama2-7b", "llama2-13b", "llama2-70b"))}
PRESETS = {
    "smoke": {"model": "smoke", "n_layer": 8, "m": 8, "micro_batch": 2, "keep": 2, "v": 2, "warmup": 0,
              "bench_steps": 1, "rounds": 3, "stands_for": "llama2-7b"},
    "default": {"model": "default", "n_layer": 8, "m": 8, "micro_batch": 1, "keep": 2, "v": 2, "warmup": 1,
                "bench_steps": 1, "rounds": 3, "stands_for": "llama2-7b"},
    "full": {"model": "full", "n_layer": 16, "m": 16, "micro_batch": 2, "keep": 2, "v": 2, "warmup": 3,
             "bench_steps": 5, "rounds": 5, "stands_for": "llama2-13b"},
}


def schedules(p: int, cfg: dict) -> dict[str, object]:
    """The schedules this lesson runs, by name (``Schedule.name``), and the one each is compared against."""
    m, keep, v = cfg["m"], cfg["keep"], cfg["v"]
    out = [one_f_one_b(p, m), one_f_one_b(p, m, "inline", keep), one_f_one_b(p, m, "bubble", keep),
           one_f_one_b(p, m, "bubble", policy="cooldown"),
           interleaved_1f1b(p, m, v), interleaved_1f1b(p, m, v, "inline", policy="cooldown"),
           interleaved_1f1b(p, m, v, "bubble", policy="cooldown")]
    return {s.name: s for s in out}


def baseline_of(name: str) -> str:
    """The schedule without recompute that ``name`` is compared against."""
    return name.split("-recompute-")[0]


def validate(cfg: dict, world_size: int) -> dict:
    cfg = resolve(cfg, PRESETS, PARAMS)  # any world size: with one rank every stage is local (the GPU check)
    if cfg["m"] < world_size:
        raise ValueError(f"m={cfg['m']} micro-batches is too few: 1F1B needs m >= world_size = {world_size}")
    require_divisible("m", cfg["m"], world_size, "world_size", "interleaved 1F1B")
    require_divisible("n_layer", cfg["n_layer"], cfg["v"] * world_size, "v * world_size",
                      "one stage per rank for 1F1B, v per rank interleaved")
    return cfg


def run(ctx, cfg: dict) -> dict:
    p, m = ctx.world_size, cfg["m"]
    setup = PipelineSetup.build(cfg["model"], n_layer=cfg["n_layer"], m=m, micro_batch=cfg["micro_batch"],
                                device=ctx.device)
    named = schedules(p, cfg)
    jobs = [Job(s) for s in named.values()]
    with ctx.part(0, 4 if ctx.emulator else 3, "schedules", size=3):  # the emulated pass: a quarter
        records, models = measure_schedules(ctx, setup, jobs, warmup=cfg["warmup"], steps=cfg["bench_steps"],
                                            rounds=cfg["rounds"])
    runs = dict(zip(named, records))
    trained = dict(zip(named, models))
    bitwise = {}
    for name, schedule in named.items():
        runs[name]["checkpointed"] = sorted([s, mb] for s, mb, _ in schedule.checkpointed
                                            if schedule.stage_rank[s] == ctx.rank)
        base = baseline_of(name)
        if base != name:
            mine = setup.stages(trained[base], named[base], ctx.rank).values()  # this rank's stages
            bitwise[name] = grads_bitwise_equal(trained[base], trained[name], mine)
    emu = None
    if ctx.emulator:
        with ctx.part(3, 4, "emulated, matched"):
            emu = emulated(ctx, cfg, setup, jobs)
    return {"rank": ctx.rank, "p": p, "m": m, "keep": cfg["keep"], "v": cfg["v"], "model": vars(setup.model_cfg),
            "ref_loss": setup.ref_loss, "runs": runs, "bitwise_equal_to_no_recompute": bitwise,
            "dropout": dropout_check() if ctx.rank == 0 else None, "emulated": emu}


def emulated(ctx, cfg: dict, setup: PipelineSetup, jobs: list[Job]) -> dict:
    """Every schedule once more on the emulated cluster, matched to ``cfg["stands_for"]`` (its layers' GEMMs and
    the activations between stages, ``toolkit.models.matched.dense_layer_op``): one step each (virtual time is
    deterministic), its op times and spans on the virtual clock, and the time a rank waited for its receives.
    The toy's own shapes ran on the same clock in ``runs`` (``bench["virtual"]``, ``op_vseconds``). ``hop_s``: one
    activation or gradient on the link between two stages, α + bytes/β, at both shapes (the simulator's comm)."""
    ctx.reserve_for_replay()  # the bar's last quarter: the run replayed on other figures
    emu = ctx.emulator
    toy, real_op = setup.layer_op(emu.cluster.float_bytes), matched.layer_op(catalog.get(cfg["stands_for"]), catalog.get(cfg["stands_for"]).seq_len)
    scales = matched.matched_scales(toy, real_op)
    link = emu.cluster.link_between([0, 1], ctx.world_size)  # between neighbouring stages
    with emu.scaled(**scales):
        records, _ = measure_schedules(ctx, setup, jobs, warmup=0, steps=1, rounds=1, trim=0, label="matched")
    names = {job.label: job.schedule.name for job in jobs}

    def steps(clocks) -> dict[str, float]:  # each schedule's matched step, from a replay of the run
        return {names[k]: v for k, v in replayed_steps(clocks, list(names), "matched").items()}
    return {"cluster": emu.cluster.name, "gpu": emu.cluster.gpu.name, "link": link.name,
            "sensitivity": ctx.replay(steps),
            "stands_for": cfg["stands_for"], "scales": scales,
            "hop_s": {"toy": link.seconds(toy["wire_bytes"]), "matched": link.seconds(real_op["wire_bytes"])},
            "runs": {job.schedule.name: {"step_s": rec["bench"]["virtual"]["mean_s"], "bench": rec["bench"]["virtual"],
                                         "op_seconds": rec["op_vseconds"], "exposed_recv_s": rec["exposed_recv_vs"],
                                         "spans": rec["spans"]}
                     for job, rec in zip(jobs, records)}}


def dropout_check(seed: int = 0) -> dict:
    """A stage with dropout, its gradients three ways: no recompute, ``RecomputeQueue`` (RNG state restored)
    and a naive recompute that runs the forward again without restoring the RNG."""
    torch.manual_seed(seed)
    stage = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Dropout(0.5), nn.Linear(32, 16))
    x = torch.randn(8, 16)

    def grads(run) -> list[torch.Tensor]:
        stage.zero_grad(set_to_none=True)
        torch.manual_seed(seed + 1)
        run()
        return [prm.grad.clone() for prm in stage.parameters()]

    def recompute_queue():
        queue = RecomputeQueue()
        queue.forward((0, 0, 0), stage, x)  # checkpointed forward: no graph kept
        torch.rand(100)  # other work moves the global RNG on before the recompute
        _, out = queue.recompute((0, 0, 0))
        out.square().sum().backward()

    def naive():
        with torch.no_grad():
            stage(x)
        torch.rand(100)
        stage(x).square().sum().backward()

    plain = grads(lambda: stage(x).square().sum().backward())
    return {"restored_rng_bitwise_equal": all(torch.equal(a, b) for a, b in zip(plain, grads(recompute_queue))),
            "naive_recompute_bitwise_equal": all(torch.equal(a, b) for a, b in zip(plain, grads(naive)))}
