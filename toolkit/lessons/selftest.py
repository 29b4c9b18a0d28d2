"""Tiny per-rank programs used by the launcher's tests and benchmarks."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from toolkit.runtime import compat


def run(ctx, cfg):
    """All-reduce a tensor and report what every rank saw."""
    x = torch.full((cfg.get("numel", 4),), float(ctx.rank + 1), device=ctx.device)
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


def ledger_ops(ctx, cfg):
    """Issue one of each tracked op on float32 tensors of ``n`` elements and return the ledger records."""
    n, w, r = cfg.get("n", 8), ctx.world_size, ctx.rank
    x = torch.ones(n)
    dist.all_reduce(x)
    dist.all_gather_into_tensor(torch.empty(n * w), torch.ones(n))  # torch's own names: the ledger test
    dist.reduce_scatter_tensor(torch.empty(n), torch.ones(n * w))    # (deprecated in torch 2.13, still there)
    dist.all_to_all_single(torch.empty(n * w), torch.ones(n * w))
    dist.broadcast(torch.ones(n), src=0)
    dist.reduce(torch.ones(n), dst=0)
    with ctx.ledger.tag("p2p"):
        if r == 0:
            dist.send(torch.ones(n), dst=1)
        elif r == 1:
            dist.recv(torch.empty(n), src=0)
        ops = [dist.P2POp(dist.isend, torch.ones(n), (r + 1) % w), dist.P2POp(dist.irecv, torch.empty(n), (r - 1) % w)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    if compat.missing("single_collectives") is None:
        with ctx.ledger.tag("single"):  # the new names (torch >= 2.13), counted under the old ones
            dist.all_gather_single(torch.empty(n * w), torch.ones(n))
            dist.reduce_scatter_single(torch.empty(n), torch.ones(n * w))
    handle = dist.all_reduce(torch.ones(n), async_op=True)
    handle.wait()
    grid = ctx.make_grid(tp=2) if w % 2 == 0 else None
    if grid:
        dist.all_reduce(torch.ones(n), group=grid.group("tp"))
    return {"records": ctx.ledger.to_json(), "summary": ctx.ledger.summary(by=("op", "group")),
            "coords": grid.coords if grid else None, "tp_ranks": grid.ranks("tp") if grid else None,
            "dp_ranks": grid.ranks("dp") if grid else None}


def phased(ctx, cfg):
    """Two phases with sub-progress (launched with ``phases=[("warm", w), ("work", w)]``)."""
    with ctx.phase("warm"):
        dist.barrier()
    ctx.phase("work")
    for i in range(cfg.get("steps", 3)):
        dist.barrier()
        time.sleep(0.3)
        ctx.progress(i + 1, cfg.get("steps", 3), f"step {i + 1}")
    try:
        ctx.phase("undeclared")
    except ValueError as exc:
        return {"rank": ctx.rank, "undeclared": str(exc)}
    return {"rank": ctx.rank, "undeclared": None}


def nested(ctx, cfg):
    """Phases ("setup", "work"); in "work" ``cfg["n"]`` pieces, each timing two candidates with
    ``bench.compare`` that reports its own rounds. With ``cfg["parts"]`` each piece is a ``ctx.part``;
    without, the pieces report ``progress(i, n)`` and the rounds then overwrite it (the bar's old bug)."""
    from contextlib import nullcontext

    from toolkit.runtime.bench import compare
    with ctx.phase("setup"):
        dist.barrier()
    ctx.phase("work")

    def round_done(done: int, total: int) -> None:
        time.sleep(0.3)  # longer than the launcher's poll and the rank's report interval: every report is seen
        ctx.progress(done, total, "rounds")

    n, parts = cfg.get("n", 3), cfg.get("parts", True)
    for i in range(n):
        if not parts:
            ctx.progress(i, n, f"piece {i}")
        with ctx.part(i, n, f"piece {i}") if parts else nullcontext():
            compare({"a": lambda: time.sleep(0.05), "b": lambda: time.sleep(0.05)}, warmup=0, steps=1, rounds=3,
                    trim=0, sync=ctx.barrier, on_round=round_done)
    return {"rank": ctx.rank}


def ddp_steps(ctx, cfg):
    """A few DDP + AdamW steps of a small MLP (intra-op threads as launched): every parameter's bits, and
    whether this rank was forked from the launcher (``TOOLKIT_RANK_START``)."""
    import multiprocessing

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(ctx.rank)
    for _ in range(cfg.get("steps", 3)):
        x = torch.randn(32, 64, generator=gen)  # [batch, d]
        loss = ddp(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    bits = [p.detach().view(torch.int32).flatten().tolist() for p in model.parameters()]
    return {"bits": bits, "threads": torch.get_num_threads(), "forked": multiprocessing.parent_process() is not None}
