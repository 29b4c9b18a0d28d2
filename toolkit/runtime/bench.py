"""The benchmark procedure of the source article, made explicit and reusable.

    fixed seeds ─► warm-up steps (not timed) ─► R rounds x S timed steps ─► trimmed mean of round means
                                                                          └─► stability metrics

``measure`` times one step function; ``compare`` times several side by side (round-robin, the order
rotating each round), which is how every lesson puts a technique next to its baseline; ``verdict`` says
whether one is faster than the other, with the interval it used — the one rule every lesson judges by.

Clocks (``clock=``): ``"wall"`` (``time.perf_counter``; on CUDA each step ends with a synchronize),
``"cpu"`` (``time.thread_time``: this thread's CPU time, which leaves out waiting and the work of other
threads, e.g. gloo's transfers: a rank's own compute on a shared machine) and ``"virtual"`` (the emulated
cluster's clock of this rank, ``toolkit.runtime.emulator``: deterministic, so its rounds agree exactly).
With an emulated cluster running, a wall-clock result also carries the virtual one (``BenchResult.virtual``).

Stability metrics (the article's definitions, computed from this run):
- throughput stability  = std / mean of step time over all timed steps (article target < 5%)
- memory volatility     = std / mean of sampled memory (article target < 8%)
- comm efficiency ratio = comm time / (step time - compute time) (article target > 75%)

``verdict(a, b)`` (b against a, e.g. technique against baseline) pairs the rounds of a ``compare`` (round r of
both ran back to back, so a slow phase of the machine hits both) and works on log ratios::

    r_i = log(b_round_i / a_round_i)     i = 1..k rounds            (per rank lists: each round's slowest rank)
    ratio = exp(mean r)   interval = exp(mean r ± t_975(k-1) · std r / √k)      Student's t, 95 %
    "faster" if the interval lies below 1, "slower" if above, "within noise" if it contains 1

``judge(claim, measured, low, high)`` says whether a run reproduces a source's *claim* (a ``Claim``: its magnitude
and the band of measured values that count as it), in one of four words, over the interval of the measurement
(a wall clock's 95 % interval, or on the emulated cluster the model's sensitivity band)::

    claimed side of no effect?   whole interval in the band?
    ── no, all of it ──────────────────────────────────────►  not reproduced
    ── yes, all of it ──────────── yes ────────────────────►  reproduced
                                └─ no ─────────────────────►  direction only
    ── the interval contains no effect (or the run cannot) ►  not decidable (with the number that shows why)

A property the setup guarantees (an identity, bitwise equality) is a ``check``, never a reproduction.
"""
from __future__ import annotations

import contextlib
import itertools
import math
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

import torch

from .spread import t_975

CLOCKS = ("wall", "cpu", "virtual")


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
    clock: str = "wall"
    """What measured it: "wall", "cpu" or "virtual" (see the module docstring)."""
    virtual: "BenchResult | None" = None
    """The same steps on the emulated cluster's clock, when one ran beside the wall clock."""

    def to_dict(self) -> dict:
        return asdict(self)


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def summarize(step_times_s: list[float], steps: int, trim: int = 1, clock: str = "wall") -> BenchResult:
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
                       std / mean_all if mean_all else 0.0, round_means, list(step_times_s), clock)


def _check_procedure(warmup: int, steps: int, rounds: int, trim: int, clock: str = "wall") -> None:
    if warmup < 0 or steps < 1 or rounds < 1 or trim < 0:
        raise ValueError(f"need warmup >= 0, steps >= 1, rounds >= 1, trim >= 0; got {warmup}, {steps}, {rounds}, {trim}")
    if clock not in CLOCKS:
        raise ValueError(f"clock={clock!r} is not allowed; allowed: {CLOCKS}")


class _Clocks:
    """Reads the requested clock, and the virtual one beside a wall clock when an emulator runs. With an emulator
    (and a ``label``) each timed step is an emulator window ``{label}#{i}``, which a replay of the run reads back
    (``replayed``)."""

    def __init__(self, clock: str, label: str | None = None):
        from .emulator import current  # on first use: importing bench loads no emulator
        emu = current()
        if clock == "virtual" and emu is None:
            raise ValueError("clock='virtual' needs an emulated cluster: launch(..., cluster='h100-ib400')")
        self.clock = clock
        virtual = emu.now if emu is not None else None
        self.read = {"wall": time.perf_counter, "cpu": time.thread_time, "virtual": virtual}[clock]
        self.beside = virtual if clock != "virtual" else None
        self.window = (lambda i: emu.window(f"{label}#{i}")) if emu is not None and label else None
        self.times: list[float] = []
        self.vtimes: list[float] = []

    def timed(self, step: Callable[[], object]) -> None:
        t0, v0 = self.read(), self.beside() if self.beside else 0.0
        with self.window(len(self.times)) if self.window else contextlib.nullcontext():
            step()
            _sync()
        self.times.append(self.read() - t0)
        if self.beside:
            self.vtimes.append(self.beside() - v0)

    def result(self, steps: int, trim: int) -> BenchResult:
        out = summarize(self.times, steps, trim, self.clock)
        if self.vtimes:
            out.virtual = summarize(self.vtimes, steps, trim, "virtual")
        return out


