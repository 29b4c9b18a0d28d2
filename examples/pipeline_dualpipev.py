"""Pipeline a plain MLP with DualPipeV on 2 ranks and check its gradients against one process.

    python examples/pipeline_dualpipev.py

Each rank builds the same 8-layer MLP, keeps the two stages DualPipeV's V gives it (rank 0: stages 0 and 3,
rank 1: stages 1 and 2), runs one training step over 8 micro-batches through the executor, and compares
its parameters' gradients with a single-process step over the same micro-batches (mean loss).
"""
import copy

import torch
import torch.nn.functional as F
from tiny_models import mlp

from toolkit import PipelineExecutor, dualpipev, launch, pipeline_stages


def experiment(ctx, cfg):
    p, m, b, d = ctx.world_size, cfg["m"], cfg["micro_batch"], cfg["d"]
    model = mlp(d, cfg["layers"], seed=0)  # the same weights on every rank
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(1)
    inputs = [torch.randn(b, d, generator=gen) for _ in range(m)]
    targets = [torch.randn(b, d, generator=gen) for _ in range(m)]
    for x, y in zip(inputs, targets):  # one process: every micro-batch in order, mean loss
        (F.mse_loss(reference(x), y) / m).backward()

    schedule = dualpipev(p, m)
    mine = pipeline_stages(model, schedule, ctx.rank)  # {stage: nn.Sequential}, parameters shared with model
    executor = PipelineExecutor(schedule, ctx.rank, mine, F.mse_loss, act_shape=(b, d), timeline=ctx.timeline)
    loss = executor.step(inputs, targets)

    ref = dict(reference.named_parameters())
    names = {id(prm): n for n, prm in model.named_parameters()}
    pairs = [(prm.grad, ref[names[id(prm)]].grad) for stage in mine.values() for prm in stage.parameters()]
    return {"stages": sorted(mine), "loss": loss, "ref_loss": sum(F.mse_loss(reference(x), y).item()
                                                                   for x, y in zip(inputs, targets)) / m,
            "max_grad_diff": max((g - r).abs().max().item() for g, r in pairs),
            "grads_bitwise_equal": all(torch.equal(g, r) for g, r in pairs),
            "ops": [s["kind"] for s in ctx.timeline.to_json()]}


if __name__ == "__main__":
    results = launch(experiment, world_size=2, cfg={"m": 8, "micro_batch": 4, "d": 64, "layers": 8})
    for rank, r in enumerate(results):
        print(f"rank {rank}: stages {r['stages']}, max |grad - one process| = {r['max_grad_diff']:.2e}, "
              f"bitwise equal: {r['grads_bitwise_equal']}, actions: {' '.join(r['ops'])}")
    assert [r["stages"] for r in results] == [[0, 3], [1, 2]]  # the V
    assert abs(results[0]["loss"] - results[0]["ref_loss"]) < 1e-5  # the last stage (3) lives on rank 0
    assert all(r["max_grad_diff"] < 1e-6 for r in results), "pipeline gradients differ from one process"
    print(f"loss {results[0]['loss']:.6f} = one process {results[0]['ref_loss']:.6f}")
