"""GPU check: activation offload's CUDA path (``toolkit.memory.offload``): D2H/H2D copies on side streams
into pinned host buffers, ordered by events; gradients bitwise equal to no offload, resident peak lower,
no late reload with prefetch."""
from __future__ import annotations

ORDER = [("F", (0, 0, 0)), ("F", (0, 1, 0)), ("B", (0, 0, 0)), ("B", (0, 1, 0))]  # two in flight, as GPipe


def _run(policy: str | None):
    import torch

    from toolkit.memory.offload import ActivationOffloader
    from toolkit.models import GPT, lm_loss, preset

    torch.manual_seed(0)
    model = GPT(preset("smoke")).cuda()
    x = torch.randint(0, 256, (2, 2, 32), generator=torch.Generator().manual_seed(1)).cuda()
    off = ActivationOffloader({0: model}, ORDER, policy=policy) if policy else None
    pinned = []
    losses = []
    for mb in range(2):
        with off.forward((0, mb, 0)) if off else torch.enable_grad():
            losses.append(lm_loss(model(x[mb]), x[mb]))
        if off:
            pinned += [s.host.is_pinned() for g in off._live[(0, mb, 0)].values() for s in g.stored
                       if s.host is not None]
    for mb in range(2):
        if off:
            off.backward_begin((0, mb, 0))
        losses[mb].backward()
        if off:
            off.backward_end((0, mb, 0))
    if off:
        off.synchronize()
        off.remove()
    torch.cuda.synchronize()
    return [p.grad.clone() for p in model.parameters()], off, pinned


def check() -> list[dict]:
    import torch
    torch.use_deterministic_algorithms(True)  # embedding backward: no atomics, so runs can be compared bitwise
    try:
        ref, _, _ = _run(None)
        again, _, _ = _run(None)
        _, base, _ = _run("none")
        grads, off, pinned = _run("all")
    finally:
        torch.use_deterministic_algorithms(False)
    same = all(torch.equal(a, b) for a, b in zip(grads, ref))
    worst = max((a - b).abs().max().item() for a, b in zip(grads, ref))
    stats, peak, base_peak = off.stats, off.meter.max_by_category["act"], base.meter.max_by_category["act"]
    return [
        {"check": "offload (CUDA streams): reference run repeats bitwise", "ok": all(
            torch.equal(a, b) for a, b in zip(again, ref)), "value": "deterministic algorithms on"},
        {"check": "offload (CUDA streams): grads bitwise equal to no offload", "ok": same,
         "value": "bitwise" if same else f"max |diff| {worst:.2e}"},
        {"check": "offload (CUDA streams): bytes moved out and back", "ok": stats["offloaded_bytes"] > 0 and
         stats["offloaded_bytes"] == stats["reloaded_bytes"] + stats["wasted_copy_bytes"], "value": str(stats)},
        {"check": "offload (CUDA streams): host buffers pinned", "ok": bool(pinned) and all(pinned),
         "value": f"{sum(pinned)}/{len(pinned)} pinned"},
        {"check": "offload (CUDA streams): resident peak <= half of no offload, no late reload",
         "ok": peak <= 0.5 * base_peak and stats["late_reloads"] == 0,
         "value": f"{peak:,} B vs {base_peak:,} B, late reloads {stats['late_reloads']}"},
    ]
