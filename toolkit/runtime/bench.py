"""The benchmark procedure of the source article, made explicit and reusable.

    fixed seeds ─► warm-up steps (not timed) ─► R rounds x S timed steps ─► trimmed mean of round means
                                                                          └─► stability metrics

``measure`` times one step function; ``compare`` times several side by side (round-robin, the order
rotating each round), which is how every lesson puts a technique next to its baseline.

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


def summarize(step_times_s: list[float], steps: int, trim: int = 1) -> BenchResult:
    """The article's statistics over timed steps taken in rounds of ``steps``: the trimmed mean of the round
    means (``trim`` rounds dropped at each end when more than ``2*trim`` rounds ran), median, std, stability."""
    if not step_times_s or len(step_times_s) % steps:
        raise ValueError(f"need a positive multiple of steps={steps} step times, got {len(step_times_s)}")
    rounds = len(step_times_s) // steps
    round_means = [statistics.fmean(step_times_s[i * steps:(i + 1) * steps]) for i in range(rounds)]
    kept = sorted(round_means)[trim:rounds - trim] if rounds > 2 * trim else round_means
    mean_all = statistics.fmean(step_times_s)
    std = statistics.pstdev(step_times_s)
    return BenchResult(statistics.fmean(kept), statistics.median(step_times_s), std,
                       std / mean_all if mean_all else 0.0, round_means, list(step_times_s))


def _check_procedure(warmup: int, steps: int, rounds: int, trim: int) -> None:
    if warmup < 0 or steps < 1 or rounds < 1 or trim < 0:
        raise ValueError(f"need warmup >= 0, steps >= 1, rounds >= 1, trim >= 0; got {warmup}, {steps}, {rounds}, {trim}")


def _timed(step: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    step()
    _sync()
    return time.perf_counter() - t0


def measure(step: Callable[[], object], warmup: int = 2, steps: int = 5, rounds: int = 3, trim: int = 1,
            on_step: Callable[[int, int], None] | None = None) -> BenchResult:
    """Time ``step()``: ``warmup`` untimed calls, then ``rounds`` rounds of ``steps`` timed calls.

    ``trim`` rounds are dropped from each end before averaging (needs ``rounds > 2*trim``; with fewer
    rounds nothing is trimmed). ``on_step(done, total)`` is called after each call, e.g. ``ctx.progress``.
    To time several variants against each other use ``compare`` (they then share the machine's load).
    """
    _check_procedure(warmup, steps, rounds, trim)
    total, done, times = warmup + steps * rounds, 0, []
    for i in range(total):
        if i < warmup:
            step()
            _sync()
        else:
            times.append(_timed(step))
        done += 1
        on_step and on_step(done, total)
    return summarize(times, steps, trim)


def compare(candidates: dict[str, Callable[[], object]], warmup: int = 1, steps: int = 3, rounds: int = 5,
            trim: int = 1, sync: Callable[[], None] | None = None,
            on_round: Callable[[int, int], None] | None = None) -> dict[str, BenchResult]:
    """Time several candidates side by side, round-robin, so that they all see the same machine load::

        warm-up   A x warmup, B x warmup, C x warmup                       (untimed)
        round 0   A x steps,  B x steps,  C x steps                        (timed)
        round 1   B x steps,  C x steps,  A x steps                        (the order rotates)
        ...
        -> per candidate: trimmed mean of its round means, median, std, stability (``summarize``)

    A slow phase of the machine (another process, a frequency change) then lands on every candidate
    instead of on whichever ran during it. ``sync()`` runs before each candidate's block (``ctx.barrier``
    in a multi-rank run, so every rank times the same candidate at once); ``on_round(done, total)``
    after each round (``ctx.progress``). On CUDA every step ends with a device synchronize.
    """
    if not candidates:
        raise ValueError("compare needs at least one candidate")
    _check_procedure(warmup, steps, rounds, trim)
    names = list(candidates)
    times: dict[str, list[float]] = {n: [] for n in names}
    for rnd in range(-1, rounds):  # round -1 is the warm-up
        shift = max(rnd, 0) % len(names)
        for name in names[shift:] + names[:shift]:
            sync and sync()
            for _ in range(warmup if rnd < 0 else steps):
                if rnd < 0:
                    candidates[name]()
                    _sync()
                else:
                    times[name].append(_timed(candidates[name]))
        on_round and on_round(rnd + 1, rounds)
    sync and sync()
    return {n: summarize(times[n], steps, trim) for n in names}


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
