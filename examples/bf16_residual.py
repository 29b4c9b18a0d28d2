"""Train a plain MLP in bf16 with the bf16 + 16-bit-residual optimizer (no fp32 master stored).

    python examples/bf16_residual.py

Three copies of the same bf16 model train on the same data:
    ReuseAdamW                      master = bf16 weight + int16 residual      (4 B/param of weights + master)
    MasterAdamW(rounding="away")    a separate fp32 master, cast like split()  (6 B/param) - the reference
    MasterAdamW()                   plain mixed precision, round-half-even cast (6 B/param)
The first two must agree bit for bit at every step (weights and masters); the optimizer state of the first is
2 bytes per parameter smaller. One process: an optimizer works the same under any data parallelism.
"""
import copy

import torch
import torch.nn.functional as F
from tiny_models import mlp

from toolkit import MasterAdamW, ReuseAdamW
from toolkit.memory.param_reuse import bytes_by_category

STEPS, BATCH, D = 20, 16, 64

base = mlp(D, n_layers=2, seed=0).to(torch.bfloat16)
models = {name: copy.deepcopy(base) for name in ("reuse", "master_away", "master_even")}
opts = {"reuse": ReuseAdamW(models["reuse"].parameters(), lr=3e-3),
        "master_away": MasterAdamW(models["master_away"].parameters(), lr=3e-3, rounding="away"),
        "master_even": MasterAdamW(models["master_even"].parameters(), lr=3e-3)}
teacher = mlp(D, n_layers=1, seed=1)  # the function to learn
gen = torch.Generator().manual_seed(2)
losses = {name: [] for name in models}
for step in range(STEPS):
    x = torch.randn(BATCH, D, generator=gen)
    with torch.no_grad():
        y = teacher(x)
    for name, model in models.items():
        opts[name].zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x.bfloat16()).float(), y)
        loss.backward()
        opts[name].step()
        losses[name].append(loss.item())
    pairs = list(zip(models["reuse"].parameters(), models["master_away"].parameters()))
    assert all(torch.equal(a, b) for a, b in pairs), f"step {step}: bf16 weights differ"
    assert all(torch.equal(opts["reuse"].master(a), opts["master_away"].master(b)) for a, b in pairs), \
        f"step {step}: fp32 masters differ"

n = sum(p.numel() for p in base.parameters())
sizes = {name: bytes_by_category(models[name], opts[name]) for name in models}
for name in models:
    per = {k: v / n for k, v in sizes[name].items() if k != "step"}
    print(f"{name:12s} loss {losses[name][0]:.4f} -> {losses[name][-1]:.4f}   bytes/param "
          + "  ".join(f"{k} {v:.2f}" for k, v in per.items()))
assert sizes["reuse"]["master"] == 2 * n and sizes["master_away"]["master"] == 4 * n  # residual vs fp32 master
assert losses["reuse"][-1] < 0.5 * losses["reuse"][0], "the model did not learn"
print(f"ReuseAdamW == MasterAdamW(rounding='away') bit for bit over {STEPS} steps, "
      f"{(sizes['master_away']['master'] - sizes['reuse']['master']) / n:.0f} B/param less")
