"""GPU check: activation offload's CUDA path (``toolkit.memory.offload``) driven by the pipeline executor:
D2H/H2D copies on side streams into pinned host buffers, ordered by events; gradients bitwise equal to no
offload, resident peak at most half, no late reload with prefetch. GPipe on one rank: both micro-batches
in flight before their backwards."""
from __future__ import annotations


def _step(setup, policy: str):
    from toolkit.memory.offload import ActivationOffloader, Offload, schedule_order
    from toolkit.models import lm_loss
    from toolkit.pipeline import ExecutorHook, PipelineExecutor, gpipe

    class Pinned(ExecutorHook):
        """After every action: whether each host copy the offloader holds is in pinned memory."""

        def after_action(self, action) -> None:
            pinned.extend(s.host.is_pinned() for g in off._live.values() for grp in g.values() for s in grp.stored
                          if s.host is not None)

    schedule = gpipe(1, setup.m)
    model = setup.fresh()
    modules = setup.stages(model, schedule, 0)
    off = ActivationOffloader(modules, schedule_order(schedule, 0), policy=policy)
    pinned: list[bool] = []
    ex = PipelineExecutor(schedule, 0, modules, lm_loss, setup.act_shape, device=setup.device,
                          hooks=[Offload(off), Pinned()])
    ex.step(setup.inputs, setup.targets)
    off.synchronize()
    off.remove()
    return [p.grad.clone() for p in model.parameters()], off, pinned


def check() -> list[dict]:
    import torch

    from toolkit.pipeline.harness import PipelineSetup
    torch.use_deterministic_algorithms(True)  # embedding backward without atomics: runs compare bitwise
    try:
        setup = PipelineSetup.build("smoke", m=2, micro_batch=2, device="cuda")
        ref, base, _ = _step(setup, "none")
        again, _, _ = _step(setup, "none")
        grads, off, pinned = _step(setup, "all")
        torch.cuda.synchronize()
    finally:
        torch.use_deterministic_algorithms(False)
    same = all(torch.equal(a, b) for a, b in zip(grads, ref))
    worst = max((a - b).abs().max().item() for a, b in zip(grads, ref))
    stats, peak, base_peak = off.stats, off.meter.max_by_category["act"], base.meter.max_by_category["act"]
    return [
        {"check": "offload (CUDA streams): a run without offload repeats bitwise",
         "ok": all(torch.equal(a, b) for a, b in zip(again, ref)), "value": "deterministic algorithms on"},
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
