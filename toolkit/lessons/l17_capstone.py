"""Lesson 17, per rank: the techniques composed on pp × dp ranks, turned on one at a time.

A tiny MoE GPT, experts spread over the dp replicas of each pipeline rank (``toolkit.compose``). The chain
starts from the baseline (1F1B, fp32, plain all-to-all, plain DP all-reduce) and turns the techniques of
``techniques`` on in order, each on top of the ones before; ``branch`` techniques are measured alone on the
baseline (those that conflict with something in the chain). For every configuration, on a fresh model from
the same seed and the same data::

    train     ``steps`` training steps: the loss of each (global batch, all-reduced)
    memory    one more step inside a MemoryTracker: this rank's tensor peak by category, the bytes it sent by op
              and group (ledger), and the router's decisions (rows per MoE layer: the planner's input)
    timing    every configuration timed side by side (toolkit.runtime.bench.compare, round-robin)

The single-process reference (the same model, the global batch, micro-batches in order) gives the baseline's
first loss on every rank, to check that the composed layout computes the model's loss.
"""
from __future__ import annotations

from collections import defaultdict

import torch

from toolkit.compose import TECHNIQUES, ComposeConfig, Composed, chain
from toolkit.runtime.config import Param, common, require_ranks, resolve

WORLD_SIZE = 4  # pp 2 x dp 2: the generated bad-input tests validate at this world size
PARAMS = {**common("model", "n_layer", "m", "micro_batch", "steps", "lr", "seed", "warmup", "bench_steps", "rounds"),
          "pp": Param(int, "pipeline ranks (dp = world_size / pp)", ge=1),
          "n_expert": Param(int, "experts per MoE layer (0: dense)", ge=0),
          "top_k": Param(int, "experts per token", ge=1),
          "techniques": Param(list, "techniques turned on one after the other, in this order", of=str,
                              choices=tuple(TECHNIQUES), nonempty=False),
          "branch": Param(list, "techniques measured alone on the baseline (they conflict with the chain)", of=str,
                          choices=tuple(TECHNIQUES), nonempty=False)}
CHAIN = ["dualpipev", "bf16", "bf16_residual", "offload", "int8_a2a", "edgc"]
PRESETS = {
    "smoke": {"model": "smoke", "n_layer": 4, "m": 4, "micro_batch": 2, "steps": 2, "lr": 1e-3, "seed": 0,
              "warmup": 1, "bench_steps": 1, "rounds": 3, "pp": 2, "n_expert": 4, "top_k": 2,
              "techniques": CHAIN, "branch": []},
    "default": {"model": "smoke", "n_layer": 4, "m": 4, "micro_batch": 4, "steps": 3, "lr": 1e-3, "seed": 0,
                "warmup": 1, "bench_steps": 2, "rounds": 3, "pp": 2, "n_expert": 4, "top_k": 2,
                "techniques": CHAIN, "branch": []},
    "full": {"model": "default", "n_layer": 8, "m": 8, "micro_batch": 4, "steps": 10, "lr": 1e-3, "seed": 0,
             "warmup": 2, "bench_steps": 3, "rounds": 5, "pp": 2, "n_expert": 8, "top_k": 2,
             "techniques": CHAIN, "branch": []},
}
PHASES = [("reference", 1), ("train", 6), ("timing", 3)]


def base_config(cfg: dict, world_size: int) -> ComposeConfig:
    """The baseline of the chain: 1F1B, fp32, plain all-to-all and all-reduce, experts over dp."""
    dp = world_size // cfg["pp"]
    return ComposeConfig(model=cfg["model"], n_layer=cfg["n_layer"], n_expert=cfg["n_expert"], top_k=cfg["top_k"],
                         seed=cfg["seed"], pp=cfg["pp"], dp=dp, ep=dp if cfg["n_expert"] else 1, m=cfg["m"],
                         micro_batch=cfg["micro_batch"], lr=cfg["lr"])


def configurations(cfg: dict, world_size: int) -> list[tuple[str, ComposeConfig, str]]:
    """(name, config, what it is measured against) for the chain and the branch, every one validated."""
    base = base_config(cfg, world_size)
    steps = chain(base, list(cfg["techniques"]), world_size)
    out = [(name, c, steps[i - 1][0] if i else "") for i, (name, c) in enumerate(steps)]
    for name in cfg["branch"]:
        _, (_, c) = chain(base, [name], world_size)
        out.append((f"{name} (on baseline)", c, "baseline"))
    return out


