"""Parameter copy reuse: the 10^8-pattern round trip, and optimizer step time against plain mixed precision.

    .venv/bin/python benchmarks/bench_param_reuse.py [--patterns 100000000] [--numel 16777216]
                                                     [--steps 3] [--rounds 7] [--chunk 1048576]

1. ``split``/``merge`` on ``--patterns`` random finite fp32 bit patterns (in chunks of 10^7): every one
   must come back bit for bit (the notes' 10^8 test; the unit tests run 2*10^7).
2. One optimizer step over ``--numel`` bf16 parameters (one flat tensor, as a sharded optimizer holds
   them), alternating rounds so load changes hit every variant:
     amp          MasterAdamW(rounding="nearest_even"): fp32 master + torch's single-tensor AdamW + cast
     torch-amp    torch.optim.AdamW(foreach=True) on an fp32 master, then ``bf16.copy_(master)``: the
                  production path of plain mixed precision
     reuse        ReuseAdamW: merge, the same AdamW, split (chunk of ``--chunk`` elements)
   Printed: trimmed-mean step time of each and the ratios reuse / amp and reuse / torch-amp, plus the
   resident optimizer-state bytes per parameter of each (storage nbytes).
Runs on CUDA when it is available (the same code), else on CPU.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from toolkit.runtime import machine  # noqa: E402

from toolkit.memory.param_reuse import MasterAdamW, ReuseAdamW, merge, split  # noqa: E402
from toolkit.runtime.bench import measure  # noqa: E402


def round_trip(patterns: int, chunk: int = 10_000_000, device: str = "cpu") -> tuple[int, float]:
    """Split and merge ``patterns`` random finite fp32 bit patterns; return (checked, seconds)."""
    g = torch.Generator(device=device).manual_seed(0)
    checked, start = 0, time.perf_counter()
    while checked < patterns:
        n = min(chunk, patterns - checked)
        x = torch.randint(0, 256, (4 * n,), dtype=torch.uint8, generator=g, device=device).view(torch.float32)
        x = x[torch.isfinite(x)]
        hi, lo = split(x)
        if not torch.equal(merge(hi, lo).view(torch.int32), x.view(torch.int32)):
            raise AssertionError(f"round trip failed in patterns {checked}..{checked + n}")
        checked += n  # the ~0.4% non-finite draws are skipped, not replaced
    return checked, time.perf_counter() - start


class TorchAMP:
    """Plain mixed precision with torch's production optimizer: AdamW on an fp32 master, cast back."""

    def __init__(self, param: torch.Tensor, lr: float):
        self.param = param
        self.master = param.detach().float().requires_grad_()
        self.opt = torch.optim.AdamW([self.master], lr=lr, foreach=True)

    def step(self) -> None:
        self.master.grad = self.param.grad.float()
        self.opt.step()
        self.param.copy_(self.master.detach())

    def state_bytes(self) -> int:
        return self.master.untyped_storage().nbytes() + sum(
            v.untyped_storage().nbytes() for s in self.opt.state.values() for v in s.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--patterns", type=int, default=100_000_000)
    ap.add_argument("--numel", type=int, default=1 << 24)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--chunk", type=int, default=1 << 20)
    args = ap.parse_args()
    print(f"machine: {machine.describe()}", flush=True)  # what the times below mean
    device = "cuda" if torch.cuda.is_available() else "cpu"

    n, secs = round_trip(args.patterns, device=device)
    print(f"round trip: {n:,} random bit patterns ({device}), all bit-exact, {secs:.1f} s")

    torch.manual_seed(0)
    init = (torch.randn(args.numel, device=device) * 0.02).bfloat16()
    grad = (torch.randn(args.numel, device=device) * 1e-3).bfloat16()
    params = {name: init.clone() for name in ("amp", "torch-amp", "reuse")}
    for p in params.values():
        p.grad = grad
    opts = {"amp": MasterAdamW([params["amp"]], lr=1e-3),
            "torch-amp": TorchAMP(params["torch-amp"], lr=1e-3),
            "reuse": ReuseAdamW([params["reuse"]], lr=1e-3, chunk_numel=args.chunk)}
    rounds: dict[str, list[float]] = {k: [] for k in opts}
    for r in range(args.rounds):
        for name, opt in opts.items():
            rounds[name].append(measure(opt.step, warmup=1 if r == 0 else 0, steps=args.steps, rounds=1).mean_s)
    trimmed = {k: statistics.fmean(sorted(v)[1:-1] if len(v) > 2 else v) for k, v in rounds.items()}
    state = {"amp": sum(t.untyped_storage().nbytes() for s in opts["amp"].state.values() for t in s.values()),
             "torch-amp": opts["torch-amp"].state_bytes(),
             "reuse": sum(t.untyped_storage().nbytes() for s in opts["reuse"].state.values() for t in s.values())}
    print(f"optimizer step over {args.numel:,} bf16 parameters on {device} "
          f"({args.rounds} alternating rounds x {args.steps} steps, trimmed mean):")
    for name in opts:
        print(f"  {name:>9}: {trimmed[name] * 1e3:8.2f} ms   optimizer state {state[name] / args.numel:.3f} B/param")
    print(f"  reuse / amp       = x{trimmed['reuse'] / trimmed['amp']:.3f}")
    print(f"  reuse / torch-amp = x{trimmed['reuse'] / trimmed['torch-amp']:.3f}")


if __name__ == "__main__":
    main()
