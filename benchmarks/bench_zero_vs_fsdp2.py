"""Step time of the toolkit's ZeRO-3 as a ratio to FSDP2 ``fully_shard``, same model, data and ranks.

    .venv/bin/python benchmarks/bench_zero_vs_fsdp2.py [--preset default] [--world-size 2]
                                                      [--steps 5] [--rounds 7] [--warmup 3]

Both shard the tiny GPT by the same units (embedding, each block, head) with AdamW on the shards.
Rounds alternate (ZeRO-3 S steps, FSDP2 S steps, ...) after a warm-up of each, so a change in the
machine's load hits both; the trimmed mean drops the slowest and fastest round of each. Printed:
each side's trimmed-mean step time, the ratio ZeRO-3 / FSDP2 (and the median of per-round ratios),
bytes sent per step (ledger) and the seconds the ledger saw inside collectives.
Both prefetch the next unit's all-gather one unit ahead (the toolkit's ``ZeroDataParallel`` by
default; FSDP2 on GPUs on a separate stream); the toolkit's ZeRO-3 does no bucketing across units,
FSDP2 keeps per-parameter sharding.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from toolkit import launch  # noqa: E402
from toolkit.runtime import machine  # noqa: E402

VARIANTS = {"zero3": {"kind": "zero", "stage": 3}, "fsdp2": {"kind": "fsdp2", "reshard": True}}  # DataParallelTrainer


def rank_main(ctx, cfg):
    """Per rank: build both, warm up, then alternate timed rounds; return round means and ledger totals."""
    import functools

    import torch

    from toolkit.data import batches
    from toolkit.models import GPT, preset
    from toolkit.parallel.trainer import DataParallelTrainer
    from toolkit.parallel.zero import adamw
    from toolkit.runtime.bench import measure
    torch.manual_seed(0)
    base = GPT(preset(cfg["preset"])).to(ctx.device)
    x, y = (t.to(ctx.device) for t in next(batches(cfg["batch_size"], base.cfg.seq_len, 1, rank=ctx.rank,
                                                      world=ctx.world_size)))
    optimizer = functools.partial(adamw, lr=1e-4)
    trainers = {v: DataParallelTrainer(base=base, optimizer=optimizer, **kw) for v, kw in VARIANTS.items()}
    steps = {v: (lambda t=t: (t.fwd_bwd(x, y), t.step())) for v, t in trainers.items()}
    rounds: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(cfg["rounds"]):
        for v in VARIANTS:
            with ctx.ledger.tag(v):
                res = measure(steps[v], warmup=cfg["warmup"] if r == 0 else 0, steps=cfg["steps"], rounds=1)
            rounds[v].append(res.mean_s)
        ctx.progress(r + 1, cfg["rounds"], "rounds")
    n_steps = cfg["rounds"] * cfg["steps"] + cfg["warmup"]
    return {"round_means_s": rounds,
            "bytes_per_step": {v: ctx.ledger.total("sent_bytes", tag=v) // n_steps for v in VARIANTS},
            "comm_s_per_step": {v: ctx.ledger.total("seconds", tag=v) / n_steps for v in VARIANTS},
            "numel": sum(p.numel() for p in base.parameters())}


def trimmed_mean(xs: list[float], trim: int = 1) -> float:
    kept = sorted(xs)[trim:len(xs) - trim] if len(xs) > 2 * trim else xs
    return statistics.fmean(kept)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="default")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=3)
    a = ap.parse_args()
    print(f"machine: {machine.describe()}", flush=True)  # what the times below mean
    cfg = {"preset": a.preset, "batch_size": a.batch_size, "steps": a.steps, "rounds": a.rounds, "warmup": a.warmup}
    res = launch("benchmarks.bench_zero_vs_fsdp2:rank_main", a.world_size, cfg, timeout_s=1200, progress="plain")
    r0 = res[0]
    mean = {v: trimmed_mean(r0["round_means_s"][v]) for v in VARIANTS}
    per_round = [z / f for z, f in zip(r0["round_means_s"]["zero3"], r0["round_means_s"]["fsdp2"])]
    print(f"\nZeRO-3 (toolkit) vs FSDP2, preset={a.preset}, {r0['numel']:,} params, {a.world_size} ranks, "
          f"{a.rounds} rounds x {a.steps} steps (rank 0)")
    for v in VARIANTS:
        print(f"  {v:6s} step {mean[v] * 1e3:8.2f} ms   sent {r0['bytes_per_step'][v]:>12,} B/step   "
              f"in collectives {r0['comm_s_per_step'][v] * 1e3:7.2f} ms/step")
    print(f"  ratio ZeRO-3 / FSDP2 (trimmed means) = {mean['zero3'] / mean['fsdp2']:.3f}"
          f"   (median of per-round ratios {statistics.median(per_round):.3f})")


if __name__ == "__main__":
    main()