def validate(cfg: dict, world_size: int) -> dict:
    cfg = resolve(cfg, PRESETS, PARAMS)
    require_ranks(world_size, 2, "the composed run (pp x dp)")
    if world_size % cfg["pp"]:
        raise ValueError(f"world_size={world_size} is not a multiple of pp={cfg['pp']}: pp x dp must equal the "
                         f"world size")
    configurations(cfg, world_size)  # every prefix of the chain and every branch: conflicts raise here
    return cfg


def _bytes_by_op(ledger, tag: str, steps: int) -> list[dict]:
    rows: dict[tuple, dict] = defaultdict(lambda: {"sent_bytes": 0, "calls": 0})
    for r in ledger.records:
        if r.tag == tag:
            row = rows[(r.op, r.group)]
            row["sent_bytes"] += r.sent_bytes
            row["calls"] += 1
    return [{"op": op, "group": group, "sent_bytes": v["sent_bytes"] / steps, "calls": v["calls"] / steps}
            for (op, group), v in sorted(rows.items())]


def run(ctx, cfg: dict) -> dict:
    from toolkit.data import batches
    from toolkit.runtime.bench import compare
    from toolkit.runtime.memory import MemoryTracker

    configs = configurations(cfg, ctx.world_size)
    base = configs[0][1]
    grid = ctx.make_grid(dp=base.dp, pp=base.pp, ep=base.ep)
    dp_rank = grid.rank_in("dp")
    n_batches = cfg["steps"] + 1
    data = []
    for x, y in batches(cfg["m"] * cfg["micro_batch"], base.model_config().seq_len, n_batches, seed=cfg["seed"] + 1,
                        rank=dp_rank, world=base.dp, device=ctx.device):
        data.append((list(x.split(cfg["micro_batch"])), list(y.split(cfg["micro_batch"]))))

    ctx.phase("reference")
    reference = _reference_loss(base, cfg, ctx.device)

    ctx.phase("train")
    runs, composed = [], {}
    for i, (name, c, against) in enumerate(configs):
        job = Composed.build(c, grid, ctx.device, ledger=ctx.ledger)
        with ctx.ledger.tag(f"{name}:train"):
            losses = [job.step(*data[k]) for k in range(cfg["steps"])]
        with MemoryTracker(list(job.modules.values()), job.optimizer, every_op=False) as mem, \
                job.record_routing() as rows, ctx.ledger.tag(f"{name}:memory"):
            job.step(*data[cfg["steps"]])
        composed[name] = job
        runs.append({"name": name, "against": against, "config": c.to_dict(), "losses": losses,
                     "memory": mem.summary(), "bytes": _bytes_by_op(ctx.ledger, f"{name}:memory", 1),
                     "param_bytes": job.parameter_bytes(), "stages": sorted(job.modules),
                     "routing": [{"stage": s, "mb": mb, "layers": r} for (s, mb), r in sorted(rows.items())],
                     "edgc_ranks": [job.history[-1]["ranks"]] if job.history else None,
                     "offload": dict(job.offloader.stats) if job.offloader is not None else None})
        ctx.progress(i + 1, len(configs), f"trained {name}")

    ctx.phase("timing")
    fixed = data[0]
    results = compare({name: (lambda job=job: job.step(*fixed)) for name, job in composed.items()},
                      warmup=cfg["warmup"], steps=cfg["bench_steps"], rounds=cfg["rounds"], sync=ctx.barrier,
                      on_round=lambda done, total: ctx.progress(done, total, "timing every configuration"))
    for r in runs:
        r["bench"] = results[r["name"]].to_dict()
    return {"rank": ctx.rank, "coords": {"pp": grid.rank_in("pp"), "dp": dp_rank}, "world_size": ctx.world_size,
            "reference_loss": reference, "runs": runs}


def _reference_loss(base: ComposeConfig, cfg: dict, device) -> float:
    """The model in one process on the global batch of the first step (every replica's micro-batches in order)."""
    from toolkit.data import batches
    from toolkit.models import GPT, lm_loss
    torch.manual_seed(base.seed)
    model = GPT(base.model_config()).to(device)
    x, y = next(batches(base.dp * cfg["m"] * cfg["micro_batch"], model.cfg.seq_len, 1, seed=cfg["seed"] + 1,
                        device=device))
    with torch.no_grad():
        parts = [lm_loss(model(xb), yb).item() for xb, yb in zip(x.split(cfg["micro_batch"]), y.split(cfg["micro_batch"]))]
    return sum(parts) / len(parts)
