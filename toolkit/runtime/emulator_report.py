"""What an emulated run cost, and what it would cost elsewhere: totals and reports of a rank's clock, and the run
re-timed from its traces under perturbed cluster figures (``Emulator`` is a ``Reports``)::

    every rank's trace (vclock.export) ─ gather ─► rank 0: vclock.replay at the figures x each BAND factor
                                                   ─► quantity(clocks) at each ─► value, low, high (and a grid)
                                                   ─ broadcast ─► the same dict on every rank
"""
from __future__ import annotations

import time
from collections import defaultdict

import torch.distributed as dist

from . import vclock
from .cluster import Cluster

BAND = {"compute x0.7": (0.7, 1.0), "compute x1.3": (1.3, 1.0), "links x0.8": (1.0, 0.8), "links x1.2": (1.0, 1.2),
        "compute x0.7, links x1.2": (0.7, 1.2), "compute x1.3, links x0.8": (1.3, 0.8),
        "compute x0.7, links x0.8": (0.7, 0.8), "compute x1.3, links x1.2": (1.3, 1.2)}
"""The sensitivity band: (achieved compute factor, link bandwidth factor) of each perturbed replay — the axes and
the corners of efficiency x0.7..x1.3 and bandwidth x0.8..x1.2."""
WHAT_IF = {"compute": [0.5, 0.7, 1.0, 1.3, 2.0], "bandwidth": [0.25, 0.5, 1.0, 2.0, 4.0]}
"""A what-if explorer's grid: the achieved compute and the links' bandwidth, each x these factors."""


def over_band(quantity, cluster: Cluster, band: dict[str, tuple[float, float]] | None = None) -> dict:
    """``quantity(c)`` (a number or a dict of them, from ops traced once and re-timed on ``c``) on ``cluster``
    and on it perturbed by each entry of ``band`` (default ``BAND``): the dict ``report.band`` reads, as
    ``sensitivity`` gives for an emulated run."""
    band = BAND if band is None else band
    return {"value": quantity(cluster), "factors": band,
            "band": {name: quantity(cluster.perturbed(*f)) for name, f in band.items()}}


def what_if(preset: str) -> dict[str, list[float]]:
    """The what-if grid a lesson replays at ``preset``: ``WHAT_IF``, or its corners and centre at ``smoke``
    (9 replays instead of 25, for the test suite)."""
    return {axis: values[::2] for axis, values in WHAT_IF.items()} if preset == "smoke" else WHAT_IF



