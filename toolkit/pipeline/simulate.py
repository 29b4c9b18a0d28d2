"""Time a schedule from op costs: per-rank timelines, bubble, step time and activation memory.

Each rank runs its actions in list order; an action starts when its rank is free and every action it
depends on (``Schedule.deps``) has finished, plus ``comm`` when that action ran on another rank::

    start(a) = max( end(previous action on a's rank),  max over deps d: end(d) + comm * [rank(d) != rank(a)] )
    end(a)   = start(a) + duration(a)

    duration:  F -> F   B -> B   I -> B - W   W -> W   R -> R (default F)   FB -> FB (default F + B)
               B of a checkpointed forward with no R action -> R + B (recomputed inline)

Communication is a latency on the dependency edge, not work on the rank (it overlaps compute, as an
isend does). The step time (makespan) is the last end over all ranks; a rank's bubble is the time it is
idle within the step, makespan - its busy time; ``bubble`` is the worst rank's.

Activation memory counts stage-chunks held per rank: +1 when a forward (or a recompute) starts, -1 when
the action that frees it ends (B; W after an I, whose activations W still reads). A checkpointed forward
holds nothing until its recompute. ``peak_mb`` converts to micro-batches of the rank's whole share of
the model: chunks / (stages per rank * sequence chunks).

The closed forms (``closed_form_bubble``, costs per action = per stage chunk) are reproduced exactly
with ``comm = 0`` (tests check p = 2..8), under the conditions the formulas assume::

    gpipe, 1f1b   (p-1)(F+B)                                     always
    interleaved   (p-1)(F+B) = (p-1)(F_rank + B_rank)/v          always (m a multiple of p; a chunk is
                                                                 1/v of a rank's layers)
    zb-h1         (p-1)(F+B-2W)                                  W <= F and W <= B - W
    dualpipev     (p-1)(F&B+B-3W) = (PP/2-1)(F&B+B-3W), PP = 2p   F = B - W (forward as long as the input
                                                                 backward) and W <= F

Outside them the simulated bubble differs (e.g. DualPipeV, p = 4, F=1 B=2 W=0.5: 9.5, not 10.5): the
formulas count idle slots assuming equal-length F and I, the simulator times the actual order.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from .schedule import Action, Schedule


@dataclass
class Costs:
    """Durations of one action on one stage chunk (any time unit; the simulator only adds them).

    ``B`` is the *full* backward (dX and dW); ``W`` is its dW part, so an ``I`` costs ``B - W``.
    """

    F: float = 1.0
    B: float = 2.0
    W: float = 1.0
    FB: float | None = None
    """An overlapped F&B of two micro-batches; None means F + B (no overlap gain, as on a CPU)."""
    R: float | None = None
    """A recompute; None means F."""
    comm: float = 0.0
    """Latency of one activation or gradient hop between ranks."""
    extra: dict[str, float] = field(default_factory=dict)
    """Durations of other ops by name (e.g. vocabulary parallelism's S and T)."""

    def __post_init__(self):
        for name in ("F", "B", "W", "FB", "R"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"cost {name} must be > 0, got {value}")
        if not self.W < self.B:
            raise ValueError(f"cost W={self.W} must be < B={self.B} (B is the full backward, I = B - W)")
        if not self.comm >= 0:
            raise ValueError(f"cost comm must be >= 0, got {self.comm}")
        for name, value in self.extra.items():
            if not value > 0:
                raise ValueError(f"cost {name} must be > 0, got {value}")

    @property
    def fb(self) -> float:
        return self.FB if self.FB is not None else self.F + self.B

    @property
    def r(self) -> float:
        return self.R if self.R is not None else self.F

    def duration(self, a: Action) -> float:
        """How long action ``a`` (possibly an FB) keeps its rank busy."""
        if a.op == "FB":
            return self.fb - (self.W if a.sub[1].op == "I" else 0.0)
        if a.op == "F":
            return self.F
        if a.op == "B":
            return self.B
        if a.op == "I":
            return self.B - self.W
        if a.op == "W":
            return self.W
        if a.op == "R":
            return self.r
        if a.op in self.extra:
            return self.extra[a.op]
        raise ValueError(f"no cost for op {a.op!r}; give it in Costs.extra")

    def scaled(self, factor: float) -> "Costs":
        """The same costs for a chunk ``factor`` times as large (e.g. 2 for a 1F1B stage vs a V chunk)."""
        def scale(x: float | None) -> float | None:
            return None if x is None else x * factor
        return Costs(self.F * factor, self.B * factor, self.W * factor, scale(self.FB), scale(self.R), self.comm,
                     {k: v * factor for k, v in self.extra.items()})


@dataclass
class SimResult:
    """What ``simulate`` returns; every list is indexed by rank."""

    spans: list[dict]
    """Timeline.to_json()-style dicts: rank, kind (op, "F&B" for FB), start, end, meta (stage, mb, label)."""
    makespan: float
    busy: list[float]
    idle: list[float]
    peak_chunks: list[int]
    peak_mb: list[float]
    memory: list[list[tuple[float, int]]]
    """(time, chunks held) after each change, per rank."""

    @property
    def bubble(self) -> float:
        """Idle time of the worst rank."""
        return max(self.idle)

    @property
    def bubble_fraction(self) -> float:
        """Idle share of all rank-time in the step: sum(idle) / (p * makespan)."""
        return sum(self.idle) / (len(self.idle) * self.makespan)

    def summary(self) -> dict:
        return {"makespan": self.makespan, "bubble": self.bubble, "bubble_fraction": self.bubble_fraction,
                "idle": self.idle, "peak_chunks": self.peak_chunks, "peak_mb": self.peak_mb}


def _holds(a: Action, schedule: Schedule) -> bool:
    """Does this F keep its activations (i.e. it is not checkpointed)?"""
    return (a.stage, a.mb, a.chunk) not in schedule.checkpointed


def simulate(schedule: Schedule, costs: Costs | Callable[[Action], float]) -> SimResult:
    """Event-simulate ``schedule``. ``costs`` is a ``Costs`` or any ``action -> duration`` function
    (e.g. ``MeasuredCosts``); the latter implies ``comm = 0`` unless it has a ``comm`` attribute. A B whose
    forward was checkpointed without an R action also pays its recompute (the R's duration)."""
    cost = costs.duration if isinstance(costs, Costs) else costs
    comm = getattr(costs, "comm", 0.0)
    inline = schedule.checkpointed - schedule.recomputed

    def duration(a: Action) -> float:
        return cost(a) + sum(cost(Action("R", x.stage, x.mb, x.chunk)) for x in a.parts
                             if x.op == "B" and (x.stage, x.mb, x.chunk) in inline)

    rank_of: dict[tuple, int] = {}
    for r, acts in enumerate(schedule.ranks):
        for a in acts:
            for part in a.parts:
                rank_of[part.key] = r
    end: dict[tuple, float] = {}
    ptr, free = [0] * schedule.p, [0.0] * schedule.p
    spans: list[dict] = []
    events: list[list[tuple[float, int]]] = [[] for _ in range(schedule.p)]  # (time, +-chunks)
    remaining = sum(len(acts) for acts in schedule.ranks)
    while remaining:
        progressed = False
        for r, acts in enumerate(schedule.ranks):
            while ptr[r] < len(acts):
                a = acts[ptr[r]]
                own = {part.key for part in a.parts}
                needs = [d for part in a.parts for d in schedule.deps(part) if d not in own]
                missing = [d for d in needs if d not in rank_of]
                if missing:
                    raise ValueError(f"{schedule.name}: {a} on rank {r} depends on {missing[0]}, which no rank runs")
                if any(d not in end for d in needs):
                    break
                start = max([free[r]] + [end[d] + (comm if rank_of[d] != r else 0.0) for d in needs])
                stop = start + duration(a)
                for part in a.parts:
                    end[part.key] = stop
                    events[r] += _memory_events(part, schedule, inline, start, stop)
                spans.append({"rank": r, "kind": "F&B" if a.op == "FB" else a.op, "start": start, "end": stop,
                              "meta": {"stage": a.stage, "mb": a.mb, "chunk": a.chunk, "label": str(a)}
                              if not a.sub else {"label": str(a), "mb": f"{a.sub[0].mb}|{a.sub[1].mb}"}})
                free[r] = stop
                ptr[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: str(acts[ptr[r]]) for r, acts in enumerate(schedule.ranks) if ptr[r] < len(acts)}
            raise ValueError(f"{schedule.name}: deadlock, every rank waits (rank: next action) {stuck}")
    makespan = max(free)
    busy = [sum(s["end"] - s["start"] for s in spans if s["rank"] == r) for r in range(schedule.p)]
    memory, peaks = [], []
    for evs in events:
        held, curve, peak = 0, [(0.0, 0)], 0
        for t, delta in sorted(evs, key=lambda e: (e[0], e[1])):  # frees before allocations at equal times
            held += delta
            peak = max(peak, held)
            curve.append((t, held))
        memory.append(curve)
        peaks.append(peak)
    unit = schedule.stages_per_rank * schedule.k
    return SimResult(spans, makespan, busy, [makespan - b for b in busy], peaks, [c / unit for c in peaks], memory)


def _memory_events(a: Action, schedule: Schedule, inline: set, start: float, stop: float) -> list[tuple[float, int]]:
    """+1 at the start of the action that materialises a chunk's activations, -1 at the end of the one
    that frees them."""
    if a.op == "F":
        return [(start, 1)] if _holds(a, schedule) else []
    if a.op == "R":
        return [(start, 1)]
    if a.op == "B":
        return ([(start, 1)] if (a.stage, a.mb, a.chunk) in inline else []) + [(stop, -1)]
    if a.op == "W":
        return [(stop, -1)]
    return []


def closed_form_bubble(name: str, p: int, costs: Costs) -> float:
    """The textbook bubble of schedule ``name`` on p ranks, per-chunk ``costs`` (see module docstring)."""
    c = costs
    forms = {"gpipe": (p - 1) * (c.F + c.B), "1f1b": (p - 1) * (c.F + c.B), "interleaved": (p - 1) * (c.F + c.B),
             "zb-h1": (p - 1) * (c.F + c.B - 2 * c.W), "dualpipev": (p - 1) * (c.fb + c.B - 3 * c.W)}
    if name not in forms:
        raise ValueError(f"no closed form for schedule={name!r}; known: {sorted(forms)}")
    return forms[name]


def timeline_bubble(spans: list[dict], p: int) -> dict:
    """The simulator's numbers for a *measured* step: spans of one step from all p ranks (Timeline.to_json()
    dicts, compute actions only). Step = last end - first start over all ranks; idle = step - busy."""
    start, stop = min(s["start"] for s in spans), max(s["end"] for s in spans)
    busy = [sum(s["end"] - s["start"] for s in spans if s["rank"] == r) for r in range(p)]
    idle = [stop - start - b for b in busy]
    return {"makespan": stop - start, "busy": busy, "idle": idle, "bubble": max(idle),
            "bubble_fraction": sum(idle) / (p * (stop - start))}


class MeasuredCosts:
    """Op durations measured per stage, as ``harness.measure_schedules`` reports them (records
    ``{"op": "F", "stage": 3, "seconds": ...}``; an F&B pair has ``"stage": [forward stage, backward stage]``),
    merged over ranks, usable as ``simulate``'s ``costs``.

    Missing entries are derived: B = I + W (ZB runs never run a full B), I = B - W, F&B = F + B of its halves.
    Wall-clock times on a loaded machine can contradict the model of a backward (its weight-gradient half W as
    long as the whole B): ``noisy`` lists where, and what is derived from them takes W as at most
    ``W_CAP`` of B, so a noisy measurement is drawn and said, never a crash.
    """

    W_CAP = 0.95

    def __init__(self, op_seconds: list[dict], comm: float = 0.0):
        self.table: dict[tuple[str, object], float] = {
            (r["op"], tuple(r["stage"]) if isinstance(r["stage"], (list, tuple)) else r["stage"]): r["seconds"]
            for r in op_seconds}
        self.comm = comm

    def has(self, op: str, stage) -> bool:
        return (op, stage) in self.table

    def seconds(self, op: str, stage) -> float:
        """The measured (or derived) duration of ``op`` on ``stage``."""
        t = self.table
        if (op, stage) in t:
            return t[(op, stage)]
        if op == "B" and ("I", stage) in t and ("W", stage) in t:
            return t[("I", stage)] + t[("W", stage)]
        if op == "I" and ("B", stage) in t and ("W", stage) in t:
            return t[("B", stage)] - min(t[("W", stage)], self.W_CAP * t[("B", stage)])
        if op == "R":
            return self.seconds("F", stage)
        raise ValueError(f"no measurement for {op} on stage {stage}; have {sorted(t, key=str)}")

    def __call__(self, a: Action) -> float:
        if a.op == "FB":
            f, b = a.sub
            key = ("F&B", (f.stage, b.stage))
            return self.table[key] if key in self.table else self.seconds("F", f.stage) + self.seconds(b.op, b.stage)
        return self.seconds(a.op, a.stage)

    def mean(self) -> Costs:
        """One ``Costs`` from the averages over stages (for closed forms and what-if sweeps)."""
        def avg(op: str) -> float | None:
            vals = [v for (kind, _), v in self.table.items() if kind == op]
            return sum(vals) / len(vals) if vals else None
        w = avg("W")
        b = avg("B") or (avg("I") + w)
        w = b / 2 if w is None else min(w, self.W_CAP * b)
        return Costs(F=avg("F"), B=b, W=w, FB=avg("F&B"), comm=self.comm)

    def noisy(self) -> list[str]:
        """Stages whose measured W is not below their B (and the mean, when it is not): timing noise, which
        ``seconds`` and ``mean`` absorb by taking W as ``W_CAP`` of B. Empty when the measurements are
        consistent."""
        t, out = self.table, []
        for (op, stage), b in sorted(t.items(), key=str):
            if op == "B" and ("W", stage) in t and t[("W", stage)] >= b:
                out.append(f"stage {stage}: W {t[('W', stage)] * 1e3:.3f} ms >= B {b * 1e3:.3f} ms")
        bs = [v for (op, _), v in t.items() if op == "B"]
        ws = [v for (op, _), v in t.items() if op == "W"]
        if bs and ws and sum(ws) / len(ws) >= sum(bs) / len(bs):
            out.append(f"mean W {sum(ws) / len(ws) * 1e3:.3f} ms >= mean B {sum(bs) / len(bs) * 1e3:.3f} ms")
        return out
