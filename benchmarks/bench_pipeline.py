"""Step time of our pipeline executor against torch.distributed.pipelining, same schedule, model and data.

    python benchmarks/bench_pipeline.py [--world-size 2] [--preset default] [--rounds 7] [--steps 3]

For every schedule torch also has (GPipe, 1F1B, Interleaved1F1B, ZBVZeroBubble, DualPipeV) each rank
builds the same tiny GPT, cuts it the same way, and alternates rounds of ours and torch's (the order
flips every round, so both see the same machine load). Reported: median round time per step of each and
the ratio ours / torch (target <= 1.2). ZBVZeroBubble has no generator of ours: our executor runs torch's
own order (``from_torch("zbv")``), so that row compares the runtimes alone.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

NAMES = ("gpipe", "1f1b", "interleaved", "zbv", "dualpipev")


def rank_main(ctx, cfg: dict) -> dict:
    """Per rank: {schedule: {"ours_s": [...], "torch_s": [...]}} (seconds per step, one value per round)."""
    from toolkit.models import GPT, lm_loss, preset
    from toolkit.pipeline import PipelineExecutor, from_torch, make_schedule
    from toolkit.pipeline.executor import gpt_micro_batches, gpt_stages
    from toolkit.pipeline.torch_compare import TorchPipeline

    p, m = ctx.world_size, cfg["m"]
    model_cfg = preset(cfg["preset"], n_layer=cfg["n_layer"])
    inputs, targets = gpt_micro_batches(m, cfg["micro_batch"], model_cfg.seq_len)
    torch.manual_seed(0)
    base = GPT(model_cfg)
    out = {}
    for i, name in enumerate(cfg["schedules"]):
        ctx.progress(i, len(cfg["schedules"]), name)
        schedule = from_torch(name, p, m) if name == "zbv" else make_schedule(name, p, m)
        ours_model, torch_model = copy.deepcopy(base), copy.deepcopy(base)
        ours = PipelineExecutor(schedule, ctx.rank, gpt_stages(ours_model, schedule, ctx.rank), lm_loss,
                                (cfg["micro_batch"], model_cfg.seq_len, model_cfg.d_model))
        theirs = TorchPipeline(name, gpt_stages(torch_model, schedule, ctx.rank), schedule.n_stages, m, lm_loss)
        runners = {"ours": (ours_model, ours), "torch": (torch_model, theirs)}
        times = {"ours": [], "torch": []}
        for rnd in range(cfg["warmup_rounds"] + cfg["rounds"]):
            for impl in (("ours", "torch") if rnd % 2 == 0 else ("torch", "ours")):
                model, runner = runners[impl]
                ctx.barrier()
                start = time.perf_counter()
                for _ in range(cfg["steps"]):
                    model.zero_grad(set_to_none=True)
                    runner.step(inputs, targets)
                ctx.barrier()
                if rnd >= cfg["warmup_rounds"]:
                    times[impl].append((time.perf_counter() - start) / cfg["steps"])
        out[name] = {"ours_s": times["ours"], "torch_s": times["torch"]}
    ctx.progress(len(cfg["schedules"]), len(cfg["schedules"]), "done")
    return out


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # so the ranks can import benchmarks.bench_pipeline
    from toolkit import launch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--preset", default="default", choices=["smoke", "default", "full"])
    ap.add_argument("--m", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--warmup-rounds", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--schedules", nargs="*", default=list(NAMES), choices=NAMES)
    args = ap.parse_args()
    p = args.world_size
    if args.m < 2 * p or args.m % p:
        raise SystemExit(f"--m={args.m} must be >= 2 * world size and a multiple of it (DualPipeV, interleaved)")
    cfg = {"preset": args.preset, "n_layer": 4 * p if args.preset != "full" else 12, "m": args.m,
           "micro_batch": args.micro_batch, "rounds": args.rounds, "warmup_rounds": args.warmup_rounds,
           "steps": args.steps, "schedules": args.schedules}
    results = launch("benchmarks.bench_pipeline:rank_main", p, cfg, timeout_s=1800)
    print(f"\n{p} ranks, model preset {args.preset} with {cfg['n_layer']} layers, m = {args.m}, "
          f"micro-batch {args.micro_batch}; median over {args.rounds} rounds of {args.steps} steps")
    print(f"{'schedule':12s} {'ours (ms)':>10s} {'torch (ms)':>11s} {'ours/torch':>11s}")
    for name in args.schedules:
        ours = statistics.median(max(r[name]["ours_s"][i] for r in results) for i in range(args.rounds))
        theirs = statistics.median(max(r[name]["torch_s"][i] for r in results) for i in range(args.rounds))
        print(f"{name:12s} {ours * 1e3:10.2f} {theirs * 1e3:11.2f} {ours / theirs:11.3f}")


if __name__ == "__main__":
    main()