def measure(step: Callable[[], object], warmup: int = 2, steps: int = 5, rounds: int = 3, trim: int = 1,
            on_step: Callable[[int, int], None] | None = None, clock: str = "wall",
            label: str | None = None) -> BenchResult:
    """Time ``step()``: ``warmup`` untimed calls, then ``rounds`` rounds of ``steps`` timed calls.

    ``trim`` rounds are dropped from each end before averaging (needs ``rounds > 2*trim``; with fewer
    rounds nothing is trimmed). ``on_step(done, total)`` is called after each call, e.g. ``ctx.progress``.
    ``clock``: "wall", "cpu" or "virtual" (module docstring); ``label``: on an emulated cluster, the name a replay
    reads the steps back by (``replayed``). To time several variants against each other use ``compare`` (they
    then share the machine's load).
    """
    _check_procedure(warmup, steps, rounds, trim, clock)
    total, clocks = warmup + steps * rounds, _Clocks(clock, label)
    for i in range(total):
        if i < warmup:
            step()
            _sync()
        else:
            clocks.timed(step)
        on_step and on_step(i + 1, total)
    return clocks.result(steps, trim)


def compare(candidates: dict[str, Callable[[], object]], warmup: int = 1, steps: int = 3, rounds: int = 5,
            trim: int = 1, sync: Callable[[], None] | None = None,
            on_round: Callable[[int, int], None] | None = None, clock: str = "wall",
            label: str | None = None) -> dict[str, BenchResult]:
    """Time several candidates side by side, round-robin, so that they all see the same machine load::

        warm-up   A x warmup, B x warmup, C x warmup                       (untimed)
        round 0   A x steps,  B x steps,  C x steps                        (timed)
        round 1   B x steps,  C x steps,  A x steps                        (the order rotates)
        ...
        -> per candidate: trimmed mean of its round means, median, std, stability (``summarize``)

    A slow phase of the machine (another process, a frequency change) then lands on every candidate
    instead of on whichever ran during it. ``sync()`` runs before each candidate's block (``ctx.barrier``
    in a multi-rank run, so every rank times the same candidate at once); ``on_round(done, total)``
    after each round (``ctx.progress``). ``clock``: "wall", "cpu" or "virtual" (module docstring). On CUDA
    every step ends with a device synchronize. Judge two of the results with ``verdict``. ``label``: on an
    emulated cluster, candidate ``n``'s steps are the windows ``{label}/{n}#i`` a replay reads back (``replayed``).
    """
    if not candidates:
        raise ValueError("compare needs at least one candidate")
    _check_procedure(warmup, steps, rounds, trim, clock)
    names = list(candidates)
    clocks = {n: _Clocks(clock, f"{label}/{n}" if label else None) for n in names}
    for rnd in range(-1, rounds):  # round -1 is the warm-up
        shift = max(rnd, 0) % len(names)
        for name in names[shift:] + names[:shift]:
            sync and sync()
            for _ in range(warmup if rnd < 0 else steps):
                if rnd < 0:
                    candidates[name]()
                    _sync()
                else:
                    clocks[name].timed(candidates[name])
        on_round and on_round(rnd + 1, rounds)
    sync and sync()
    return {n: clocks[n].result(steps, trim) for n in names}


def replayed(clocks, label: str) -> float:
    """The mean step time of a virtual-clock ``measure``/``compare`` candidate (``label``, or ``label/name``) in a
    replay of the run (``toolkit.runtime.vclock.replay``: one clock per rank): each step its slowest rank, as
    ``verdict`` counts a round."""
    steps = []
    for i in itertools.count():
        try:
            steps.append(max(c.window(f"{label}#{i}")["s"] for c in clocks))
        except KeyError:
            break
    if not steps:
        raise KeyError(f"no timed step {label!r} in the replayed run")
    return statistics.fmean(steps)


