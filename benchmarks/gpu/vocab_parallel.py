"""GPU check: the ``VocabPasses`` hook's CUDA path (``toolkit.pipeline.vocab_passes``) on one GPU, nccl, one rank.

The comm thread runs C0 (and Algorithm 2's dX all-reduce) on a side CUDA stream, after an event recorded on
the compute stream, and the main thread uses its results once the side stream is synchronized. One rank holds
every stage and every vocabulary row, so the collectives are trivial, but the streams, events and threads are
the ones a multi-GPU run uses. Checked for both algorithms: loss and gradients equal the unsharded model
within ``TOL`` (1e-5, fp32), one C0 per micro-batch ran on the comm thread, and the rank held
p + 2 (Algorithm 1) and p + 1 (Algorithm 2) micro-batches of activations with p = 1.
"""
from __future__ import annotations

TOL = 1e-5  # fp32: the sharded softmax and the all-reduces only reorder sums


def run(backend: str, device: str) -> list[dict]:
    """The check's rows, with this process as the only rank (``backend`` on ``device``)."""
    import os
    import socket

    import torch.distributed as dist

    from toolkit.pipeline import vocab_parallel as vp
    from toolkit.pipeline import vocab_passes as vx
    from toolkit.pipeline.executor import PipelineExecutor
    from toolkit.pipeline.harness import PipelineSetup
    from toolkit.runtime.context import init_context

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    init_context(backend, timeout_s=120)
    rows = []
    try:
        setup = PipelineSetup.build("smoke", m=4, micro_batch=2, n_layer=2, vocab_size=1024, device=device)
        groups = vx.vocab_groups([0])
        costs = vp.StageCosts([{"F": 1.0, "B": 2.0, "S": 0.5, "T": 0.5}])
        for alg in vp.ALGORITHMS:
            model = setup.fresh()
            stage = vx.VocabStage(model, 0, 1)
            passes = vx.VocabPasses(stage, groups)
            ex = PipelineExecutor(vp.vocab_1f1b(1, setup.m, alg, costs), 0, {0: stage}, None, setup.act_shape,
                                  device=device, meter=True, hooks=[passes])
            loss = ex.step(setup.inputs, setup.targets)
            diff = vx.vocab_grad_diff(model, stage, setup.reference)
            c0 = sorted(s["mb"] for s in passes.comm_spans if s["kind"] == "C0")
            rows += [
                {"check": f"vocab parallel ({device}), Algorithm {alg}: loss and grads equal the unsharded model",
                 "ok": abs(loss - setup.ref_loss) <= TOL and diff <= TOL,
                 "value": f"|loss diff| {abs(loss - setup.ref_loss):.1e}, max |grad diff| {diff:.1e} (tol {TOL:g})"},
                {"check": f"vocab parallel ({device}), Algorithm {alg}: C0 of every micro-batch on the comm thread",
                 "ok": c0 == list(range(setup.m)), "value": f"C0 spans for micro-batches {c0}"},
                {"check": f"vocab parallel ({device}), Algorithm {alg}: micro-batches held = p + {3 - alg} (p = 1)",
                 "ok": passes.peak_held == 1 + 3 - alg, "value": str(passes.peak_held)},
            ]
    finally:
        dist.destroy_process_group()
    return rows


def check() -> list[dict]:
    return run("nccl", "cuda")
