"""Per rank: every schedule asked for, run once on the tiny GPT, against the single-process reference.

Not a lesson with a notebook: the tests launch it to check the pipeline engine on real processes::

    launch("pipeline_selfcheck", 2, {"schedules": ["1f1b", "dualpipev", "torch:zbv", "torch-impl:1f1b"], "m": 4})

Names are ``make_schedule`` names, ``"torch:NAME"`` for torch's order run by our executor
(``from_torch``), or ``"torch-impl:NAME"`` for torch.distributed.pipelining's own implementation. Returns
per rank ``{name: {"loss", "ref_loss", "grad_diff", "peak_act_bytes"}}``.
"""
from __future__ import annotations

from toolkit.pipeline.harness import Job, PipelineSetup, check_step
from toolkit.pipeline.schedule import from_torch, make_schedule


def run(ctx, cfg: dict) -> dict:
    p = ctx.world_size
    setup = PipelineSetup.build(cfg.get("model", "smoke"), n_layer=cfg.get("n_layer", 2 * p), m=cfg.get("m", 2 * p),
                                micro_batch=cfg.get("micro_batch", 2), seed=cfg.get("seed", 0), device=ctx.device)
    out = {}
    for name in cfg["schedules"]:
        kind, _, plain = name.rpartition(":")
        schedule = from_torch(plain, p, setup.m) if kind == "torch" else make_schedule(plain, p, setup.m)
        record, _ = check_step(ctx, setup, Job(schedule, impl="torch" if kind == "torch-impl" else "ours"))
        out[name] = {"loss": record["loss"], "ref_loss": setup.ref_loss, "grad_diff": record["grad_diff"],
                     "peak_act_bytes": record["peak_act_bytes"]}
    return out
