"""What a rank sees: process groups, backend, device, seeding, and the measuring tools.

A lesson program is ``run(ctx: Context, cfg: dict) -> dict``. The rank process builds the
``Context`` (``init_context``), installs the communication ledger, aligns the
timeline clocks with a barrier, then calls the lesson.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .grid import ProcessGrid
from .ledger import CommLedger
from .timeline import Timeline

if TYPE_CHECKING:
    from .emulator import Emulator

BACKENDS = ("auto", "gloo", "nccl")


def resolve_backend(backend: str = "auto") -> str:
    """``auto`` -> nccl when CUDA GPUs are visible, gloo otherwise. Raises on unknown names."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not allowed; allowed: {BACKENDS}")
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend='nccl' needs CUDA GPUs and none are visible; use backend='gloo' or 'auto'")
    return backend


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy (if present) and torch (CPU and CUDA) with one number."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np
        np.random.seed(seed % 2**32)
    except ImportError:
        pass


@dataclass
class Context:
    """One rank's view of the job (built by the rank process; lessons only read it)."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device
    ledger: CommLedger
    timeline: Timeline
    out_dir: Path | None = None
    grid: ProcessGrid | None = None
    phases: list = field(default_factory=list)
    """``[[name, weight], ...]`` from the lesson's ``PHASES`` (empty: the run is one phase)."""
    emulator: "Emulator | None" = None
    """The virtual clock on an emulated cluster (``launch(..., cluster=)``); None: real time only."""
    _last_progress: float = field(default=0.0, repr=False)
    _t0: float = field(default_factory=time.monotonic, repr=False)
    _phase: int = field(default=0, repr=False)
    _phase_name: str = field(default="", repr=False)
    _parts: list = field(default_factory=list, repr=False)
    """Open ``part`` blocks, outermost first: ``(lo, hi, message)``, lo and hi fractions of the phase."""

    def make_grid(self, **sizes: int) -> ProcessGrid:
        """Build (collectively, on every rank) a dp/pp/tp/cp/ep grid and label its groups in the ledger."""
        self.grid = ProcessGrid.build(self.world_size, self.rank, **sizes)
        for name in ("dp", "pp", "tp", "cp", "ep"):
            grp = self.grid.group(name)
            if grp is not None and self.grid.size(name) < self.world_size:
                self.ledger.name_group(grp, name)
        return self.grid

    def mean_over_ranks(self, value: torch.Tensor | float) -> float:
        """Average a metric (e.g. a loss) over all ranks, tagged "metrics" so it stays out of the traffic studied."""
        t = torch.as_tensor(value).detach().clone().float().reshape(1)
        if dist.is_initialized() and self.world_size > 1:
            with self.ledger.tag("metrics"):
                dist.all_reduce(t)
        return t.item() / self.world_size

    def barrier(self) -> None:
        if dist.is_initialized() and self.world_size > 1:
            dist.barrier()

    def paused(self, when: bool = True):
        """``with ctx.paused():`` the block runs as without an emulated cluster (``Emulator.paused``: no virtual
        time, no bookkeeping on every op); nothing changes without one, or when ``when`` is false. For sections
        that read the wall clock or the results only. Collective: every rank of the groups used inside pauses
        around the same block."""
        return self.emulator.paused() if self.emulator is not None and when else contextlib.nullcontext()

    # -- progress: what the launcher's bar shows (rank 0's) ------------------------------------------------
    #
    #   phase "timing" (weight 3 of 4)   ├──────────────── the phase's share of the bar ────────────────┤
    #   with ctx.part(1, 3, "1f1b"):                          ├──── part 1 of 3 ────┤
    #       measure_schedules(...)                            │ its ctx.progress(done, total) fills this
    #                                                         │ slice only; a part inside it, a slice of it
    #
    # Every report is one fraction of the current phase, so nested code (a harness that counts its own
    # jobs and rounds, inside a lesson's loop) moves one bar forward and never past its slice.
    def phase(self, name: str) -> "_Phase":
        """Start phase ``name`` (declared in the lesson's ``PHASES``); ``progress`` then reports inside it.

        Usable as a statement or as ``with ctx.phase("name"):`` (the phase is reported complete at the end).
        Without declared phases, a name is only shown as the message.
        """
        if self.phases:
            names = [n for n, _ in self.phases]
            if name not in names:
                raise ValueError(f"phase {name!r} is not declared; PHASES declares {names}")
            self._phase = names.index(name)
        self._phase_name = name
        self._parts.clear()
        self._report(0, 0, "" if self.phases else name, force=True)
        return _Phase(self)

    def part(self, index: float, total: float, message: str = "", size: float = 1) -> "_Part":
        """``with ctx.part(i, n, "what"):`` the block is units [i, i + size) of n of the current phase (or of
        the enclosing part): its ``progress(done, total)`` calls fill that slice only, so code that reports
        its own counts (``measure_schedules``, ``bench.compare``'s rounds) nests without its totals
        replacing the caller's. Parts nest; ``message`` is shown before the inner messages."""
        if not (0 <= index and size > 0 and index + size <= total):
            raise ValueError(f"part({index}, {total}, size={size}) must lie within 0..{total}")
        lo, hi = self._bounds()
        return _Part(self, lo + (hi - lo) * index / total, lo + (hi - lo) * (index + size) / total, message)

    def reserve_for_replay(self, share: float = 0.25) -> None:
        """At the start of an emulated section: the progress reported until ``replay`` fills the first
        1 − ``share`` of the current part or phase, the replays the rest."""
        lo, hi = self._bounds()
        self._replay_bounds = (lo + (hi - lo) * (1 - share), hi)
        _Part(self, lo, self._replay_bounds[0], "").__enter__()

    def replay(self, quantity, grid: dict | None = None) -> dict:
        """``emulator.sensitivity(quantity, grid=grid)`` (collective), its replays on the bar's slice
        ``reserve_for_replay`` kept for them."""
        lo, hi = getattr(self, "_replay_bounds", self._bounds())
        if getattr(self, "_replay_bounds", None) is not None and self._parts:
            self._report(1, 1, "", force=True)
            self._parts.pop()
            self._replay_bounds = None
        with _Part(self, lo, hi, "the run replayed on other figures"):
            return self.emulator.sensitivity(quantity, grid=grid, progress=self.progress)

    def progress(self, done: float, total: float, message: str = "") -> None:
        """Sub-progress inside the current part or phase (the whole run if no phases are declared): ``done``
        of ``total`` units, and what is being done. Cheap: call it in every long loop."""
        if not self.phases and self._phase_name and not message and not self._parts:
            message = self._phase_name
        self._report(done, total, message)

    def _bounds(self) -> tuple[float, float]:
        return self._parts[-1][:2] if self._parts else (0.0, 1.0)

    def _report(self, done: float, total: float, message: str, force: bool = False) -> None:
        now = time.monotonic()
        if self.out_dir is None or (not force and now - self._last_progress < 0.2 and done < total):
            return
        self._last_progress = now
        lo, hi = self._bounds()
        fraction = lo + (hi - lo) * (min(max(done / total, 0.0), 1.0) if total else 0.0)
        where = " · ".join(filter(None, [m for _, _, m in self._parts] + [message]))
        self._write_progress({"phase": self._phase, "fraction": fraction, "done": done, "total": total,
                              "message": where, "t": round(now - self._t0, 3)})

    def finish(self) -> None:
        """The run is over (the rank calls it when the lesson's ``run`` returns): one last report, the whole
        bar, marked ``"end"``. What the bar read before it shows how the lesson reported its progress: a report
        at 100 % long before this one is a bar that sat full while the run went on."""
        if self.out_dir is not None:
            self._write_progress({"phase": max(len(self.phases) - 1, 0), "fraction": 1.0, "done": 1, "total": 1,
                                  "message": "finished", "t": round(time.monotonic() - self._t0, 3), "end": True})

    def _write_progress(self, state: dict) -> None:
        tmp = self.out_dir / f"progress.rank{self.rank}.tmp"
        tmp.write_text(json.dumps(state))
        tmp.replace(self.out_dir / f"progress.rank{self.rank}.json")

    def log(self, message: str) -> None:
        print(f"[rank {self.rank}] {message}", flush=True)


