"""Run a lesson, or your own function, on N real processes from a notebook or a script: the caller's API.

Each module of a launch is named for the process it runs in::

    caller (notebook, script)             launcher (own session)                ranks 0..N-1
    launch           API and checks       launcher_process: accelerate launch,  rank_process: the entry point,
    caller_start     starts the launcher  torchrun's agent, which forks the     fn(ctx, cfg), the files below
    caller_watch     watches, reads ends  ranks (gloo) or execs them (nccl)
    caller_progress  the bar              server_process: a batch's server that forks pre-imported launchers
    caller_cache     the suite's hook     (and notebook kernels) for the callers of a batch

    launch(what, 4, cfg)
      1 check_arguments    cheap, nothing heavy imported yet
      2 target.resolve     lesson / "module:function" / function object ─► target (import or shipped source)
      3 check_capacity     ranks vs GPUs, cores and memory (refused far beyond the machine)
      4 validate + phases  the module's validate(cfg, world_size) and PHASES, before any process starts
      5 launch hook        HOOK_ENV, if one is installed, may answer without starting anything (caller_cache)
      6 write spec.json ─► launcher_process (fresh, or forked by server_process) ─► torchrun's agent
                             ─► rank 0..3: rank_process spec.json, forked from the pre-imported launcher (gloo)
                                or a fresh interpreter (nccl)
      7 watch out_dir:                               │ cwd and sys.path of the caller, init_process_group
          progress.rank0.json  ◄──────────────────── │ fn(ctx, cfg) -> rank{r}.json       (ctx.phase, ctx.progress)
          rank{r}.error.json   ◄──────────────────── │ exception    -> rank{r}.error.json
          rank{r}.stack.txt    ◄──────────────────── │ past the deadline: every stack, then exit
          rank{r}.crash.txt    ◄──────────────────── │ SIGSEGV, SIGBUS, SIGABRT: the Python stack
      8 collect + torchrun's report in launch.log (exit status of each failed rank)
          ▼
    [result of rank 0, ..., result of rank 3]    or LaunchError: the root cause first (which rank, and the
                                                 exception, "out of memory", the signal or the exit code),
                                                 then the other ranks' failures as its consequences

Every file a rank writes for the caller is written to a temporary name and renamed, so the caller never reads
half a file. The whole process tree is killed (once) on timeout and on KeyboardInterrupt (the stop button in
Jupyter). When the caller itself dies, the ranks see it and exit (``toolkit.runtime.rank_process``): no rank
outlives its launch.

Progress: a lesson module may declare ``PHASES = [("name", weight), ...]`` (or a function of the
validated cfg returning that list); ``ctx.phase("name")`` starts a phase on a rank, ``ctx.progress(done,
total, msg)`` is sub-progress inside it and ``with ctx.part(i, n, msg):`` gives a block (that may count its
own units) slice i of n. The caller shows rank 0's as one bar whose total is the sum of the weights (a
widget in JupyterLab, plain lines under papermill, CI and scripts). Without ``PHASES`` the whole run is one
phase.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import json
import os
import shutil
import socket
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from . import target as targets  # light: the standard library only
from .caller_progress import Progress, in_notebook, kernel_stays_busy
from .caller_start import RANK_ENV, child_env, serving
from .caller_watch import LaunchError, LaunchTimeout, RankResults, collect, run_ranks

__all__ = ["launch", "LaunchError", "LaunchTimeout", "RankResults", "Job", "HOOK_ENV",
           "serving"]  # a batch's launch server (caller_start), imported from here by the README's example

BACKENDS = ("auto", "gloo", "nccl")  # the same names as context.BACKENDS (not imported: context imports torch)
PROGRESS_MODES = ("auto", "widget", "plain", "none")
START_ENV = "TOOLKIT_RANK_START"  # "fork" (default on CPU): ranks forked from a pre-imported launcher; "exec": fresh
RANKS_PER_CORE = 4  # gloo ranks per CPU core accepted without oversubscribe=True
BYTES_PER_RANK = 400 * 2**20  # a rank's resident memory before it does any work (python, torch, gloo)
HOOK_ENV = "TOOLKIT_LAUNCH_HOOK"
"""``module:function`` of a launch hook, inherited by every child process: ``hook(job, run)`` returns the launch's
results, from ``run()`` (which starts the processes) or otherwise. The test suite installs its launch cache
(``conftest.py``, ``toolkit.runtime.caller_cache``); unset, every launch runs."""


@dataclass(frozen=True)
class Job:
    """One launch, resolved and checked, as a launch hook sees it."""

    target: dict  # the target's spec (``toolkit.runtime.target``)
    label: str
    cfg: dict  # after the module's validate
    world_size: int
    backend: str
    seed: int
    threads: int
    cluster: dict | None  # the emulated cluster (``Cluster.to_dict()``), or None
    accelerate_args: list[str] | None
    keep: bool  # the ranks' files were asked for (out_dir, keep_files)
    progress: str

    @property
    def title(self) -> str:
        return f"{self.label} x{self.world_size} ({self.backend})"


def launch(lesson, world_size: int, cfg: dict | None = None, *, backend: str = "auto",
           timeout_s: float = 120.0, seed: int = 0, threads: int = 1, progress: str = "auto",
           accelerate_args: list[str] | None = None, out_dir: str | Path | None = None,
           keep_files: bool = False, phases: list | None = None, oversubscribe: bool = False,
           cluster=None) -> RankResults:
    """Run ``lesson`` on ``world_size`` processes with ``accelerate launch`` and return each rank's result.

    Args:
        lesson: what every rank runs, called as ``fn(ctx, cfg) -> dict``:

            - a lesson name, ``"l00_foundations"`` (a module of ``toolkit.lessons``, its ``run``);
            - ``"module"`` or ``"module:function"``, imported from the caller's working directory and
              ``sys.path`` first, then from ``toolkit.lessons`` (``"my_module:my_experiment"``);
            - a function object: imported by name on the ranks if it lives in a module, or shipped as
              source if it is defined in a notebook cell or in the script being run (it must then be
              self-contained: see ``toolkit.runtime.target``).

            The module's ``validate(cfg, world_size)``, if any, runs here first, before any process starts.
        world_size: number of ranks (processes).
        cfg: JSON-able configuration, passed to every rank.
        backend: ``"auto"`` (nccl with GPUs, else gloo), ``"gloo"`` or ``"nccl"``.
        timeout_s: the whole launch is killed after this; collectives time out a bit earlier.
        seed: seeds Python, NumPy and torch identically on every rank.
        threads: intra-op threads per rank.
        progress: ``"auto"``, ``"widget"``, ``"plain"`` or ``"none"``.
        accelerate_args: extra ``accelerate launch`` arguments, e.g. multi-node
            ``["--num_machines", "2", "--machine_rank", "0", "--main_process_ip", "node0",
            "--main_process_port", "29500"]`` or ``["--config_file", "cluster.yaml"]``.
        out_dir: where ranks write results (a temporary folder by default, removed after).
        keep_files: keep the ranks' files (spec, launcher log, per-rank results, errors and stacks) in a temporary
            folder after the launch, failed or not (``RankResults.out_dir``; a failure's message names it).
        phases: ``[("name", weight), ...]`` for the progress bar (default: the module's ``PHASES``).
        oversubscribe: allow far more ranks than this machine has cores or memory for (refused otherwise).
        cluster: run on an emulated cluster (``toolkit.runtime.emulator``): a preset name ("h100-ib400",
            "a100-ib200", "pcie-100gbe") or a ``toolkit.runtime.cluster.Cluster``. Every rank then also keeps a
            virtual clock: its compute timed at the target GPU's calibrated kernel rates, its collectives as NCCL
            times them. Results and real times are unchanged. None or "none" (default): real time only. With backend
            "nccl" (real GPUs) it is set aside with a warning: there the real time is the measurement.

    Raises:
        ValueError: bad arguments (before anything starts).
        LaunchError: a rank failed; the message names it and carries its traceback.
        LaunchTimeout: past ``timeout_s``; carries the stacks of the ranks still running.
    """
    check_arguments(world_size, cfg, backend, timeout_s, seed, threads, progress, accelerate_args, out_dir)
    target = targets.resolve(lesson)
    backend = check_capacity(world_size, backend, accelerate_args, oversubscribe)
    emulated = check_cluster(cluster, world_size, backend)
    cfg = validate_cfg(target, dict(cfg or {}), world_size)
    phase_list = check_phases(phases if phases is not None else getattr(target.module, "PHASES", None), cfg)
    job = Job(target.spec, target.label, cfg, world_size, backend, seed, threads, emulated, accelerate_args,
              keep=bool(keep_files or out_dir), progress=progress)
    run = functools.partial(run_job, job, timeout_s, phase_list, out_dir)
    hook = launch_hook()
    return hook(job, run) if hook is not None else run()


def launch_hook() -> Callable | None:
    """The hook ``HOOK_ENV`` names, or None."""
    name = os.environ.get(HOOK_ENV)
    if not name:
        return None
    module, _, function = name.partition(":")
    return getattr(importlib.import_module(module), function)


def run_job(job: Job, timeout_s: float, phases: list, out_dir) -> RankResults:
    """Start ``job``'s processes, watch them and return each rank's result; the ranks' files stay only where they
    were asked for (``job.keep``)."""
    tmp = prepare_out_dir(out_dir)
    spec_path = write_spec(tmp, job, timeout_s, phases)
    busy = kernel_stays_busy() if job.progress != "none" and in_notebook() else contextlib.nullcontext()
    try:
        with busy:  # before the bar's widget opens its first comm
            bar = Progress(job.title, job.progress, phases)  # progress="none": shows nothing, keeps its trace
            forked = forks_ranks(job.backend, job.world_size, job.accelerate_args)
            proc, wall = run_ranks(command(spec_path, job.world_size, job.accelerate_args, forked),
                                   child_env(job.threads, forked), tmp, job.world_size, timeout_s, bar, job.title)
            results = collect(tmp, job.world_size, proc.returncode, bar)
    except LaunchError as err:  # what it needs is in the message; the files stay only where asked for
        if job.keep:
            err.args = (f"{err.args[0]}\n(the ranks' files: {tmp})",)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
            err.args = (f"{err.args[0]}\n(the ranks' files are removed; launch(..., keep_files=True) keeps "
                        "them: spec, launcher log, per-rank results, errors and stacks)",)
        raise
    except BaseException:  # interrupted: the processes are gone (run_ranks killed them)
        if not job.keep:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    results.wall_s, results.progress = wall, bar.trace
    if job.keep:
        results.out_dir = tmp
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    return results


# ---- 1. cheap checks ------------------------------------------------------------------------------------------
def check_arguments(world_size, cfg, backend, timeout_s, seed=0, threads=1, progress="auto", accelerate_args=None,
                    out_dir=None) -> None:
    """Every check that needs nothing imported: types and ranges of the launch arguments."""
    rank_start()
    if os.environ.get(RANK_ENV):
        raise RuntimeError("launch() was called inside a rank (the script that launches was imported by the ranks). "
                           "Put the launch call under  if __name__ == '__main__':  or in a separate file")
    if not _is_int(world_size) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if cfg is not None and not isinstance(cfg, dict):
        raise ValueError(f"cfg must be a dict, got {type(cfg).__name__}")
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not allowed; allowed: {BACKENDS}")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    if not _is_int(seed) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")
    if not _is_int(threads) or threads < 1:
        raise ValueError(f"threads must be a positive int, got {threads!r}")
    if progress not in PROGRESS_MODES:
        raise ValueError(f"progress={progress!r}; allowed: {', '.join(map(repr, PROGRESS_MODES))}")
    if accelerate_args is not None and (not isinstance(accelerate_args, (list, tuple)) or
                                        not all(isinstance(a, str) for a in accelerate_args)):
        raise ValueError(f"accelerate_args must be a list of strings, got {accelerate_args!r}")
    if out_dir is not None and not isinstance(out_dir, (str, os.PathLike)):
        raise ValueError(f"out_dir must be a path, got {type(out_dir).__name__}")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# ---- 3. what the machine can hold ---------------------------------------------------------------------------
def check_capacity(world_size: int, backend: str, accelerate_args=None, oversubscribe: bool = False) -> str:
    """Resolve ``backend`` and refuse a world size far beyond this machine; returns the backend.

    nccl: one rank per visible GPU. gloo: at most ``RANKS_PER_CORE`` ranks per core and as many ranks as the
    available memory holds at ``BYTES_PER_RANK`` each, unless ``oversubscribe=True``; more ranks than cores
    only warns (they share the cores: timings slow down, results are unaffected). On several machines
    (``--num_machines N``) the limits apply to this machine's share; with ``--config_file`` they are skipped.
    """
    from .context import resolve_backend
    backend = resolve_backend(backend)
    extra = list(accelerate_args or [])
    if "--config_file" in extra:
        return backend
    machines = int(extra[extra.index("--num_machines") + 1]) if "--num_machines" in extra[:-1] else 1
    local = -(-world_size // max(machines, 1))
    if backend == "nccl":
        import torch
        gpus = torch.cuda.device_count()
        if local > gpus:
            raise ValueError(f"world_size={world_size} exceeds the {gpus} visible GPUs "
                             "(nccl runs one rank per GPU)")
        return backend
    cores = os.cpu_count() or 1
    if not oversubscribe:
        import psutil
        memory = psutil.virtual_memory().available
        by_memory = max(int(memory // BYTES_PER_RANK), 1)
        if local > RANKS_PER_CORE * cores or local > by_memory:
            raise ValueError(
                f"world_size={world_size} is far beyond this machine ({cores} CPU cores, "
                f"{memory / 2**30:.1f} GiB available: at most {min(RANKS_PER_CORE * cores, by_memory)} gloo ranks, "
                f"{RANKS_PER_CORE} per core and about {BYTES_PER_RANK // 2**20} MiB each); pass oversubscribe=True "
                "to start them anyway")
    if local > cores:
        warnings.warn(f"world_size={world_size} is more ranks than the {cores} CPU cores: ranks will share cores "
                      "and timings will be slower (results are unaffected)", stacklevel=3)
    return backend


def check_cluster(cluster, world_size: int, backend: str) -> dict | None:
    """The emulated cluster as the spec carries it (``Cluster.to_dict()``), checked against the launch; None if
    none. With nccl the cluster is checked, then set aside with a warning: on real GPUs the real time is the
    measurement (so a notebook whose default emulates an H100 still runs unchanged on a GPU node)."""
    if cluster is None or cluster == "none":  # "none": what a notebook's cluster parameter says to turn it off
        return None
    from .cluster import check, cluster as make_cluster
    c = check(make_cluster(cluster) if isinstance(cluster, str) else cluster, world_size)
    if backend == "nccl":
        warnings.warn(f"cluster={c.name!r} is not emulated with backend 'nccl': on real GPUs the real time is the "
                      "measurement (pass backend='gloo' to emulate it on CPU processes)", stacklevel=3)
        return None
    return c.to_dict()


# ---- 4. the target's own checks ------------------------------------------------------------------------------
def validate_cfg(target, cfg: dict, world_size: int) -> dict:
    """The module's ``validate(cfg, world_size)`` (lessons define one), run before any process starts."""
    validate = getattr(target.module, "validate", None) if target.module is not None else None
    if callable(validate):
        cfg = validate(dict(cfg), world_size) or cfg
    try:
        json.dumps(cfg)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"cfg must be JSON-able (it is sent to every rank): {exc}") from None
    return cfg


def check_phases(phases, cfg: dict) -> list[list]:
    """``PHASES`` (a list, or a function of cfg returning one) -> ``[[name, weight], ...]``; [] if none."""
    if phases is None:
        return []
    if callable(phases):
        phases = phases(cfg)
    if not isinstance(phases, (list, tuple)) or not phases:
        raise ValueError(f"PHASES must be a non-empty list of (name, weight) pairs, got {phases!r}")
    out, names = [], set()
    for item in phases:
        ok = isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[0], str)
        if not ok or isinstance(item[1], bool) or not isinstance(item[1], (int, float)) or not item[1] > 0:
            raise ValueError(f"every phase must be (name, weight > 0), got {item!r}")
        if item[0] in names:
            raise ValueError(f"phase {item[0]!r} is declared twice")
        names.add(item[0])
        out.append([item[0], float(item[1])])
    return out


