"""GPU check of lesson 12 (dynamic context parallelism): ring attention and the lesson's run on CUDA.

``check()`` (run by ``benchmarks/gpu_check.sh``; assumes CUDA) returns rows ``{"check", "ok", "value"}``:

- always, one process on one GPU: ring attention with cp = 1 on packed sequences against
  ``packed_causal_attention`` (forward and backward; max |diff| / max |ref| within 1e-5 in fp32, 2e-2 in bf16),
  and the tiny GPT's loss on a packed shard (``gpt_shard_loss``) against every sequence alone;
- with 2 or more GPUs: lesson 12 at the smoke preset on nccl, one rank per GPU (the largest power of two <= the
  GPU count, at most 8): ring attention over the whole world equals one-process attention, ledger ring bytes
  equal the closed form, per-token loss and gradients of the static and dynamic plans equal the reference.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def _row(check: str, ok: bool, value) -> dict:
    return {"check": f"dynamic_cp: {check}", "ok": bool(ok), "value": str(value)}


def _one_gpu(device: str = "cuda") -> list[dict]:
    from toolkit.context import ring_attention as ra
    from toolkit.models import GPT, preset

    rows, dev = [], torch.device(device)
    lengths = [384, 64, 1024, 8]
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(8, sum(lengths), 64, generator=g).to(dev, dtype).requires_grad_() for _ in range(3))
        grad = torch.randn(8, sum(lengths), 64, generator=g).to(dev, dtype)
        ref = ra.packed_causal_attention(q, k, v, lengths)
        ref_grads = torch.autograd.grad(ref, (q, k, v), grad)
        out = ra.ring_attention(q, k, v, ra.CPLayout(lengths, 1))
        grads = torch.autograd.grad(out, (q, k, v), grad)
        diff = max(((a - b).abs().max() / b.abs().max()).item()
                   for a, b in zip((out, *grads), (ref, *ref_grads)))
        rows.append(_row(f"ring attention cp=1 == full attention ({str(dtype)[6:]}, fwd+bwd, max|diff|/max|ref| "
                         f"<= {tol})", diff <= tol, f"{diff:.2e}"))
    torch.manual_seed(0)
    model = GPT(preset("default", n_layer=2, seq_len=max(lengths))).to(dev)
    tokens = [torch.randint(1, 256, (n + 1,), device=dev) for n in lengths]
    ref = sum(ra.gpt_sequence_loss(model, t[:-1], t[1:]).item() for t in tokens)
    layout = ra.CPLayout(lengths, 1)
    packed = torch.cat([t[:-1] for t in tokens])
    targets = torch.cat([t[1:] for t in tokens])
    got = ra.gpt_shard_loss(model, packed, targets, layout.coords(0, dev)[1], layout).item()
    rows.append(_row("packed GPT loss == sequences alone (fp32, rtol 1e-5)", abs(got - ref) <= 1e-5 * abs(ref),
                     f"{got:.6f} vs {ref:.6f}"))
    return rows


def _many_gpus(n: int) -> list[dict]:
    from toolkit import launch

    results = launch("l12_dynamic_cp", n, {"preset": "smoke"}, backend="nccl", timeout_s=600, progress="none")
    sc = [r["selfcheck"] for r in results]
    rows = [_row(f"ring attention over {n} GPUs == one-process attention (fp32, 1e-5)",
                 all(max(s["max_abs_diff"].values()) <= 1e-5 for s in sc),
                 max(max(s["max_abs_diff"].values()) for s in sc)),
            _row("ring bytes: ledger == closed form", all(
                b["ledger"] == b["closed_form"] for r in results for v in r["ring_bytes"].values() for b in v.values())
                 and all(s["sent_bytes"] == s["closed_form"] for s in sc), "every rank, both plans")]
    for name in ("static", "dynamic"):
        worst = max(abs(r["checked"][name]["loss_per_token"] / r["checked"]["reference"]["loss_per_token"] - 1)
                    for r in results)
        grad = max(r["checked"][name]["max_grad_diff"] for r in results)
        step_ms = results[0]["bench"][name]["mean_s"] * 1e3
        rows.append(_row(f"{name} plan on nccl: loss and grads == unpacked reference",
                         worst <= results[0]["tolerances"]["loss_rtol"]
                         and grad <= results[0]["tolerances"]["grad_atol"],
                         f"loss rel {worst:.1e}, grad {grad:.1e}; step {step_ms:.1f} ms"))
    return rows


def check() -> list[dict]:
    rows = _one_gpu()
    count = torch.cuda.device_count()
    n = 1
    while n * 2 <= min(count, 8):
        n *= 2
    if n >= 2:
        rows += _many_gpus(n)
    else:
        rows.append(_row("multi-GPU run", True, f"skipped: {count} GPU (nccl needs one GPU per rank)"))
    return rows


if __name__ == "__main__":
    for row in check():
        print(("ok  " if row["ok"] else "FAIL") + f"  {row['check']}: {row['value']}")