# ---- one way to judge "is B faster than A" -----------------------------------------------------------------------
Timed = BenchResult | dict | Sequence[BenchResult | dict]


@dataclass
class Verdict:
    """``b`` against ``a``: the ratio of their times, its 95 % interval, and the word it decides."""

    word: str
    """"faster", "slower", "within noise" (the interval contains 1) or "not decidable" (one round)."""
    ratio: float
    """b / a: exp of the mean of the per-round log ratios."""
    low: float
    high: float
    """The 95 % interval of the ratio (equal to ``ratio`` on a deterministic clock)."""
    rounds: int
    paired: bool
    """Rounds paired (one ``compare``) or not (separate runs: Welch's interval)."""
    clock: str
    a_s: float
    b_s: float
    """Mean round times of a and b (each round's slowest rank when per-rank lists were given)."""

    @property
    def faster(self) -> bool:
        return self.word == "faster"

    @property
    def slower(self) -> bool:
        return self.word == "slower"

    def text(self, a: str = "baseline", b: str = "technique") -> str:
        """``"technique 0.82× baseline's time [0.78, 0.86], 5 paired rounds, wall clock: faster"``."""
        interval = (f"[{self.low:.2f}, {self.high:.2f}]" if self.low != self.high else "(deterministic)")
        return (f"{b} {self.ratio:.2f}× {a}'s time {interval}, {self.rounds} {'paired ' if self.paired else ''}"
                f"rounds, {self.clock} clock: {self.word}")

    def to_dict(self) -> dict:
        return asdict(self)


def _rounds(x) -> tuple[list[float], str]:
    """Round means of one result, or per round the slowest of several ranks' results."""
    items = list(x) if isinstance(x, (list, tuple)) else [x]
    if not items:
        raise ValueError("verdict needs at least one result on each side")
    as_dict = [i.to_dict() if isinstance(i, BenchResult) else i for i in items]
    for d in as_dict:
        if not isinstance(d, dict) or "round_means_s" not in d:
            raise ValueError(f"verdict takes BenchResults (or their to_dict()), got {type(d).__name__}")
    lengths = {len(d["round_means_s"]) for d in as_dict}
    if len(lengths) != 1:
        raise ValueError(f"per-rank results with different numbers of rounds: {sorted(lengths)}")
    rounds = [max(r) for r in zip(*(d["round_means_s"] for d in as_dict))]
    return rounds, as_dict[0].get("clock", "wall")


def verdict(a: Timed, b: Timed) -> Verdict:
    """Is ``b`` faster than ``a``? Both are results of ``compare``/``measure`` (a ``BenchResult``, its
    ``to_dict()``, or one per rank: each round then counts its slowest rank). Rounds are paired when both
    have the same number of them (one ``compare``); otherwise Welch's interval on the log round means.
    See the module docstring for the rule."""
    ra, clock_a = _rounds(a)
    rb, clock_b = _rounds(b)
    if clock_a != clock_b:
        raise ValueError(f"verdict compares times of one clock, got {clock_a!r} and {clock_b!r}")
    if min(ra + rb) <= 0:
        raise ValueError("verdict needs positive round times")
    la, lb = [math.log(x) for x in ra], [math.log(x) for x in rb]
    paired = len(la) == len(lb)
    if paired:
        d = [y - x for x, y in zip(la, lb)]
        mean = statistics.fmean(d)
        half = t_975(len(d) - 1) * statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else math.nan
    else:
        mean = statistics.fmean(lb) - statistics.fmean(la)
        va = statistics.variance(la) / len(la) if len(la) > 1 else math.nan
        vb = statistics.variance(lb) / len(lb) if len(lb) > 1 else math.nan
        se = math.sqrt(va + vb)
        dof = (va + vb) ** 2 / ((va ** 2 / (len(la) - 1) if va else 0) + (vb ** 2 / (len(lb) - 1) if vb else 0)) \
            if va + vb > 0 else 1.0
        half = t_975(max(1, int(dof))) * se if math.isfinite(se) else math.nan
    if clock_a == "virtual":
        half = 0.0  # a deterministic clock: its rounds agree exactly
    if math.isnan(half):
        word = "not decidable"
        low = high = math.exp(mean)
    else:
        low, high = math.exp(mean - half), math.exp(mean + half)
        word = "faster" if high < 1 else "slower" if low > 1 else "within noise"
    return Verdict(word, math.exp(mean), low, high, min(len(la), len(lb)), paired, clock_a,
                   statistics.fmean(ra), statistics.fmean(rb))


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