# ---- 6. the spec the ranks read ----------------------------------------------------------------------------
def prepare_out_dir(out_dir) -> Path:
    """``out_dir`` (or a new temporary folder), created, emptied of a previous launch's rank files and tried
    with a real file (permission bits do not tell root or a read-only mount): ValueError if it cannot be written."""
    tmp = Path(out_dir) if out_dir else Path(tempfile.mkdtemp(prefix="toolkit-"))
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        for stale in list(tmp.glob("rank*")) + list(tmp.glob("progress.*")):
            stale.unlink()
        with tempfile.TemporaryFile(dir=tmp):
            pass
    except OSError as exc:
        raise ValueError(f"out_dir={str(out_dir)!r} cannot be written ({exc.strerror or exc}): the ranks write "
                         "their results there; give a folder you can write, or leave out_dir out") from None
    return tmp


def write_spec(tmp: Path, job: Job, timeout_s: float, phases: list) -> Path:
    """What every rank reads (``toolkit.runtime.rank_process``): the job, its deadline, and the caller's folder,
    ``sys.path`` and identity (a rank exits once the caller is gone)."""
    from .rank_process import process_start
    spec = {"target": job.target, "label": job.label, "cfg": job.cfg, "backend": job.backend, "seed": job.seed,
            "threads": job.threads, "timeout_s": timeout_s, "deadline": time.time() + timeout_s,
            "collective_timeout_s": max(5.0, timeout_s * 0.8), "out_dir": str(tmp.resolve()),
            "cwd": os.getcwd(), "sys_path": [os.path.abspath(p) if p else os.getcwd() for p in sys.path],
            "phases": phases, "cluster": job.cluster,
            "caller": {"host": socket.gethostname(), "pid": os.getpid(), "started": process_start(os.getpid())}}
    spec_path = tmp / "spec.json"
    spec_path.write_text(json.dumps(spec))
    return spec_path