class Reports:
    """An emulator's reports: needs its ``clock``, ``cluster``, rank, world size, ``now``, ``paused`` and
    ``_side``."""

    def totals(self) -> dict[str, float]:
        """Modelled seconds so far: the kernels' time on the stream, the host's per-op costs, the transfers'
        link time, the time the clocks waited for communication (exposed), and the CPU time the ops took here."""
        return totals(self.clock)

    def link_busy(self, tag: str | None = None) -> dict[str, float]:
        """Seconds each of this rank's links carried transfers (issued under ledger ``tag``, or all)."""
        busy: dict[str, float] = defaultdict(float)
        for c in self.comms:
            if c["local_end"] is not None and (tag is None or c["tag"] == tag):
                busy[c["link"]] += c["local_end"] - c["start"]
        return dict(busy)

    def report(self) -> dict:
        """JSON-able: the cluster, the totals, per-op rows (calls, FLOPs, bytes, modelled and CPU seconds) and
        per-(tag, op, link) communication rows (calls, bytes, link seconds, exposed seconds)."""
        comm: dict[tuple, dict] = defaultdict(lambda: {"calls": 0, "bytes": 0.0, "link_s": 0.0, "exposed_s": 0.0})
        for c in self.comms:
            row = comm[(c["tag"], c["op"], c["link"])]
            row["calls"] += 1
            row["bytes"] += c["bytes"]
            row["link_s"] += (c["local_end"] - c["start"]) if c["local_end"] is not None else 0.0
            row["exposed_s"] += c["exposed"] or 0.0
        return {"cluster": self.cluster.name, "now_s": self.now(), "totals": self.totals(),
                "ops": {k: dict(v) for k, v in sorted(self.ops.items(), key=lambda kv: -kv[1]["model_s"])},
                "comm": [{"tag": k[0], "op": k[1], "link": k[2], **v} for k, v in comm.items()]}

    def traces(self) -> list[dict] | None:
        """Collective: every rank's trace (``vclock.export``) on rank 0, None on the others."""
        with self.paused(), self._side():
            mine = vclock.export(self.clock)
            gathered = [None] * self.world_size if self.rank == 0 else None
            dist.gather_object(mine, gathered, dst=0)
        return gathered

    def sensitivity(self, quantity, band: dict[str, tuple[float, float]] | None = None,
                    grid: dict[str, list[float]] | None = None, progress=None) -> dict:
        """Collective: ``quantity`` (a function of the ranks' clocks, ``list[vclock.RankClock]``, returning a
        number or a dict of numbers) on this run replayed at unchanged figures (``value``: equal to the live run)
        and on the cluster perturbed by each entry of ``band`` (default ``BAND``: ``(compute, bandwidth)``
        factors), with ``low`` and ``high`` over the band. ``grid`` ({"compute": [...], "bandwidth": [...]})
        adds the quantity at every pair: a what-if explorer's data. ``progress(done, total, message)`` after each
        replay (``ctx.progress``, inside a ``ctx.part`` of its own). The same dict on every rank."""
        traces = self.traces()
        out = None
        if self.rank == 0:
            out = sensitivity(traces, self.cluster, quantity, band, grid, progress)
        holder = [out]
        with self.paused(), self._side():
            dist.broadcast_object_list(holder, src=0)
        return holder[0]


def totals(clock: vclock.RankClock) -> dict[str, float]:
    """``Emulator.totals`` of one clock (a live one or a replayed one)."""
    return {"kernels_s": sum(r["model_s"] for r in clock.ops.values()),
            "launch_s": sum(r["launch_s"] for r in clock.ops.values()),
            "comm_s": sum(c["local_end"] - c["start"] for c in clock.comms if c["local_end"] is not None),
            "exposed_s": sum(c["exposed"] or 0.0 for c in clock.comms),
            "cpu_s": sum(r["cpu_s"] for r in clock.ops.values())}


def sensitivity(traces: list[dict], cluster: Cluster, quantity, band: dict[str, tuple[float, float]] | None = None,
                grid: dict[str, list[float]] | None = None, progress=None) -> dict:
    """``Emulator.sensitivity`` from traces already gathered (any process)."""
    band = BAND if band is None else band
    t0 = time.perf_counter()
    total = 1 + len(band) + (len(grid.get("compute", [1.0])) * len(grid.get("bandwidth", [1.0])) if grid else 0)
    done = [0]

    def value(compute: float, bandwidth: float):
        got = quantity(vclock.replay(traces, cluster.perturbed(compute, bandwidth)))
        done[0] += 1
        if progress is not None:
            progress(done[0], total, "the run replayed on other figures")
        return got

    base = value(1.0, 1.0)
    out = {"value": base, "band": {name: value(*factors) for name, factors in band.items()}, "factors": band}
    values = list(out["band"].values()) + [base]
    if isinstance(base, dict):
        out["low"] = {k: min(v[k] for v in values) for k in base}
        out["high"] = {k: max(v[k] for v in values) for k in base}
    else:
        out["low"], out["high"] = min(values), max(values)
    if grid:
        out["grid"] = {"compute": list(grid.get("compute", [1.0])), "bandwidth": list(grid.get("bandwidth", [1.0]))}
        out["grid"]["values"] = [[value(c, b) for b in out["grid"]["bandwidth"]] for c in out["grid"]["compute"]]
    out["replays"] = total
    out["events"] = sum(len(t["events"]) for t in traces)
    out["wall_s"] = time.perf_counter() - t0
    return out
