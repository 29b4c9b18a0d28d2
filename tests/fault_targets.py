"""Tiny per-rank programs that fail the ways a real run fails, for tests/test_faults.py (launched as
``"fault_targets:name"``). In each, rank ``cfg["bad_rank"]`` (default 1) meets the fault; the others wait for
it in a collective, as a real run's ranks would."""
from __future__ import annotations

import os
import resource
import signal
import time

import torch
import torch.distributed as dist


def validate(cfg: dict, world_size: int) -> dict:
    """Runs before any process starts, for every function here: only ``rows`` has a rule."""
    if "rows" in cfg and (not isinstance(cfg["rows"], int) or cfg["rows"] < 1):
        raise ValueError(f"rows must be a positive int, got {cfg['rows']!r}")
    return cfg


def _bad(ctx, cfg) -> bool:
    return ctx.rank == cfg.get("bad_rank", 1)


def all_reduce(ctx, cfg):
    """Healthy: the sum over ranks of ``value + rank``."""
    x = torch.full((4,), float(cfg["value"] + ctx.rank))
    dist.all_reduce(x)
    return {"sum": x[0].item()}


def fsize_limit(ctx, cfg):
    """Healthy: this rank's file-size limit (``ulimit -f``, as its caller set it)."""
    return {"fsize": resource.getrlimit(resource.RLIMIT_FSIZE)[0]}


def killed(ctx, cfg):
    """The bad rank is killed by SIGKILL (what the kernel's out-of-memory killer sends) amid all-reduces."""
    x = torch.ones(1024)
    for step in range(1000):
        if step == 5 and _bad(ctx, cfg):
            os.kill(os.getpid(), signal.SIGKILL)
        dist.all_reduce(x)
    return {}


def exits(ctx, cfg):
    """The bad rank leaves with os._exit(3): no result, no exception."""
    dist.barrier()
    if _bad(ctx, cfg):
        os._exit(3)
    dist.barrier()
    return {}


def returns_a_set(ctx, cfg):
    """The bad rank returns something JSON cannot hold (a set, two levels down)."""
    return {"loss": 1.0, "curve": {"points": {1, 2} if _bad(ctx, cfg) else [1, 2]}}


def out_of_memory(ctx, cfg):
    """The bad rank allocates 4 GiB under an address-space limit 256 MiB above what it uses: torch's allocator
    raises RuntimeError (not MemoryError)."""
    if _bad(ctx, cfg):
        in_use = int(open("/proc/self/statm").read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        resource.setrlimit(resource.RLIMIT_AS, (in_use + 256 * 2**20, resource.RLIM_INFINITY))
        torch.empty(2**30)
    dist.barrier()
    return {}


def nvme_disk_full(ctx, cfg):
    """NVMe offload whose disk fills after the file was reserved: a file-size limit (RLIMIT_FSIZE) below the file
    makes the optimizer step's writes fail with EFBIG (Python ignores SIGXFSZ, so write() returns the error)."""
    from toolkit.memory.nvme import DiskAdamW
    model = torch.nn.Linear(64, 64)
    opt = DiskAdamW(model.parameters(), cfg["dir"], buffer_count=2, buffer_size=1024)
    model(torch.randn(8, 64)).sum().backward()
    if _bad(ctx, cfg):
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
    opt.step()
    dist.barrier()
    return {}


def spill_disk_full(ctx, cfg):
    """Activation spill on a disk with less room than its capacity: the reservation fails at construction."""
    from toolkit.memory.spill import DiskSpill
    if _bad(ctx, cfg):
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, resource.RLIM_INFINITY))
    DiskSpill(cfg["dir"], 1 << 20).close()
    dist.barrier()
    return {}


def reshape_rows(ctx, cfg):
    """``rows`` passes validate (a positive int) but must also divide 12, which only the run finds out."""
    return {"rows": torch.arange(12).view(cfg["rows"], -1).tolist()}


def hangs(ctx, cfg):
    """Every rank says it started (a file in out_dir), then sleeps until it is stopped."""
    (ctx.out_dir / f"hanging{ctx.rank}").touch()
    while True:
        time.sleep(0.1)