class _Phase:
    """What ``ctx.phase`` returns: nothing to do as a statement; as a context, reports the phase complete."""

    def __init__(self, ctx: Context):
        self.ctx, self.index = ctx, ctx._phase

    def __enter__(self) -> "_Phase":
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None and self.ctx._phase == self.index:
            self.ctx._parts.clear()
            self.ctx._report(1, 1, "", force=True)


class _Part:
    """What ``ctx.part`` returns: a context that maps the progress reported inside it into [lo, hi]."""

    def __init__(self, ctx: Context, lo: float, hi: float, message: str):
        self.ctx, self.span = ctx, (lo, hi, message)

    def __enter__(self) -> "_Part":
        self.ctx._parts.append(self.span)
        self.ctx._report(0, 0, "", force=True)
        return self

    def __exit__(self, *exc) -> None:
        if self.ctx._parts and self.ctx._parts[-1] is self.span:
            if exc[0] is None:
                self.ctx._report(1, 1, "", force=True)
            self.ctx._parts.pop()


def _free_port() -> int:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_context(backend: str = "auto", timeout_s: float = 60.0, seed: int = 0,
                 out_dir: Path | None = None, threads: int = 1, phases: list | None = None,
                 cluster=None) -> Context:
    """Initialise torch.distributed from the launcher's env vars (RANK, WORLD_SIZE, ...).

    ``timeout_s`` bounds every collective, so a rank waiting on a dead peer fails with
    an error instead of hanging. ``threads`` caps intra-op threads per rank (several
    ranks share few cores; one thread each also makes CPU results reproducible).
    ``cluster`` (a preset name or ``Cluster.to_dict()``) starts the emulated cluster's virtual clock
    (``toolkit.runtime.emulator``), at 0 on every rank when they leave the start barrier.
    """
    backend = resolve_backend(backend)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.set_num_threads(threads)
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized() and "MASTER_ADDR" not in os.environ:  # one rank, started without torchrun
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
                          LOCAL_RANK="0")
    if not dist.is_initialized():
        kwargs = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    ledger = CommLedger().install()
    timeline = Timeline(rank)
    ctx = Context(rank, world, local_rank, backend, device, ledger, timeline, out_dir, phases=list(phases or []))
    if cluster is not None:
        from .emulator import build
        ctx.emulator = build(cluster, rank, world).install(ledger)
        timeline.virtual = ctx.emulator.now
    seed_everything(seed)
    ctx.barrier()
    timeline.reset_origin()
    ledger.reset()
    if ctx.emulator is not None:
        ctx.emulator.reset()
    return ctx
