"""Lesson 10, per rank: recompute in the pipeline bubble (RiPipe) against plain checkpointing and no recompute.

    1F1B, no recompute            every forward keeps its activations: rank r holds p - r micro-batches
    1F1B, recompute inline        forwards beyond the cap ``keep`` are checkpointed; the backward
                                  recomputes after its gradient arrives (torch.utils.checkpoint)
    1F1B, recompute in bubble     the same forwards checkpointed; an R action right before the backward
                                  rebuilds them while the rank waits for the gradient

For each: one checked step (loss, gradients bitwise against the no-recompute run, saved-activation
bytes over the step), then the three timed round-robin (sharing the machine's load) with per-action spans. Plus, on rank 0, the dropout check: the
recompute restores the RNG state, so masks (and gradients) repeat; recomputing without it does not.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from toolkit.pipeline.harness import Job, PipelineSetup, grads_bitwise_equal, measure_schedules
from toolkit.pipeline.recompute import RecomputeQueue
from toolkit.pipeline.schedule import one_f_one_b
from toolkit.runtime.config import Param, common, require_divisible, resolve

PARAMS = {**common("model", "n_layer", "m", "micro_batch", "warmup", "bench_steps", "rounds"),
          "keep": Param(int, "micro-batches whose activations a rank may hold at once", ge=1)}
PRESETS = {
    "smoke": {"model": "smoke", "n_layer": 2, "m": 4, "micro_batch": 2, "keep": 1, "warmup": 1, "bench_steps": 2,
              "rounds": 3},
    "default": {"model": "default", "n_layer": 4, "m": 8, "micro_batch": 4, "keep": 1, "warmup": 2,
                "bench_steps": 3, "rounds": 5},
    "full": {"model": "full", "n_layer": 12, "m": 16, "micro_batch": 2, "keep": 2, "warmup": 3, "bench_steps": 5,
             "rounds": 5},
}
MODES = ("none", "inline", "bubble")


def validate(cfg: dict, world_size: int) -> dict:
    cfg = resolve(cfg, PRESETS, PARAMS)
    if cfg["m"] < world_size:
        raise ValueError(f"m={cfg['m']} micro-batches is too few: 1F1B needs m >= world_size = {world_size}")
    require_divisible("n_layer", cfg["n_layer"], world_size, "world_size", "one stage per rank")
    return cfg


def run(ctx, cfg: dict) -> dict:
    p, m = ctx.world_size, cfg["m"]
    setup = PipelineSetup.build(cfg["model"], n_layer=cfg["n_layer"], m=m, micro_batch=cfg["micro_batch"],
                                device=ctx.device)
    jobs = [Job(one_f_one_b(p, m, mode, cfg["keep"])) for mode in MODES]
    records, models = measure_schedules(ctx, setup, jobs, warmup=cfg["warmup"], steps=cfg["bench_steps"],
                                        rounds=cfg["rounds"])
    runs = dict(zip(MODES, records))
    for mode, job in zip(MODES, jobs):
        runs[mode]["checkpointed"] = sorted(mb for s, mb, _ in job.schedule.checkpointed if s == ctx.rank)
    mine = setup.stages(models[0], jobs[0].schedule, ctx.rank).values()  # this rank's stages, no recompute
    bitwise = {mode: grads_bitwise_equal(models[0], model, mine) for mode, model in zip(MODES[1:], models[1:])}
    return {"rank": ctx.rank, "p": p, "m": m, "keep": cfg["keep"], "model": vars(setup.model_cfg),
            "ref_loss": setup.ref_loss, "runs": runs, "bitwise_equal_to_none": bitwise,
            "dropout": dropout_check() if ctx.rank == 0 else None}


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
