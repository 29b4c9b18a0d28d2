"""Per-rank timeline of spans, merged across ranks for Gantt charts.

Each rank records ``(kind, start, end, meta)`` with ``time.perf_counter()`` measured
from a common origin: the moment every rank leaves the same barrier, so spans of
different ranks line up on one axis (to within the barrier's exit skew, microseconds
on one machine).
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass, field


@dataclass
class Span:
    rank: int
    kind: str  # e.g. "F", "B", "W", "comm", "recompute", "optimizer"
    start: float  # seconds from the common origin
    end: float
    meta: dict = field(default_factory=dict)  # micro-batch, stage, chunk, bytes...


class Timeline:
    """Records spans on one rank: ``with timeline.span("F", mb=0, stage=1): ...``."""

    def __init__(self, rank: int):
        self.rank = rank
        self.origin = time.perf_counter()
        self.spans: list[Span] = []
        self.enabled = True

    def reset_origin(self) -> None:
        """Call right after a barrier on every rank to align clocks."""
        self.origin = time.perf_counter()
        self.spans.clear()

    def now(self) -> float:
        return time.perf_counter() - self.origin

    @contextlib.contextmanager
    def span(self, kind: str, **meta):
        start = self.now()
        try:
            yield
        finally:
            if self.enabled:
                self.spans.append(Span(self.rank, kind, start, self.now(), meta))

    def add(self, kind: str, start: float, end: float, **meta) -> None:
        self.spans.append(Span(self.rank, kind, start, end, meta))

    def to_json(self) -> list[dict]:
        return [asdict(s) for s in self.spans]


def merge(per_rank: list[list[dict]]) -> list[dict]:
    """Flatten per-rank span lists (as returned by ``Timeline.to_json``) sorted by start."""
    return sorted((s for spans in per_rank for s in spans), key=lambda s: (s["start"], s["rank"]))
