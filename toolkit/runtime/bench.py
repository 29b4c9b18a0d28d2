"""The benchmark procedure of the source article, made explicit and reusable.

    fixed seeds ─► warm-up steps (not timed) ─► R rounds x S timed steps ─► trimmed mean of round means
                                                                          └─► stability metrics

Stability metrics (the article's definitions, computed from this run):
- throughput stability  = std / mean of step time over all timed steps (article target < 5%)
- memory volatility     = std / mean of sampled memory (article target < 8%)
- comm efficiency ratio = comm time / (step time - compute time) (article target > 75%)

On CUDA each step is closed with ``torch.cuda.synchronize()`` so the clock measures
the work, not its launch.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch


@dataclass
class BenchResult:
    mean_s: float
    """Trimmed mean of the per-round mean step times (the ``trim`` highest and lowest rounds dropped)."""
    median_s: float
    """Median of all timed steps."""
    std_s: float
    """Standard deviation of all timed steps."""
    throughput_stability: float
    """std / mean of all timed steps."""
    round_means_s: list[float]
    """Mean step time of each round, in order."""
    step_times_s: list[float]
    """Every timed step, in order."""

    def to_dict(self) -> dict:
        return asdict(self)


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def measure(step: Callable[[], object], warmup: int = 2, steps: int = 5, rounds: int = 3, trim: int = 1,
            on_step: Callable[[int, int], None] | None = None) -> BenchResult:
    """Time ``step()``: ``warmup`` untimed calls, then ``rounds`` rounds of ``steps`` timed calls.

    ``trim`` rounds are dropped from each end before averaging (needs ``rounds > 2*trim``; with fewer
    rounds nothing is trimmed). ``on_step(done, total)`` is called after each call, e.g. ``ctx.progress``.
    """
    if warmup < 0 or steps < 1 or rounds < 1 or trim < 0:
        raise ValueError(f"need warmup >= 0, steps >= 1, rounds >= 1, trim >= 0; got {warmup}, {steps}, {rounds}, {trim}")
    total, done = warmup + steps * rounds, 0
    for _ in range(warmup):
        step()
        done += 1
        on_step and on_step(done, total)
    _sync()
    times, round_means = [], []
    for _ in range(rounds):
        these = []
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            _sync()
            these.append(time.perf_counter() - t0)
            done += 1
            on_step and on_step(done, total)
        times += these
        round_means.append(statistics.fmean(these))
    kept = sorted(round_means)[trim:len(round_means) - trim] if rounds > 2 * trim else round_means
    mean_all = statistics.fmean(times)
    std = statistics.pstdev(times)
    return BenchResult(statistics.fmean(kept), statistics.median(times), std, std / mean_all if mean_all else 0.0,
                       round_means, times)


def memory_volatility(bytes_samples: list[float]) -> float:
    """std / mean of memory samples (0 for an empty or all-zero series)."""
    if not bytes_samples:
        return 0.0
    mean = statistics.fmean(bytes_samples)
    return statistics.pstdev(bytes_samples) / mean if mean else 0.0


def comm_efficiency_ratio(comm_s: float, step_s: float, compute_s: float) -> float:
    """The article's ratio: communication time / (step time - compute time); >1 means comm overlapped compute."""
    idle = step_s - compute_s
    return comm_s / idle if idle > 0 else float("inf")
