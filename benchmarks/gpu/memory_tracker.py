"""GPU check: ``MemoryTracker`` on CUDA tensors — exact bytes by category beside the caching allocator's
``max_memory_allocated`` (which rounds blocks up to 512 B and also holds what the tracker does not see)."""
from __future__ import annotations


def check() -> list[dict]:
    import torch

    from toolkit.models import GPT, preset
    from toolkit.runtime.memory import MemoryTracker

    torch.manual_seed(0)
    cfg = preset("smoke")
    model = GPT(cfg).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, cfg.vocab_size, (8, cfg.seq_len), device="cuda")
    torch.cuda.synchronize()
    with MemoryTracker(model, opt) as mem:
        loss = model(x, x)
        mem.mark("backward")
        loss.backward()
        mem.mark("optimizer")
        opt.step()
        mem.mark("end")
    torch.cuda.synchronize()
    s = mem.summary()
    cuda_max, peak = s.get("cuda_max_memory_allocated"), s["peak"]["total"]
    cats = {k: v for k, v in s["max_by_category"].items() if k in ("param", "grad", "optim", "act")}
    return [
        {"check": "memory tracker: CUDA max_memory_allocated reported", "ok": bool(cuda_max),
         "value": f"{cuda_max} B"},
        {"check": "memory tracker: exact peak <= allocator peak", "ok": bool(cuda_max) and peak <= cuda_max,
         "value": f"{peak:,} B counted, {cuda_max or 0:,} B allocated ({(cuda_max or 0) / max(peak, 1):.2f}x)"},
        {"check": "memory tracker: params, grads, optimizer state, activations seen on CUDA",
         "ok": all(v > 0 for v in cats.values()) and len(cats) == 4, "value": str(cats)},
        {"check": "memory tracker: param bytes = model's", "ok": s["max_by_category"]["param"] == sum(
            p.numel() * p.element_size() for p in model.parameters()), "value": f"{s['max_by_category']['param']:,} B"},
    ]
