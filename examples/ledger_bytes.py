"""Count the bytes a plain MLP's data parallelism puts on the wire with the ledger, DDP and ZeRO-3, on 2 ranks.

    python examples/ledger_bytes.py

The ledger (``ctx.ledger``) wraps torch.distributed on every rank, so any code's collectives are counted
from tensor sizes: bytes per step and op, compared with the closed forms (n ranks, Ψ fp32 parameters):
    DDP      all-reduce of every gradient          2(n-1)/n · 4Ψ
    ZeRO-3   all-gather each unit in forward and backward, reduce-scatter its gradient (ZeroDataParallel's
             closed_forms(), which counts the padding of each unit's flat buffer)
"""
import copy

import torch
import torch.nn.functional as F
from tiny_models import mlp
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from toolkit import ZeroDataParallel, launch


def experiment(ctx, cfg):
    n, steps = ctx.world_size, cfg["steps"]
    base = mlp(cfg["d"], cfg["layers"], seed=0)
    psi = sum(p.numel() for p in base.parameters())
    ddp = DDP(copy.deepcopy(base))
    ddp.register_comm_hook(None, allreduce_hook)  # DDP's all-reduce through torch.distributed: the ledger sees it
    zero3 = ZeroDataParallel(copy.deepcopy(base), stage=3)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(ctx.rank)
    for _ in range(steps):
        x, y = torch.randn(8, cfg["d"], generator=gen), torch.randn(8, cfg["d"], generator=gen)
        with ctx.ledger.tag("ddp"):
            opt.zero_grad()
            F.mse_loss(ddp(x), y).backward()
            opt.step()
        with ctx.ledger.tag("zero3"):
            F.mse_loss(zero3(x), y).backward()
            zero3.step()
            zero3.zero_grad()
    by_op = {r["op"]: r["sent_bytes"] // steps for r in ctx.ledger.summary(by=("tag", "op")) if r["tag"] == "zero3"}
    return {"psi": psi, "ddp_per_step": ctx.ledger.total("sent_bytes", tag="ddp") // steps,
            "ddp_closed_form": 2 * (n - 1) * 4 * psi // n, "zero3_per_step": by_op,
            "zero3_closed_form": zero3.closed_forms()["bytes"],
            "zero3_memory": zero3.memory_by_category()}


if __name__ == "__main__":
    results = launch(experiment, world_size=2, cfg={"d": 64, "layers": 4, "steps": 3})
    r = results[0]
    print(f"{r['psi']:,} parameters on 2 ranks")
    print(f"DDP    bytes/step/rank {r['ddp_per_step']:,}  closed form 2(n-1)/n*4*psi = {r['ddp_closed_form']:,}")
    print(f"ZeRO-3 bytes/step/rank {r['zero3_per_step']}  closed form {r['zero3_closed_form']}")
    print(f"ZeRO-3 bytes at rest on rank 0: {r['zero3_memory']}")
    assert all(x["ddp_per_step"] == x["ddp_closed_form"] for x in results)
    assert all(x["zero3_per_step"] == {k: v for k, v in x["zero3_closed_form"].items() if v} for x in results)
