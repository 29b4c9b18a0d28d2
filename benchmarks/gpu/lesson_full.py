"""GPU check: a lesson at preset ``full`` on one GPU (nccl, world size 1), with its invariants.

Lesson 10 (recompute in the pipeline bubble) allows world size 1: every stage is local, so the executor's
CUDA path (compute-stream spans, activation meter, the harness's timing) runs on the full-size model. With one
rank 1F1B holds one micro-batch at a time, so nothing is checkpointed: the check says so instead of pretending.
"""
from __future__ import annotations

import time

LESSON, PRESET = "l10_recompute_bubbles", "full"


def _in_process(cfg: dict) -> list[dict]:
    """The lesson as one rank in this process (nccl, world size 1), without the launcher."""
    import importlib
    import os
    import socket

    import torch.distributed as dist

    from toolkit.runtime.context import init_context
    module = importlib.import_module(f"toolkit.lessons.{LESSON}")
    cfg = module.validate(dict(cfg), 1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    ctx = init_context("nccl", timeout_s=300)
    try:
        return [module.run(ctx, cfg)]
    finally:
        dist.destroy_process_group()


def check() -> list[dict]:
    from toolkit import launch
    rows, start = [], time.monotonic()
    try:
        results = launch(LESSON, 1, {"preset": PRESET}, backend="nccl", timeout_s=360, progress="none")
    except Exception as exc:  # noqa: BLE001
        if "at least 2 processes" not in str(exc):
            raise
        # accelerate refuses --multi_gpu with one process: a launcher defect, reported as such; the lesson
        # itself still runs, in this process
        rows.append({"check": "launch(world_size=1) on one GPU", "ok": False,
                     "value": "accelerate: 'You need to use at least 2 processes to use --multi_gpu'"})
        start = time.monotonic()
        results = _in_process({"preset": PRESET})
    wall = time.monotonic() - start
    r = results[0]
    runs = r["runs"]
    diff = max(x["grad_diff"] for x in runs.values())
    steps = ", ".join(f"{mode} {x['bench']['mean_s'] * 1e3:.1f} ms" for mode, x in runs.items())
    return rows + [
        {"check": f"{LESSON} at {PRESET} on 1 GPU: runs", "ok": True,
         "value": f"{wall:.0f} s wall; {r['model']['n_layer']} layers d={r['model']['d_model']}, m={r['m']}; {steps}"},
        {"check": f"{LESSON} at {PRESET}: grads with recompute bitwise those without",
         "ok": r["bitwise_equal_to_none"] == {"inline": True, "bubble": True}, "value": str(r["bitwise_equal_to_none"])},
        {"check": f"{LESSON} at {PRESET}: grads equal one process (<= 1e-5)", "ok": diff <= 1e-5,
         "value": f"max |diff| {diff:.1e}"},
        # one rank holds one micro-batch at a time under 1F1B, so keep >= 1 checkpoints nothing: peaks equal
        {"check": f"{LESSON} at {PRESET}: activation peak lower exactly when forwards are checkpointed",
         "ok": (runs["bubble"]["peak_act_bytes"] < runs["none"]["peak_act_bytes"]) == bool(runs["bubble"]["checkpointed"]),
         "value": f"{len(runs['bubble']['checkpointed'])} checkpointed; {runs['bubble']['peak_act_bytes']:,} B vs "
                  f"{runs['none']['peak_act_bytes']:,} B"},
    ]
