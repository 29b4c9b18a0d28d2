"""Per-rank timeline of spans, merged across ranks for Gantt charts.

Each rank records ``(kind, start, end, meta)`` with ``time.perf_counter()`` measured
from a common origin: the moment every rank leaves the same barrier, so spans of
different ranks line up on one axis (to within the barrier's exit skew, microseconds
on one machine).

On an emulated cluster (``launch(..., cluster=)``) every span also records the rank's virtual clock
(``vstart``, ``vend``: seconds on the target cluster, 0 at the same barrier); ``merge(..., clock="virtual")``
draws those instead.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass, field
from typing import Callable


@dataclass
class Span:
    rank: int
    kind: str  # e.g. "F", "B", "W", "comm", "recompute", "optimizer"
    start: float  # seconds from the common origin
    end: float
    meta: dict = field(default_factory=dict)  # micro-batch, stage, chunk, bytes...
    vstart: float | None = None  # the emulated cluster's virtual clock, when there is one
    vend: float | None = None


class Timeline:
    """Records spans on one rank: ``with timeline.span("F", mb=0, stage=1): ...``."""

    def __init__(self, rank: int):
        self.rank = rank
        self.origin = time.perf_counter()
        self.spans: list[Span] = []
        self.enabled = True
        self.virtual: Callable[[], float] | None = None  # the emulator's clock (set by init_context)

    def reset_origin(self) -> None:
        """Call right after a barrier on every rank to align clocks."""
        self.origin = time.perf_counter()
        self.spans.clear()

    def now(self) -> float:
        return time.perf_counter() - self.origin

    def vnow(self) -> float | None:
        """The virtual clock (None without an emulated cluster, and inside ``ctx.paused()``, where it stands still:
        a span timed there has no virtual times, as without a cluster)."""
        if self.virtual is None:
            return None
        from .emulator import current
        return self.virtual() if current() is not None else None

    @contextlib.contextmanager
    def span(self, kind: str, **meta):
        start, vstart = self.now(), self.vnow()
        try:
            yield
        finally:
            if self.enabled:
                self.spans.append(Span(self.rank, kind, start, self.now(), meta, vstart, self.vnow()))

    def add(self, kind: str, start: float, end: float, vstart: float | None = None, vend: float | None = None,
            **meta) -> None:
        """A span measured by the caller (``start``/``end`` from ``now()``, ``vstart``/``vend`` from ``vnow()``)."""
        self.spans.append(Span(self.rank, kind, start, end, meta, vstart, vend))

    def to_json(self) -> list[dict]:
        """Plain dicts; ``vstart``/``vend`` only where a virtual clock ran."""
        out = []
        for span in self.spans:
            d = asdict(span)
            if d["vstart"] is None:
                del d["vstart"], d["vend"]
            out.append(d)
        return out


CLOCKS = ("wall", "virtual")


def merge(per_rank: list[list[dict]], clock: str = "wall") -> list[dict]:
    """Flatten per-rank span lists (as returned by ``Timeline.to_json``) sorted by start. ``clock="virtual"``
    puts the emulated cluster's times in ``start``/``end`` (spans without them are left out)."""
    if clock not in CLOCKS:
        raise ValueError(f"clock={clock!r}; allowed: {CLOCKS}")
    spans = [s for rank_spans in per_rank for s in rank_spans]
    if clock == "virtual":
        spans = [{**s, "start": s["vstart"], "end": s["vend"]} for s in spans if s.get("vstart") is not None]
    return sorted(spans, key=lambda s: (s["start"], s["rank"]))
