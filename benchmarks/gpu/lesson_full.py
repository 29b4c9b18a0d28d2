"""GPU check: a lesson at preset ``full`` on one GPU (nccl, world size 1), with its invariants.

Lesson 10 (recompute in the pipeline bubble) allows world size 1: every stage is local, so the executor's
CUDA path (compute-stream spans, activation meter, the harness's timing) runs on the full-size model. With one
rank 1F1B holds one micro-batch at a time, so nothing is checkpointed: the check says so instead of pretending.
"""
from __future__ import annotations

import time

LESSON, PRESET = "l10_recompute_bubbles", "full"


def check() -> list[dict]:
    from toolkit import launch
    start = time.monotonic()
    results = launch(LESSON, 1, {"preset": PRESET}, backend="nccl", timeout_s=360, progress="none")
    wall = time.monotonic() - start
    r = results[0]
    runs = r["runs"]
    diff = max(x["grad_diff"] for x in runs.values())
    steps = ", ".join(f"{mode} {x['bench']['mean_s'] * 1e3:.1f} ms" for mode, x in runs.items())
    return [
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
