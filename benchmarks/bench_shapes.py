"""Shapes-only timing on a laptop: how long the emulator takes to time a 13B step at its true shapes.

    .venv/bin/python benchmarks/bench_shapes.py

Target: a 13B model's step at pp x dp = 24 ranks on the emulated cluster in <= 60 s of wall
time on 2 cores. Timed here from cold caches: ``toolkit.planner_check.configuration_seconds`` for Llama-2-13B on
24 A100s (pp 8 x dp 3, 1F1B, 64 micro-batches of one 2048-token sequence), which traces one layer, the embedding
and the head at their true shapes with fake tensors (``toolkit.runtime.shapes``) and simulates the pipeline with
those costs; and, for scale, the whole MPT-13B step on 8 H100s with FSDP2 (``toolkit.models.real_runs``: every
layer traced). Prints the wall time of each part: where the time goes.
"""
from __future__ import annotations

import time

T0 = time.perf_counter()
import torch  # noqa: E402 - the import is part of what is timed

from toolkit.models import real_runs  # noqa: E402
from toolkit.planner import Assumptions, Workload  # noqa: E402
from toolkit.planner_check import configuration_seconds, unit_seconds  # noqa: E402
from toolkit.runtime.cluster import cluster  # noqa: E402

TARGET_S = 60.0


def main() -> None:
    imports = time.perf_counter() - T0
    w, hw, assume = Workload("llama2-13b", seq_len=2048, global_batch=192), cluster("a100-ib200"), Assumptions()
    row = {"dp": 3, "tp": 1, "pp": 8, "micro_batch": 1, "m": w.global_batch // 3, "schedule": "1f1b",
           "recompute": False, "zero": 1, "offload": "none"}
    t = time.perf_counter()
    unit_seconds(w.model, hw, w.seq_len, 1, 1)
    traced = time.perf_counter() - t
    t = time.perf_counter()
    step = configuration_seconds(w, hw, row, assume)
    simulated = time.perf_counter() - t
    t = time.perf_counter()
    run = next(r for r in real_runs.RUNS if r.model == "MPT-13b" and r.hardware.startswith("H100"))
    whole = real_runs.result(run)
    whole_s = time.perf_counter() - t
    total = imports + traced + simulated
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"Llama-2-13B, pp 8 x dp 3 on 24 A100s (modelled step {step['total']:.2f} s):")
    print(f"  imports           {imports:6.2f} s")
    print(f"  trace the units   {traced:6.2f} s   (a layer, the embedding, the head: forward, forward+backward)")
    print(f"  simulate + terms  {simulated:6.2f} s   (1F1B over 8 stages x {row['m']} micro-batches)")
    print(f"  total             {total:6.2f} s   target <= {TARGET_S:.0f} s: {'met' if total <= TARGET_S else 'NOT met'}")
    print(f"For scale, every layer traced: MPT-13B on 8 H100s with FSDP2, one optimizer step, {whole_s:.1f} s "
          f"(modelled {whole['emulated']:.0f} tokens/s per GPU against {whole['published']:.0f} published)")


if __name__ == "__main__":
    main()
