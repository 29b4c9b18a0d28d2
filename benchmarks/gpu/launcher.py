"""GPU check of the launcher: nccl ranks (one per visible GPU), a lesson name and a function shipped as source.

``check()`` returns rows ``{"check", "ok", "value"}`` (``benchmarks/gpu_check.sh`` runs every module here);
it assumes CUDA is available.
"""
from __future__ import annotations

import torch


def _on_gpu(ctx, cfg):  # shipped to the ranks as source (defined in this file, run as __main__ or imported)
    import torch
    import torch.distributed as dist
    x = torch.full((cfg["n"],), float(ctx.rank + 1), device=ctx.device)
    with ctx.ledger.tag("sum"):
        dist.all_reduce(x)
    return {"device": str(ctx.device), "sum": x[0].item(), "bytes": ctx.ledger.total("sent_bytes", tag="sum")}


def check() -> list[dict]:
    from toolkit import launch
    from toolkit.runtime.launch import check_capacity
    gpus = torch.cuda.device_count()
    rows = []
    res = launch("toolkit.lessons.selftest", gpus, {"steps": 2}, backend="auto", progress="none", timeout_s=300)
    rows.append({"check": "launch: backend auto is nccl, one rank per GPU", "ok": all(r["backend"] == "nccl"
                 for r in res) and len(res) == gpus, "value": f"{len(res)} ranks, backend {res[0]['backend']}"})
    res = launch(_on_gpu, gpus, {"n": 1024}, backend="nccl", progress="none", timeout_s=300)
    want = gpus * (gpus + 1) / 2
    rows.append({"check": "launch: a function object on nccl ranks (each on its own device)",
                 "ok": [r["device"] for r in res] == [f"cuda:{i}" for i in range(gpus)] and
                 all(r["sum"] == want for r in res), "value": str([(r["device"], r["sum"]) for r in res])})
    try:
        check_capacity(gpus + 1, "nccl")
        refused = False
    except ValueError:
        refused = True
    rows.append({"check": "launch: more nccl ranks than GPUs refused before any process", "ok": refused,
                 "value": f"world_size={gpus + 1} on {gpus} GPUs"})
    return rows


if __name__ == "__main__":
    for row in check():
        print(f"{'ok  ' if row['ok'] else 'FAIL'} {row['check']}: {row['value']}")