def forks_ranks(backend: str, world_size: int, accelerate_args=None) -> bool:
    """Whether torchrun's agent forks the ranks from the pre-imported launcher (``toolkit.runtime.launcher_process``)
    rather than starting a fresh interpreter for each: on one node with gloo, unless ``TOOLKIT_RANK_START=exec``."""
    return rank_start() == "fork" and backend == "gloo" and world_size > 1 and not accelerate_args


def rank_start() -> str:
    """``TOOLKIT_RANK_START``: "fork" (the default) or "exec"."""
    mode = os.environ.get(START_ENV, "fork")
    if mode not in ("fork", "exec"):
        raise ValueError(f"{START_ENV} must be 'fork' or 'exec', got {mode!r}")
    return mode


def command(spec_path: Path, world_size: int, accelerate_args=None, forked: bool = False) -> list[str]:
    extra = list(accelerate_args or [])
    cmd = [sys.executable, "-m", "toolkit.runtime.launcher_process"]  # accelerate launch, without its teardown
    if "--config_file" not in extra:
        # one rank: accelerate refuses --multi_gpu and runs the rank as a plain process (init_context then
        # sets up a one-rank process group itself)
        cmd += (["--multi_gpu"] if world_size > 1 else []) + ["--num_processes", str(world_size),
                                                              "--mixed_precision", "no", "--dynamo_backend", "no",
                                                              "--monitor_interval", "0.1"]
        if "--num_machines" not in extra:
            cmd += ["--num_machines", "1"]
        if "--main_process_port" not in extra:
            cmd += ["--main_process_port", "0"]
    rank = [str(Path(__file__).with_name("rank_process.py"))] if forked else ["-m", "toolkit.runtime.rank_process"]
    return cmd + extra + rank + [str(spec_path)]
