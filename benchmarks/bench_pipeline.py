"""Step time of our pipeline executor against torch.distributed.pipelining, same schedule, model and data.

    python benchmarks/bench_pipeline.py [--world-size 2] [--preset default] [--rounds 7] [--steps 3]

For every schedule torch also has (GPipe, 1F1B, Interleaved1F1B, ZBVZeroBubble, DualPipeV) each rank
builds the same tiny GPT (``toolkit.pipeline.harness.PipelineSetup``), cuts it the same way, checks one step of
each against the single-process reference, and times ours and torch's side by side with
``toolkit.runtime.bench.compare`` (rounds, the order rotating, so both see the same machine load). Reported:
median over rounds of the slowest rank's mean step time, for each, and the ratio ours / torch (target <= 1.2).
ZBVZeroBubble has no generator of ours: our executor runs torch's own order (``from_torch("zbv")``), so that
row compares the runtimes alone. A schedule this torch cannot run (``toolkit.runtime.compat``: DualPipeV
needs torch >= 2.9) is left out, and the script says why. One progress bar: each schedule is one slice of
it (``ctx.part``), filled by the harness's checked and timed steps.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

NAMES = ("gpipe", "1f1b", "interleaved", "zbv", "dualpipev")


def rank_main(ctx, cfg: dict) -> dict:
    """Per rank: {schedule: {"ours_s": [...], "torch_s": [...]}} (seconds per step, one value per round)."""
    from toolkit.pipeline.harness import Job, PipelineSetup, measure_schedules
    from toolkit.pipeline.schedule import from_torch, make_schedule

    p = ctx.world_size
    setup = PipelineSetup.build(cfg["preset"], n_layer=cfg["n_layer"], m=cfg["m"], micro_batch=cfg["micro_batch"],
                                device=ctx.device)
    out = {}
    for i, name in enumerate(cfg["schedules"]):
        with ctx.part(i, len(cfg["schedules"]), name):
            schedule = from_torch(name, p, cfg["m"]) if name == "zbv" else make_schedule(name, p, cfg["m"])
            torch_schedule = make_schedule(name, p, cfg["m"]) if name != "zbv" else schedule
            records, _ = measure_schedules(ctx, setup, [Job(schedule), Job(torch_schedule, impl="torch")],
                                           warmup=cfg["warmup"], steps=cfg["steps"], rounds=cfg["rounds"])
        ours, theirs = records
        out[name] = {"ours_s": ours["bench"]["round_means_s"], "torch_s": theirs["bench"]["round_means_s"],
                     "grad_diff": max(ours["grad_diff"], theirs["grad_diff"])}
    return out


def unavailable(names: list[str]) -> dict[str, str]:
    """{schedule: why this torch cannot run it} for the schedules of ``names`` that it cannot run here."""
    from toolkit.pipeline.schedule import torch_order_missing
    from toolkit.pipeline.torch_compare import runtime_missing

    reasons = {name: runtime_missing(name) or (torch_order_missing(name) if name == "zbv" else None)
               for name in names}
    return {name: why for name, why in reasons.items() if why}


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # so the ranks can import benchmarks.bench_pipeline
    from toolkit import launch
    from toolkit.runtime import machine

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--preset", default="default", choices=["smoke", "default", "full"])
    ap.add_argument("--m", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps of each before timing")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--schedules", nargs="*", default=list(NAMES), choices=NAMES)
    args = ap.parse_args()
    print(f"machine: {machine.describe()}", flush=True)  # what the times below mean
    p = args.world_size
    if args.m < 2 * p or args.m % p:
        raise SystemExit(f"--m={args.m} must be >= 2 * world size and a multiple of it (DualPipeV, interleaved)")
    skipped = unavailable(args.schedules)
    for name, why in skipped.items():
        print(f"{name}: not run, {why}")
    schedules = [name for name in args.schedules if name not in skipped]
    cfg = {"preset": args.preset, "n_layer": 4 * p if args.preset != "full" else 12, "m": args.m,
           "micro_batch": args.micro_batch, "rounds": args.rounds, "warmup": args.warmup,
           "steps": args.steps, "schedules": schedules}
    results = launch("benchmarks.bench_pipeline:rank_main", p, cfg, timeout_s=1800)
    print(f"\n{p} ranks, model preset {args.preset} with {cfg['n_layer']} layers, m = {args.m}, "
          f"micro-batch {args.micro_batch}; median over {args.rounds} rounds of {args.steps} steps")
    print(f"{'schedule':12s} {'ours (ms)':>10s} {'torch (ms)':>11s} {'ours/torch':>11s} {'max grad diff':>14s}")
    for name in schedules:
        ours = statistics.median(max(r[name]["ours_s"][i] for r in results) for i in range(args.rounds))
        theirs = statistics.median(max(r[name]["torch_s"][i] for r in results) for i in range(args.rounds))
        diff = max(r[name]["grad_diff"] for r in results)
        print(f"{name:12s} {ours * 1e3:10.2f} {theirs * 1e3:11.2f} {ours / theirs:11.3f} {diff:14.1e}")


if __name__ == "__main__":
    main()