# ---- one way to judge "does the run reproduce the source's claim" ----------------------------------------------
CLAIM_WORDS = ("reproduced", "direction only", "not reproduced", "not decidable")
"""The four words a claim is judged by (``judge``)."""
CHECK_WORDS = ("check holds", "check fails")
"""A property the setup guarantees (an identity, a closed form, bitwise equality) is a check, not a reproduction
(``check``)."""


@dataclass(frozen=True)
class Claim:
    """What a source claims, as a number a run can measure, and the band of measured values that reproduce it.

    ``value`` is the source's magnitude in the unit of the measurement (a ratio of times, a saving, a fraction);
    ``no_effect`` what the measurement reads when the technique does nothing (1 for a ratio, 0 for a saving);
    ``band`` the measured values that count as the source's magnitude, ``rule`` that band in words ("within
    ±25 % of the claimed 1.48×"); ``setting`` where the source measured it, or the nearer setting the run
    declares."""

    what: str
    value: float
    band: tuple[float, float]
    rule: str
    no_effect: float = 1.0
    source: str = ""
    setting: str = ""

    def __post_init__(self):
        lo, hi = self.band
        if not lo <= self.value <= hi or (self.value != self.no_effect and lo <= self.no_effect <= hi):
            raise ValueError(f"Claim {self.what!r}: band={self.band} must contain value={self.value}, and not "
                             f"no_effect={self.no_effect} unless the claim is that there is none (value = "
                             f"no_effect: Claim.at_most)")

    @property
    def of_no_effect(self) -> bool:
        """A claim that the technique costs nothing (or at most the band's edge): it has no direction."""
        return self.value == self.no_effect

    @property
    def lower_is_better(self) -> bool:
        return self.value < self.no_effect

    @classmethod
    def ratio(cls, what: str, value: float, tolerance: float = 0.25, **kw) -> "Claim":
        """A claimed ratio (e.g. a step time 0.67× the baseline's, or a 1.48× speed-up): reproduced within
        ±``tolerance`` of it."""
        if not 0 < tolerance < 1 or not value > 0:
            raise ValueError(f"Claim.ratio({what!r}): value > 0 and tolerance in (0, 1), got {value}, {tolerance}")
        band = (value * (1 - tolerance), value * (1 + tolerance))
        if value < 1:
            band = (band[0], min(band[1], 1 - 1e-9))
        elif value > 1:
            band = (max(band[0], 1 + 1e-9), band[1])
        return cls(what, value, band, f"within ±{tolerance:.0%} of the claimed {value:.3g}×", **kw)

    @classmethod
    def saving(cls, what: str, value: float, at_least: float = 0.5, **kw) -> "Claim":
        """A claimed saving (a fraction of time or bytes removed, > 0): reproduced from ``at_least`` of it up."""
        if not value > 0 or not 0 < at_least <= 1:
            raise ValueError(f"Claim.saving({what!r}): value > 0 and at_least in (0, 1], got {value}, {at_least}")
        return cls(what, value, (at_least * value, math.inf),
                   f"at least {at_least:.0%} of the claimed {value:.0%} saving", no_effect=0.0, **kw)

    @classmethod
    def at_most(cls, what: str, bound: float, rule: str, no_effect: float = 1.0, **kw) -> "Claim":
        """A claim of no (or a negligible) cost: reproduced while the measured value is at most ``bound``
        (``rule`` says how the source's word was read, e.g. "'negligible': at most 5 % slower")."""
        return cls(what, no_effect, (-math.inf, bound), rule, no_effect=no_effect, **kw)

    def word(self, measured: float) -> str:
        """The word one measured value reaches (no interval)."""
        if self.of_no_effect:
            return "reproduced" if self.band[0] <= measured <= self.band[1] else "not reproduced"
        right_side = measured < self.no_effect if self.lower_is_better else measured > self.no_effect
        if not right_side:
            return "not reproduced"
        return "reproduced" if self.band[0] <= measured <= self.band[1] else "direction only"


