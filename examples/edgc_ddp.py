"""Wrap a small transformer's DDP with EDGC (entropy-driven low-rank gradient compression) on 2 ranks.

    python examples/edgc_ddp.py

Three DDP copies of the same model train on the same data, each with its own communication hook:
    plain       DDP's all-reduce (through torch's allreduce_hook, so the ledger sees it)
    torch       torch's powerSGD_hook at rank 4, compressing from step 2
    edgc        toolkit.EDGCHook pinned to rank 4 (r_min = r_init = r_max), warm-up 2 steps
(one DDP bucket each, as in lesson 05: torch's hook chains collectives in callbacks, which on gloo can
interleave across buckets and hang). The EDGC hook must average exactly what torch's powerSGD_hook averages (bit for bit, every step), and both
put fewer bytes on the wire than the plain all-reduce (counted by the ledger). A fourth copy runs EDGC on
several small DDP buckets with its rank free to follow each bucket's gradient entropy.
"""
import copy

import torch
import torch.nn.functional as F
from tiny_models import TinyTransformer
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from toolkit import EDGCConfig, EDGCHook, launch


def experiment(ctx, cfg):
    steps, rank_r = cfg["steps"], cfg["rank"]
    base = TinyTransformer(seed=0)
    ddps, hooks = {}, {}
    for name in ("plain", "torch", "edgc", "edgc_free"):
        # torch's powerSGD_hook chains its collectives in callbacks, which can interleave across buckets on
        # gloo: one bucket for the comparison (as lesson 05), several for the free-running EDGC
        ddps[name] = DDP(copy.deepcopy(base), bucket_cap_mb=cfg["bucket_mb"] if name == "edgc_free" else 1024)
    ddps["plain"].register_comm_hook(None, allreduce_hook)
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=rank_r, start_powerSGD_iter=2,
                                        min_compression_rate=2, use_error_feedback=True, warm_start=True,
                                        random_seed=0)
    ddps["torch"].register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    hooks["edgc"] = EDGCHook(EDGCConfig(warmup=2, window=1000, r_init=rank_r, r_min=rank_r, r_max=rank_r))
    hooks["edgc_free"] = EDGCHook(EDGCConfig(warmup=2, window=2, isr_every=1, gsr=0.5, r_init=4, r_min=1, r_max=16))
    for name, hook in hooks.items():
        ddps[name].register_comm_hook(hook, EDGCHook.hook)
    opts = {name: torch.optim.SGD(d.parameters(), lr=0.1) for name, d in ddps.items()}
    gen = torch.Generator().manual_seed(100 + ctx.rank)  # each rank its own data
    equal_steps = 0
    for step in range(steps):
        x = torch.randint(0, 256, (4, 32), generator=gen)
        for name, ddp in ddps.items():
            opts[name].zero_grad(set_to_none=True)
            with ctx.ledger.tag(name):
                F.cross_entropy(ddp(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
        pairs = zip(ddps["torch"].parameters(), ddps["edgc"].parameters())
        equal_steps += all(torch.equal(a.grad, b.grad) for a, b in pairs)
        for opt in opts.values():
            opt.step()
    sent = {name: ctx.ledger.total("sent_bytes", tag=name) for name in ddps}
    return {"steps": steps, "buckets": len(hooks["edgc_free"].stages), "equal_steps": equal_steps, "sent_bytes": sent,
            "free_ranks": [h["ranks"] for h in hooks["edgc_free"].history]}


if __name__ == "__main__":
    results = launch(experiment, world_size=2, cfg={"steps": 6, "rank": 4, "bucket_mb": 0.05})
    r = results[0]
    print(f"EDGC hook == torch powerSGD_hook on {r['equal_steps']}/{r['steps']} steps")
    print("bytes sent per rank: " + ", ".join(f"{k} {v:,}" for k, v in r["sent_bytes"].items()))
    print(f"EDGC on {r['buckets']} DDP buckets, ranks free to move, step by step:", r["free_ranks"])
    assert all(x["equal_steps"] == x["steps"] for x in results), "EDGC at a fixed rank differs from powerSGD_hook"
    assert r["buckets"] > 1
    assert r["sent_bytes"]["edgc"] < r["sent_bytes"]["plain"] and r["sent_bytes"]["torch"] < r["sent_bytes"]["plain"]
