"""Tiny per-rank programs used by the launcher's tests and benchmarks."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist


def run(ctx, cfg):
    """All-reduce a tensor and report what every rank saw."""
    x = torch.full((cfg.get("numel", 4),), float(ctx.rank + 1))
    dist.all_reduce(x)
    for i in range(cfg.get("steps", 1)):
        ctx.progress(i + 1, cfg.get("steps", 1), "all_reduce")
    return {"rank": ctx.rank, "world_size": ctx.world_size, "sum": x[0].item(), "backend": ctx.backend,
            "sent_bytes": ctx.ledger.total("sent_bytes")}


def fail(ctx, cfg):
    """Rank ``cfg['bad_rank']`` raises; the others wait in a collective."""
    if ctx.rank == cfg.get("bad_rank", 1):
        raise RuntimeError(f"deliberate failure on rank {ctx.rank}")
    dist.barrier()
    return {}


def hang(ctx, cfg):
    """Rank ``cfg['bad_rank']`` sleeps forever; the others finish (or wait)."""
    if ctx.rank == cfg.get("bad_rank", 1):
        while True:
            time.sleep(0.1)
    return {"rank": ctx.rank}