@dataclass
class Judgement:
    """A claim judged on a measurement: the word, the measured value with its interval, and why."""

    word: str
    """One of ``CLAIM_WORDS`` (or ``CHECK_WORDS`` for a property)."""
    what: str
    measured: float | None
    low: float | None
    high: float | None
    """The interval the word holds over: a wall clock's 95 % interval, the emulated cluster's sensitivity band,
    or the value itself (a count, a deterministic property)."""
    interval: str
    """What the interval is."""
    claimed: float | None
    rule: str
    """The band that reproduces the claim, in words (for a check: what it checks)."""
    why: str
    """The number that shows why, for any word but "reproduced"."""
    source: str = ""
    setting: str = ""

    def text(self) -> str:
        """``"reproduced: 1.41× [1.30, 1.52] (sensitivity band) — within ±25 % of the claimed 1.48×"``."""
        if self.word in CHECK_WORDS:
            return f"{self.word}: {self.rule}" + (f" ({self.why})" if self.why else "")
        if self.measured is None or not math.isfinite(self.measured):  # nothing measured: why, then the claim
            return f"{self.word}: {self.why}" + (f" (the claim: {self.rule})" if self.rule != self.what else
                                                 f" ({self.what})")
        value = f"{self.measured:.3g}"
        if self.low is not None and (self.low, self.high) != (self.measured,) * 2:
            value += f" [{self.low:.3g}, {self.high:.3g}] ({self.interval})"
        return f"{self.word}: {value} — {self.rule}" + (f"; {self.why}" if self.why else "")

    def to_dict(self) -> dict:
        return asdict(self)


def judge(claim: Claim, measured: float | None, low: float | None = None, high: float | None = None,
          interval: str = "", undecidable: str = "") -> Judgement:
    """The one rule every lesson's headline judges a claim by (the four ``CLAIM_WORDS``):

    - **reproduced**: the measured value and its whole interval lie in the claim's band;
    - **direction only**: the whole interval is on the claimed side of no effect, not all of it in the band;
    - **not reproduced**: the whole interval is on the other side (or at no effect);
    - **not decidable**: the interval contains no effect (the run cannot tell the sign), or crosses the edge
      of a claim of no cost (``Claim.at_most``), or ``undecidable`` says why the run cannot measure it (a
      GPU-only effect on a CPU).

    ``low``/``high``: the interval of ``measured`` (None: it is exact); on the emulated cluster, the sensitivity
    band (``report.band``), so a ratio whose band straddles 1 is never "faster"."""
    base = dict(what=claim.what, claimed=claim.value, rule=claim.rule, source=claim.source, setting=claim.setting)
    if undecidable or measured is None or not math.isfinite(measured):
        return Judgement("not decidable", measured=measured, low=low, high=high, interval=interval,
                         why=undecidable or "nothing measured", **base)
    low = measured if low is None else low
    high = measured if high is None else high
    if not low <= measured <= high:
        raise ValueError(f"judge({claim.what!r}): measured={measured} is not inside [low, high]=[{low}, {high}]")
    words = {claim.word(x) for x in (low, measured, high)}
    if len(words) == 1:
        word = words.pop()
        why = "" if word == "reproduced" else (
            f"{measured:.3g} is outside the band [{claim.band[0]:.3g}, {claim.band[1]:.3g}]"
            if word == "direction only" or claim.of_no_effect
            else f"{measured:.3g} is not on the claimed side of {claim.no_effect:g}")
    elif claim.of_no_effect:
        word, why = "not decidable", (f"the interval [{low:.3g}, {high:.3g}] crosses the band's edge "
                                      f"({claim.band[1]:.3g})")
    elif "not reproduced" in words:
        word, why = "not decidable", (f"the interval [{low:.3g}, {high:.3g}] contains no effect "
                                      f"({claim.no_effect:g})")
    else:
        word, why = "direction only", (f"the sign holds over [{low:.3g}, {high:.3g}], the magnitude does not: "
                                       f"the band is [{claim.band[0]:.3g}, {claim.band[1]:.3g}]")
    return Judgement(word, measured=measured, low=low, high=high, interval=interval or "exact", why=why, **base)


def check(what: str, holds: bool, why: str = "") -> Judgement:
    """A property the setup guarantees (an identity, a closed form, bitwise equality), reported as a check: it
    cannot reproduce a claim, only confirm that the implementation does what it says."""
    if not isinstance(holds, bool):
        raise ValueError(f"check({what!r}): holds must be True or False (computed from the run), got {holds!r}")
    return Judgement("check holds" if holds else "check fails", what=what, measured=None, low=None, high=None,
                     interval="", claimed=None, rule=what, why=why)


def not_decidable(what: str, why: str) -> Judgement:
    """A claim this run cannot measure (a GPU-only mechanism on a CPU, a cluster it does not have), with no
    magnitude to judge: "not decidable", and ``why``."""
    if not why:
        raise ValueError(f"not_decidable({what!r}): say why the run cannot decide it")
    return Judgement("not decidable", what=what, measured=None, low=None, high=None, interval="", claimed=None,
                     rule=what, why=why)
