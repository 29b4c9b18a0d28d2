"""GPU check of lesson 16: pipeline stages captured as CUDA graphs, replay vs eager; DP separation on NCCL.

``check()`` (run by ``benchmarks/gpu_check.sh``; assumes CUDA) returns rows ``{"check", "ok", "value"}``:

1. One GPU: the tiny GPT cut into 4 stages (DualPipeV's chunks for pp = 2), every stage captured with
   ``torch.cuda.make_graphed_callables`` (``toolkit.graphs.graph_stages``: a forward and a backward graph per
   stage, one memory pool). A step runs its micro-batches one at a time through the chain (one micro-batch in
   flight: each graph has one set of static buffers; Megatron keeps one graph per in-flight micro-batch
   instead). Checks: the graphed step gives the eager step's loss and gradients (bitwise reported, allclose
   required); replay vs eager step time at a small micro-batch (``bench.compare``, a synchronize per step);
   kernel launches per step from the profiler (``cudaLaunchKernel`` eager vs ``cudaGraphLaunch`` graphed),
   next to the eager step's ATen ops and compute ops (``OpCounter``: the lesson's estimate of launches).
2. With 2 or more GPUs: lesson 16 on NCCL (dp × pp = 2 × 2 with 4 GPUs, else 2 × 1): the separated DP
   all-reduce equal to the plain one bitwise, both equal to one process. Eager: no graphs in this run.

Not checked here: graphs inside DualPipeV's schedule (the lesson's executor), which would need a graph per
in-flight micro-batch (Megatron's per-micro-batch graphs, captured in schedule order on a shared pool) and
separate graphs for a chunk's I and W. Check 1 is a sequential chain, check 2 runs without graphs.
"""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def _row(check: str, ok: bool, value) -> dict:
    return {"check": f"cuda_graphs: {check}", "ok": bool(ok), "value": str(value)}


def _launches(step) -> dict[str, int]:
    """cudaLaunchKernel / cudaGraphLaunch calls in one ``step()`` (torch.profiler, CUDA runtime events)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    return {k: sum(1 for n in names if n == k) for k in ("cudaLaunchKernel", "cudaGraphLaunch")}


def _aten_ops(step) -> str:
    """ATen ops dispatched by one ``step()``: all, and the compute ops among them (views and empty
    allocations launch no kernel; ``toolkit.graphs.OpCounter``), to set beside ``cudaLaunchKernel``."""
    from toolkit.graphs import OpCounter
    try:
        with OpCounter() as ops:
            step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return f"ATen ops {ops.total}, of them compute ops {ops.compute}"
    except Exception as err:  # noqa: BLE001 (reported next to the launch counts)
        return f"ATen op count failed: {type(err).__name__}: {err}"[:200]


def single_gpu(n_layer: int = 4, n_stages: int = 4, m: int = 8, micro_batch: int = 2) -> list[dict]:
    from toolkit.graphs import graph_stages
    from toolkit.models import GPT, lm_loss, preset, split_stages
    from toolkit.pipeline.harness import gpt_micro_batches
    from toolkit.runtime.bench import compare

    dev = torch.device("cuda", 0)
    mc = preset("default", n_layer=n_layer)
    inputs, targets = gpt_micro_batches(m, micro_batch, mc.seq_len, seed=0)
    inputs, targets = [x.to(dev) for x in inputs], [y.to(dev) for y in targets]
    torch.manual_seed(0)
    eager_model = GPT(mc).to(dev)
    graphed_model = copy.deepcopy(eager_model)
    eager = split_stages(eager_model, n_stages)
    samples = [(inputs[0].clone(),)] + [
        (torch.randn(micro_batch, mc.seq_len, mc.d_model, device=dev, requires_grad=True),) for _ in range(n_stages - 1)]
    graphed = graph_stages(split_stages(graphed_model, n_stages), samples)

    def step(model, stages, set_to_none):
        def run():
            model.zero_grad(set_to_none=set_to_none)  # graphed: in place (see graph_stages)
            total = torch.zeros((), device=dev)
            for x, y in zip(inputs, targets):  # one micro-batch in flight: forward through the chain, backward
                for stage in stages:
                    x = stage(x)
                loss = lm_loss(x, y) / m
                loss.backward()
                total += loss.detach()
            return total
        return run

    run_eager, run_graphed = step(eager_model, eager, True), step(graphed_model, graphed, False)
    loss_e, loss_g = run_eager(), run_graphed()
    torch.cuda.synchronize()
    pairs = list(zip(eager_model.parameters(), graphed_model.parameters()))
    bitwise = torch.equal(loss_e, loss_g) and all(torch.equal(a.grad, b.grad) for a, b in pairs)
    worst = max((a.grad - b.grad).abs().max().item() for a, b in pairs)
    rows = [_row("graphed step == eager step (loss, every gradient)", worst <= 1e-5 and
                 abs(loss_e.item() - loss_g.item()) <= 1e-6,
                 f"bitwise {bitwise}, max grad diff {worst:.3g}, loss {loss_e.item():.6f} vs {loss_g.item():.6f}")]
    t = {k: v.mean_s for k, v in compare({"eager": run_eager, "graphed": run_graphed}, warmup=3, steps=10,
                                           rounds=5).items()}
    rows.append(_row(f"replay vs eager step time ({n_stages} stages, m={m}, micro-batch {micro_batch}, "
                     f"d_model {mc.d_model})", t["graphed"] < t["eager"],
                     f"eager {t['eager'] * 1e3:.2f} ms, graphed {t['graphed'] * 1e3:.2f} ms, "
                     f"speed-up {t['eager'] / t['graphed']:.2f}x"))
    try:
        le, lg = _launches(run_eager), _launches(run_graphed)
        rows.append(_row("kernel launches per step: eager cudaLaunchKernel vs graphed cudaGraphLaunch",
                         lg["cudaGraphLaunch"] > 0 and lg["cudaLaunchKernel"] < le["cudaLaunchKernel"],
                         f"eager {le}, graphed {lg}; eager step: {_aten_ops(run_eager)}"))
    except Exception as err:  # noqa: BLE001 (the profiler may be unavailable; reported)
        rows.append(_row("kernel launches per step (profiler)", False, f"{type(err).__name__}: {err}"[:200]))
    return rows


def check() -> list[dict]:
    rows = single_gpu()
    n = torch.cuda.device_count()
    if n < 2:
        rows.append(_row("DP separation on NCCL", True, f"not run: {n} GPU (needs 2)"))
        return rows
    from toolkit import launch
    world, grid = (4, {"dp": 2, "pp": 2}) if n >= 4 else (2, {"dp": 2, "pp": 1, "n_layer": 2})
    res = launch("l16_cuda_graphs", world, {"preset": "smoke", **grid}, backend="nccl", timeout_s=900, progress="none")
    rows.append(_row(f"DP separation on NCCL (dp={grid['dp']}, pp={grid['pp']}): bitwise == plain",
                     all(r["grads_bitwise_plain_vs_separated"] and r["losses_equal"] for r in res),
                     [r["grads_bitwise_plain_vs_separated"] for r in res]))
    worst = max(r["runs"][v]["grad_max_diff"] for r in res for v in ("plain", "separated"))
    rows.append(_row("DP separation on NCCL: == one process (max |grad diff| <= 1e-4)", worst <= 1e-4, f"{worst:.3g}"))
    return rows


if __name__ == "__main__":
    for row in check():
        print(f"{'ok ' if row['ok'] else 'FAIL'}  {row['check']}: {row['value']}")
