"""Mixed precision, four ways, trained side by side on the same data.

::

    mode            weights     compute         grads   optimizer keeps            risk it manages
    fp32            fp32        fp32            fp32    m, v (fp32)                 none (the reference)
    bf16_autocast   fp32        bf16 matmuls    fp32    m, v                        none: bf16 has fp32's range
    fp16_scaler     fp32        fp16 matmuls    fp32    m, v + loss scale           fp16 underflow of small grads
    bf16_master     bf16        bf16            bf16    fp32 master, m, v           updates smaller than a bf16 ulp
    bf16_pure       bf16        bf16            bf16    m, v (bf16)                 -- none: shows why masters exist

``train`` returns the loss curve, the bytes per parameter in each category (read from
the tensors themselves), and for fp16 the loss-scale history and skipped steps.
"""
from __future__ import annotations

import torch

from .data import batches
from .models import GPT, GPTConfig

MODES = ("fp32", "bf16_autocast", "fp16_scaler", "bf16_master", "bf16_pure")


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def train(mode: str, cfg: GPTConfig, steps: int, batch_size: int, lr: float = 3e-3, seed: int = 0,
          device: str | torch.device = "cpu", on_step=None) -> dict:
    """Train the tiny GPT for ``steps`` steps in ``mode``; same init and data for every mode."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not known; allowed: {MODES}")
    torch.manual_seed(seed)
    model = GPT(cfg).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    dev_type = torch.device(device).type
    master = None
    if mode in ("bf16_master", "bf16_pure"):
        model.to(torch.bfloat16)
    if mode == "bf16_master":
        master = [p.detach().float().clone().requires_grad_(True) for p in model.parameters()]
        opt = torch.optim.AdamW(master, lr=lr)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
    scaler = torch.amp.GradScaler(dev_type) if mode == "fp16_scaler" else None
    autocast_dtype = {"bf16_autocast": torch.bfloat16, "fp16_scaler": torch.float16}.get(mode)
    losses, scales, skipped = [], [], 0
    for i, (x, y) in enumerate(batches(batch_size, cfg.seq_len, steps, seed=seed + 1)):
        x, y = x.to(device), y.to(device)
        with torch.autocast(dev_type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        if scaler:
            scaler.scale(loss).backward()
            before = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            skipped += int(scaler.get_scale() < before)
            scales.append(before)
        else:
            loss.backward()
            if master is not None:
                for m, p in zip(master, model.parameters()):
                    m.grad = p.grad.float()
                opt.step()
                with torch.no_grad():
                    for m, p in zip(master, model.parameters()):
                        p.copy_(m)
            else:
                opt.step()
        losses.append(loss.item())
        on_step and on_step(i + 1, steps)
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0]
    per_param = {
        "weights": _bytes(model.parameters()) / n_params,
        "grads": _bytes(p.grad for p in model.parameters()) / n_params,
        "master": _bytes(master) / n_params if master else 0.0,
        "optimizer": _bytes(state) / n_params,
    }
    return {"mode": mode, "losses": losses, "bytes_per_param": per_param, "loss_scales": scales,
            "skipped_steps": skipped, "n_params": n_params}
