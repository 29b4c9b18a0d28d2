"""Run a lesson, or your own function, on N real processes from a notebook or a script.

::

    notebook / script                        accelerate launch (subprocess, own session)
    ─────────────────                        ───────────────────────────────────────────
    launch(what, 4, cfg)
      1 check_arguments    cheap, nothing heavy imported yet
      2 target.resolve     lesson / "module:function" / function object ─► target (import or shipped source)
      3 check_capacity     ranks vs GPUs, cores and memory (refused far beyond the machine)
      4 validate + phases  the module's validate(cfg, world_size) and PHASES, before any process starts
      5 write spec.json ─► toolkit.runtime.launcher (accelerate launch's main) ─► torchrun's agent
                                             ─► rank 0..3: toolkit/runtime/worker.py spec.json, forked from the
                                                pre-imported launcher (gloo) or a fresh interpreter (nccl)
      6 watch out_dir:                               │ cwd and sys.path of the caller, init_process_group
          progress.rank0.json  ◄──────────────────── │ fn(ctx, cfg) -> rank{r}.json       (ctx.phase, ctx.progress)
          rank{r}.error.json   ◄──────────────────── │ exception    -> rank{r}.error.json
          rank{r}.stack.txt    ◄──────────────────── │ past the deadline: every stack, then exit
          rank{r}.crash.txt    ◄──────────────────── │ SIGSEGV, SIGBUS, SIGABRT: the Python stack
      7 collect + torchrun's report in launch.log (exit status of each failed rank)
          ▼
    [result of rank 0, ..., result of rank 3]    or LaunchError: the root cause first (which rank, and the
                                                 exception, "out of memory", the signal or the exit code),
                                                 then the other ranks' failures as its consequences

Every file a rank writes for the launcher is written to a temporary name and renamed, so the launcher
never reads half a file. The whole process tree is killed (once) on timeout and on KeyboardInterrupt (the
stop button in Jupyter). When the caller itself dies, the ranks see it and exit (``toolkit.runtime.worker``):
no rank outlives its launch.

Progress: a lesson module may declare ``PHASES = [("name", weight), ...]`` (or a function of the
validated cfg returning that list); ``ctx.phase("name")`` starts a phase on a rank, ``ctx.progress(done,
total, msg)`` is sub-progress inside it and ``with ctx.part(i, n, msg):`` gives a block (that may count its
own units) slice i of n. The launcher shows rank 0's as one bar whose total is the sum of the weights (a
widget in JupyterLab, plain lines under papermill, CI and scripts). Without ``PHASES`` the whole run is one
phase.
"""
from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

try:
    import fcntl  # the session cache's lock (POSIX)
except ImportError:  # pragma: no cover - Windows: identical launches may then run twice
    fcntl = None

from . import launch_server  # light: the standard library only
from . import target as targets  # light: the standard library only

BACKENDS = ("auto", "gloo", "nccl")  # the same names as context.BACKENDS (not imported: context imports torch)
PROGRESS_MODES = ("auto", "widget", "plain", "none")
START_ENV = "TOOLKIT_RANK_START"  # "fork" (default on CPU): ranks forked from a pre-imported launcher; "exec": fresh
RANK_ENV = "TOOLKIT_LAUNCHED_RANK"  # set in every rank; launch() refuses to start ranks from inside one
RANKS_PER_CORE = 4  # gloo ranks per CPU core accepted without oversubscribe=True
BYTES_PER_RANK = 400 * 2**20  # a rank's resident memory before it does any work (python, torch, gloo)


class LaunchError(RuntimeError):
    """A rank raised, crashed or the launch timed out. ``rank`` is the root cause's rank (or None)."""

    def __init__(self, message: str, rank: int | None = None, traceback: str = "", log: str = ""):
        super().__init__(message)
        self.rank, self.traceback, self.log = rank, traceback, log


class LaunchTimeout(LaunchError, TimeoutError):
    """The launch ran past ``timeout_s``; the stacks of the unfinished ranks are attached."""


class RankResults(list):
    """Per-rank results (index = rank) plus ``wall_s``, ``out_dir``, the launcher ``log`` and ``progress``: how
    the bar moved, one ``[fraction of the run, rank 0's report, seconds since the bar started]`` per report it
    read (``Progress.trace``; the last one rank 0's ``Context.finish``, ``"end": True``)."""

    wall_s: float = 0.0
    out_dir: Path | None = None
    log: str = ""
    progress: list | None = None


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
    keep = bool(keep_files or out_dir)
    title = f"{target.label} x{world_size} ({backend})"
    with session_cache(target, cfg, world_size, backend, seed, threads, emulated, accelerate_args, keep) as cache:
        if cache.results is not None:
            cache.note_hit(title)
            if progress != "none":
                print(f"{title}: the results of an identical launch earlier in this test session ({CACHE_ENV})",
                      flush=True)
            return cache.results
        tmp = prepare_out_dir(out_dir)
        spec_path = write_spec(tmp, target, cfg, backend, seed, threads, timeout_s, phase_list, emulated)
        busy = kernel_stays_busy() if progress != "none" and _in_notebook() else contextlib.nullcontext()
        try:
            with busy:  # before the bar's widget opens its first comm
                bar = Progress(title, progress, phase_list)  # progress="none": shows nothing, keeps its trace
                forked = forks_ranks(backend, world_size, accelerate_args)
                proc, wall = run_ranks(command(spec_path, world_size, accelerate_args, forked),
                                       child_env(threads, forked), tmp, world_size, timeout_s, bar, title)
                results = collect(tmp, world_size, proc.returncode, bar)
        except LaunchError as err:  # what it needs is in the message; the files stay only where asked for
            if keep:
                err.args = (f"{err.args[0]}\n(the ranks' files: {tmp})",)
            else:
                shutil.rmtree(tmp, ignore_errors=True)
                err.args = (f"{err.args[0]}\n(the ranks' files are removed; launch(..., keep_files=True) keeps "
                            "them: spec, launcher log, per-rank results, errors and stacks)",)
            raise
        except BaseException:  # interrupted: the processes are gone (run_ranks killed them)
            if not keep:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        results.wall_s, results.progress = wall, bar.trace
        if keep:
            results.out_dir = tmp
        else:
            shutil.rmtree(tmp, ignore_errors=True)
        cache.store(results)
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


# ---- 5. the spec the ranks read ----------------------------------------------------------------------------
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


def write_spec(tmp: Path, target, cfg: dict, backend: str, seed: int, threads: int, timeout_s: float,
               phases: list, cluster: dict | None = None) -> Path:
    from .worker import process_start
    spec = {"target": target.spec, "label": target.label, "cfg": cfg, "backend": backend, "seed": seed,
            "threads": threads, "timeout_s": timeout_s, "deadline": time.time() + timeout_s,
            "collective_timeout_s": max(5.0, timeout_s * 0.8), "out_dir": str(tmp.resolve()),
            "cwd": os.getcwd(), "sys_path": [os.path.abspath(p) if p else os.getcwd() for p in sys.path],
            "phases": phases, "cluster": cluster,
            "caller": {"host": socket.gethostname(), "pid": os.getpid(), "started": process_start(os.getpid())}}
    spec_path = tmp / "spec.json"
    spec_path.write_text(json.dumps(spec))
    return spec_path


def forks_ranks(backend: str, world_size: int, accelerate_args=None) -> bool:
    """Whether torchrun's agent forks the ranks from the pre-imported launcher (``toolkit.runtime.launcher``)
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
    cmd = [sys.executable, "-m", "toolkit.runtime.launcher"]  # accelerate launch, without its teardown
    if "--config_file" not in extra:
        # one rank: accelerate refuses --multi_gpu and runs the worker as a plain process (init_context then
        # sets up a one-rank process group itself)
        cmd += (["--multi_gpu"] if world_size > 1 else []) + ["--num_processes", str(world_size), "--mixed_precision", "no",
                "--dynamo_backend", "no", "--monitor_interval", "0.1"]
        if "--num_machines" not in extra:
            cmd += ["--num_machines", "1"]
        if "--main_process_port" not in extra:
            cmd += ["--main_process_port", "0"]
    worker = [str(Path(__file__).with_name("worker.py"))] if forked else ["-m", "toolkit.runtime.worker"]
    return cmd + extra + worker + [str(spec_path)]


def child_env(threads: int, forked: bool) -> dict:
    root = str(Path(__file__).resolve().parents[2])  # the toolkit's checkout, importable even if not installed
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1", **{RANK_ENV: "1"},
               PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    if forked:  # torchrun's --start-method fork --run-path, which accelerate launch's parser does not pass on
        env.update(PET_START_METHOD="fork", PET_RUN_PATH="1")
    return env


# ---- 6. run and watch ---------------------------------------------------------------------------------------
def run_ranks(cmd: list[str], env: dict, tmp: Path, world_size: int, timeout_s: float, bar, title: str):
    """Start the ranks and poll until they exit; kill the tree once on timeout, error or interrupt."""
    log_path = tmp / "launch.log"
    start = time.monotonic()
    with open(log_path, "w") as log:
        proc = start_launcher(cmd, env, log, log_path)
        try:
            while proc.poll() is None:
                if time.monotonic() - start > timeout_s:
                    break
                if bar:
                    bar.poll(tmp)
                time.sleep(0.05)
        except BaseException:  # KeyboardInterrupt (Jupyter's stop button) included
            kill_tree(proc.pid)
            if bar:
                bar.close("interrupted")
            raise
    wall = time.monotonic() - start
    if proc.poll() is None:  # timed out: read the watchdogs' stacks, then kill, once
        stacks = _read_stacks(tmp, world_size)
        kill_tree(proc.pid)
        if bar:
            bar.close("timed out")
        raise LaunchTimeout(
            f"launch of {title} timed out after {timeout_s:.0f}s (ranks without a result: "
            f"{_unfinished(tmp, world_size)}); all processes killed.\n" + stacks,
            rank=None, traceback=stacks, log=_tail(log_path))
    return proc, wall


def start_launcher(cmd: list[str], env: dict, log, log_path: Path):
    """The launcher, forked by the batch's launch server when one serves this launch (``toolkit.runtime.
    launch_server``: its imports done once), else a fresh interpreter in a session of its own."""
    server = os.environ.get(launch_server.SERVER_ENV)
    if server and env.get("PET_START_METHOD") == "fork":
        served = launch_server.request(server, cmd, env, log_path)
        if served is not None:
            return served
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def kill_tree(pid: int, grace_s: float = 3.0) -> None:
    """SIGTERM the process and all its descendants, then SIGKILL whatever is left."""
    import psutil
    try:
        root = psutil.Process(pid)
        procs = root.children(recursive=True) + [root]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=grace_s)


# ---- 7. results ---------------------------------------------------------------------------------------------
def collect(tmp: Path, world_size: int, returncode: int, bar=None) -> RankResults:
    """Every rank's result, or LaunchError naming the rank that failed first and how (see ``failure``)."""
    log_path = tmp / "launch.log"
    if returncode != 0 or _unfinished(tmp, world_size) or any(tmp.glob("rank*.error.json")):
        if bar:
            bar.close("failed")
        raise failure(tmp, world_size, returncode)
    results = RankResults(json.loads((tmp / f"rank{r}.json").read_text()) for r in range(world_size))
    results.log = log_path.read_text()
    if bar:
        bar.poll(tmp)  # rank 0's last report ("end"), written before its result
        bar.close("done")
    return results


@dataclass
class RankEnd:
    """How one rank ended: what it wrote (a result, an exception) and what torchrun saw (its exit status)."""

    rank: int
    result: bool
    error: dict | None  # rank{r}.error.json
    exitcode: int | None  # from torchrun's report (negative: the signal); None when it reported none
    stopped: bool  # torchrun stopped it (SIGTERM) after another rank had failed
    started: bool  # the worker got as far as opening its files
    crash: str  # the Python stack faulthandler wrote on a fatal signal (SIGSEGV, SIGBUS, SIGABRT...)

    @property
    def failed(self) -> bool:
        return not self.result or self.error is not None or self.exitcode not in (None, 0)

    @property
    def silent(self) -> bool:
        """Ended without a word of its own: a signal or an exit code, with no exception and not stopped."""
        return self.failed and self.error is None and not self.stopped and (self.started or self.exitcode is not None)

    def how(self) -> str:
        """What happened to it, in words: the exception, out of memory, the signal by name, the exit code."""
        if self.error is not None:
            message = self.error["message"] or "(no message)"
            if self.error.get("cause") == "out of memory":
                return f"ran out of memory ({self.error['type']}: {message})"
            return f"failed with {self.error['type']}: {message}"
        if self.stopped:
            return "was stopped by torchrun (SIGTERM) after the failure above"
        if self.exitcode is not None and self.exitcode < 0:
            name = _signal_name(-self.exitcode)
            return f"was killed by {name} (signal {-self.exitcode}) with no result and no exception" + \
                SIGNAL_HINTS.get(name, "")
        if self.exitcode:
            return (f"exited with code {self.exitcode} with no result and no exception (os._exit(), or exit() in "
                    "native code)")
        if not self.started:
            return "did not start (see the launcher log)"
        return "ended with no result and no exception (exit code 0: os._exit(0)?)"


SIGNAL_HINTS = {
    "SIGKILL": ": what the kernel's out-of-memory killer sends (and `kill -9`); check the memory the ranks need",
    "SIGSEGV": ": a crash in native code (its Python stack is below)",
    "SIGBUS": ": a crash in native code, or a memory-mapped file that lost its disk space (its Python stack is below)",
    "SIGABRT": ": native code aborted (its Python stack is below)",
    "SIGTERM": ": stopped from outside the launch",
}


def failure(tmp: Path, world_size: int, returncode: int) -> LaunchError:
    """The LaunchError of a failed launch: the root cause first (``root_cause``), then the other ranks'
    failures as its consequences, then the root's traceback, or its crash stack and the launcher log."""
    log = _read_text(tmp / "launch.log")
    tail = "\n".join(log.splitlines()[-60:])
    exitcodes, stopped, torchrun_first = torchrun_report(log)
    ends = [RankEnd(r, (tmp / f"rank{r}.json").exists(), _read_json(tmp / f"rank{r}.error.json"), exitcodes.get(r),
                    r in stopped, (tmp / f"rank{r}.stack.txt").exists(), _read_text(tmp / f"rank{r}.crash.txt"))
            for r in range(world_size)]
    failed = [e for e in ends if e.failed]
    if returncode < 0 and not exitcodes:  # torchrun's agent itself was killed: no report, its ranks died with it
        raised = [f"  rank {e.rank} {_first_line(e.how())}" for e in failed if e.error is not None]
        return LaunchError("\n".join(
            [f"the launcher process (accelerate launch, torchrun's agent) was killed by {_signal_name(-returncode)} "
             f"(signal {-returncode}), and every rank with it (a rank dies with its parent)"] +
            (["exceptions the ranks had raised:"] + raised if raised else []) +
            [f"--- launcher log (tail) ---\n{tail}"]), log=tail)
    root = root_cause(failed, torchrun_first)
    if root is None:
        return LaunchError(f"launch exited with code {returncode}; ranks without a result: "
                           f"{_unfinished(tmp, world_size)}.\n--- launcher log (tail) ---\n{tail}", log=tail)
    lines = [f"rank {root.rank} of {world_size} {root.how()}"]
    if len(failed) > 1:
        lines.append("consequences on the other ranks:")
    for e in failed:
        if e is not root:
            same = e.error is not None and root.error is not None and \
                (e.error["type"], e.error["message"]) == (root.error["type"], root.error["message"])
            lines.append(f"  rank {e.rank} " + (f"failed with the same {e.error['type']}" if same else
                                                _first_line(e.how())))
    trace = root.error["traceback"] if root.error else ""
    if trace:
        lines.append(f"--- traceback of rank {root.rank} ---\n{trace}")
    if root.crash.strip():
        lines.append(f"--- stack of rank {root.rank} when it crashed ---\n{root.crash.strip()}")
    if not trace:
        lines.append(f"--- launcher log (tail) ---\n{tail}")
    return LaunchError("\n".join(lines), rank=root.rank, traceback=trace or root.crash, log=tail)


def root_cause(failed: list[RankEnd], torchrun_first: int | None) -> RankEnd | None:
    """The failure the others follow from, by the strength of the evidence each rank left:

    1. A rank that ended silently with a cause torchrun or faulthandler saw (a signal, a non-zero exit code, a
       crash stack) and that torchrun did not stop: a rank whose peer fails raises (gloo: "Connection closed by
       peer") or is stopped; it does not die silently. Among several, torchrun's first observed failure (it polls
       every 0.1 s; its report's times are whole seconds, so it cannot order two deaths closer than that).
    2. Else the earliest exception that is not a lost peer's echo (``PEER_GONE``): each rank stamps its own, so
       this order is exact.
    3. Else a rank that ended with no result and nothing else known (exit code 0, or no report): a rank
       stopped in a way this torch's report does not name looks the same (seen on torch 2.8), so it comes after
       a real exception.
    4. Else the earliest exception, then torchrun's first observed failure.
    """
    silent = [e for e in failed if e.silent]
    seen = [e for e in silent if e.exitcode or e.crash.strip()]
    if seen:
        return next((e for e in seen if e.rank == torchrun_first), seen[0])
    raised = sorted((e for e in failed if e.error is not None), key=lambda e: e.error["time"])
    own = [e for e in raised if not PEER_GONE.search(e.error.get("message") or "")]
    if own:
        return own[0]
    if silent:
        return next((e for e in silent if e.rank == torchrun_first), silent[0])
    if raised:
        return raised[0]
    return next((e for e in failed if e.rank == torchrun_first), None)


PEER_GONE = re.compile(r"Connection closed by peer|Connection reset by peer|Broken pipe", re.IGNORECASE)
"""Messages of a collective that failed because a peer went away: a consequence, never the root cause."""
_FAILURE = re.compile(r"rank\s*: (\d+) \(local_rank: \d+\)\s+exitcode\s*: (-?\d+) \(pid: (\d+)\)")
_STOPPED = re.compile(r"(?:Sending process|Terminating process|Closing process) (\d+) (?:closing|via) signal")
_ONE_RANK = re.compile(r"CalledProcessError: Command .* (?:died with <Signals\.\w+: (\d+)>|"
                       r"returned non-zero exit status (\d+))")


def torchrun_report(log: str) -> tuple[dict[int, int], set[int], int | None]:
    """From the launcher log: each failed rank's exit status (negative: the signal), the ranks torchrun stopped
    after the first failure, and the rank torchrun names under "Root Cause (first observed failure)".

    One rank runs without torchrun: accelerate's ``CalledProcessError`` line gives rank 0's status.
    """
    failures = [(int(r), int(code), int(pid)) for r, code, pid in _FAILURE.findall(log)]
    closed = {int(pid) for pid in _STOPPED.findall(log)}
    stopped = {r for r, _, pid in failures if pid in closed}
    root_at = log.rfind("Root Cause (first observed failure)")
    root = _FAILURE.search(log, root_at) if root_at >= 0 else None
    exitcodes = {r: code for r, code, _ in failures}
    single = _ONE_RANK.search(log)
    if not failures and single:
        exitcodes[0] = -int(single.group(1)) if single.group(1) else int(single.group(2))
    return exitcodes, stopped, int(root.group(1)) if root else None


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return "an unnamed signal"


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _read_text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _first_line(text: str, width: int = 200) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= width else line[:width - 3] + "..."


def _unfinished(tmp: Path, world_size: int) -> list[int]:
    return [r for r in range(world_size) if not (tmp / f"rank{r}.json").exists()]


def _read_stacks(tmp: Path, world_size: int, wait_s: float = 5.0) -> str:
    """Stacks the watchdogs of unfinished ranks dumped just before the deadline. A dump is read once its file has
    stopped growing: faulthandler writes the header before the threads' frames."""
    deadline = time.monotonic() + wait_s
    out = []
    for r in _unfinished(tmp, world_size):
        path = tmp / f"rank{r}.stack.txt"
        seen = 0
        while time.monotonic() < deadline:
            size = path.stat().st_size if path.exists() else 0
            if size and size == seen:
                break
            seen = size
            time.sleep(0.2)
        text = path.read_text() if path.exists() else ""
        out.append(f"--- stack of rank {r} at the deadline ---\n{text.strip() or '(no stack dumped)'}")
    return "\n".join(out)


def _tail(path: Path, n: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


# ---- the progress bar ---------------------------------------------------------------------------------------
@contextlib.contextmanager
def kernel_stays_busy():
    """While the block runs in a Jupyter kernel, every status the kernel publishes for a control-channel message
    is followed by "busy" for the cell that is running.

    Why: JupyterLab (4.4 and later, with ipykernel 7's subshells) sends ``create_subshell_request`` on the control
    channel when the first widget of a session opens its comm (here the launch's bar). ipykernel answers with a
    busy and an idle status whose parent is that request, and both JupyterLab's status bar and the server's
    ``/api/kernels`` take any status for the kernel's: the rest of the launch showed "Idle" while the cell ran
    (measured: busy in 5 of 48 polls of a 13 s launch, the first 2 s; with this, in every poll). Nothing changes
    outside a kernel or where ipykernel lacks these hooks."""
    try:
        from IPython import get_ipython
        kernel = getattr(get_ipython(), "kernel", None)
        publish, cell = kernel._publish_status, kernel.get_parent("shell")
    except Exception:  # not in a kernel, or an ipykernel without these names
        yield
        return
    if not cell:
        yield
        return

    def publish_then_busy(status, *args, **kwargs):  # ipykernel's (status, channel, parent=None)
        publish(status, *args, **kwargs)
        if status == "idle" and (args[0] if args else kwargs.get("channel")) == "control":
            publish("busy", "shell", cell)

    kernel._publish_status = publish_then_busy
    try:
        yield
    finally:
        if kernel.__dict__.get("_publish_status") is publish_then_busy:
            del kernel._publish_status


def _in_notebook() -> bool:
    """A kernel that a person is looking at: JupyterLab / Notebook (their server names the session), not a
    kernel papermill or nbclient runs headless (those get plain lines, kept in the executed notebook)."""
    try:
        from IPython import get_ipython
        shell = get_ipython()
    except ImportError:
        return False
    return shell is not None and shell.__class__.__name__ == "ZMQInteractiveShell" and \
        bool(os.environ.get("JPY_SESSION_NAME"))


class Progress:
    """One bar per launch: a widget in JupyterLab, plain lines under papermill, CI and scripts, nothing with
    ``mode="none"``. Every mode keeps ``trace``: each report it read, where it put the bar, and when.

    The total is the sum of the phase weights, fixed before any rank starts (without phases: one phase
    of weight 1). Rank 0 reports ``{"phase": i, "fraction": f, "done", "total", "message"}``, ``f`` its place
    in phase i (``Context.part`` nests code that counts its own units into a slice of the phase; without
    ``fraction``, ``done / total``); the bar stands at ``(weights of the phases before i + weight_i * f) /
    sum of weights`` and never moves back. Plain lines come at each phase, every tenth of the bar (at most
    one per 2 s) and, while nothing changes, every ``HEARTBEAT_S`` seconds, so a long step is not silence.
    """

    WIDTH = 1000  # widget resolution
    HEARTBEAT_S = 30.0  # plain mode: the longest stretch without a line

    def __init__(self, title: str, mode: str, phases: list | None = None, out=None):
        self.title, self.start, self.last_line, self.last_key = title, time.monotonic(), -1e9, None
        self.phases = [list(p) for p in phases] if phases else [["run", 1.0]]
        self.declared = bool(phases)
        self.weight = sum(w for _, w in self.phases)
        self.fraction, self.state, self.out = 0.0, None, out or sys.stdout
        self.trace: list[list] = []  # [overall(state), state, seconds] per report read, before never-move-back
        if mode == "auto":
            plain = os.environ.get("TOOLKIT_PLAIN_PROGRESS") or os.environ.get("CI") or not _in_notebook()
            mode = "plain" if plain else "widget"
        self.mode, self.bar = mode, None
        if mode == "widget":
            try:
                import ipywidgets as w
                from IPython.display import display
                self.bar = w.IntProgress(value=0, min=0, max=self.WIDTH, description="starting",
                                         layout=w.Layout(width="40%"))
                self.label = w.Label(title)
                display(w.HBox([self.bar, self.label]))
            except ImportError:
                self.mode = "plain"
        if self.mode == "plain":
            names = ", ".join(f"{n} ({w:g})" for n, w in self.phases) if phases else "one phase"
            self._print(f"starting; phases: {names}")

    def poll(self, tmp: Path) -> None:
        """Read rank 0's progress file, if a new one is there (plain mode: repeat the line after a silence)."""
        path = tmp / "progress.rank0.json"
        try:
            state = json.loads(path.read_text())
        except (FileNotFoundError, json.JSONDecodeError, OSError):
            state = self.state
        if state is not None and state != self.state:
            self.update(state)
        elif self.mode == "plain" and time.monotonic() - self.last_line > self.HEARTBEAT_S:
            elapsed = time.monotonic() - self.start
            self._print(" ".join(filter(None, [f"{100 * self.fraction:3.0f}%", self._where(),
                                               f"({elapsed:.1f}s, still working)"])))

    def overall(self, state: dict) -> float:
        """The fraction of the whole run that ``state`` (one report of rank 0) stands for."""
        i = self._phase_of(state)
        if "fraction" in state:
            inside = state["fraction"]
        else:
            done, total = state.get("done", 0), state.get("total", 0)
            inside = done / total if total else 0.0
        before = sum(w for _, w in self.phases[:i])
        return (before + self.phases[i][1] * min(max(inside, 0.0), 1.0)) / self.weight

    def update(self, state: dict) -> None:
        self.state = state
        self.trace.append([self.overall(state), state, round(time.monotonic() - self.start, 3)])
        self.fraction = max(self.fraction, self.trace[-1][0])
        elapsed = time.monotonic() - self.start
        if self.mode == "widget" and self.bar is not None:
            self.bar.value = int(round(self.fraction * self.WIDTH))
            self.bar.description = f"{100 * self.fraction:.0f}%"
            self.label.value = f"{self.title} · {self._where()} · {elapsed:.1f}s"
        elif self.mode == "plain":
            key = (self._phase_of(state), int(10 * self.fraction))
            if key[0] != (self.last_key or (None,))[0] or (key != self.last_key and
                                                           time.monotonic() - self.last_line > 2.0):
                self._print(f"{100 * self.fraction:3.0f}% {self._where()} ({elapsed:.1f}s)")
                self.last_key = key

    def _phase_of(self, state: dict) -> int:
        return min(max(int(state.get("phase", 0)), 0), len(self.phases) - 1)

    def _where(self) -> str:
        """Where rank 0 is: phase (i/n), its innermost count and message."""
        if self.state is None:
            return "starting the ranks"
        state = self.state
        i, done, total = self._phase_of(state), state.get("done", 0), state.get("total", 0)
        return " ".join(filter(None, [f"{self.phases[i][0]} ({i + 1}/{len(self.phases)})" if self.declared else "",
                                      f"{done:g}/{total:g}" if total else "", state.get("message", "")]))

    def close(self, status: str) -> None:
        elapsed = time.monotonic() - self.start
        if self.mode == "widget" and self.bar is not None:
            self.bar.bar_style = "success" if status == "done" else "danger"
            if status == "done":
                self.bar.value = self.WIDTH
            self.bar.description = status
            self.label.value = f"{self.title} · {status} in {elapsed:.1f}s"
        elif self.mode == "plain":
            self._print(f"{status} in {elapsed:.1f}s")

    def _print(self, text: str) -> None:
        print(f"[launch] {self.title}: {text}", file=self.out, flush=True)
        self.last_line = time.monotonic()


# ---- 8. the test suite's launch cache ----------------------------------------------------------------------------
CACHE_ENV = "TOOLKIT_LAUNCH_CACHE"
"""A folder (the test suite sets one per session, ``conftest.py``): a launch of one of ``CACHED_PROGRAMS``
identical to one already run there returns that run's results instead of starting its processes again, so a
notebook's run and a test module's fixture that launch the same job share one launch. Unset (a notebook,
``make run``, your code): every launch runs."""
CACHE_KEY_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "TRITON_INTERPRET")
"""Environment a run's results may depend on, besides every ``TOOLKIT_*`` variable: part of the cache key."""


class _SessionCache:
    """One launch's entry in the session cache: ``results`` when an identical launch already ran (else None),
    ``store(results)`` after a successful run (a failure is never stored: the next identical launch runs)."""

    def __init__(self, path: Path | None):
        self.path, self.results = path, None
        if path is not None and path.exists():
            data = json.loads(path.read_text())
            self.results = RankResults(data["results"])
            self.results.wall_s, self.results.log = data["wall_s"], data["log"]
            self.results.progress = data.get("progress")

    def note_hit(self, title: str) -> None:
        """One line per launch served from the cache, in the folder's ``hits.log`` (what the cache saved)."""
        with open(self.path.parent / "hits.log", "a") as log:
            log.write(f"{title}\t{self.results.wall_s:.1f}\n")

    def store(self, results: RankResults) -> None:
        if self.path is not None:
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"results": list(results), "wall_s": results.wall_s, "log": results.log,
                                       "progress": results.progress}))
            tmp.replace(self.path)


CACHED_PROGRAMS = re.compile(r"toolkit\.lessons\.(l\d\d\w*:run|emulator_check:\w+)")
"""Launch targets (``module:function``) the session cache may serve: deterministic programs of the course."""


@contextlib.contextmanager
def session_cache(target, cfg: dict, world_size: int, backend: str, seed: int, threads: int, cluster: dict | None,
                  accelerate_args, keep: bool):
    """The session cache's entry for this launch (``CACHE_ENV``), held under a lock so that an identical launch
    in another process (a pytest-xdist worker, a notebook kernel) waits for this one and then reads its results.
    Only the course's own programs are cached (``CACHED_PROGRAMS``: a lesson's ``run``, the emulator's checks that
    lesson 00 shows and ``tests/test_emulator.py`` asserts), and never a launch whose files were asked for
    (``out_dir``, ``keep_files``): tests of the launcher itself always start processes."""
    folder = os.environ.get(CACHE_ENV)
    spec = target.spec
    program = f"{spec.get('module', '')}:{spec.get('function', '')}" if spec.get("kind") == "import" else ""
    if not folder or keep or CACHED_PROGRAMS.fullmatch(program) is None:
        yield _SessionCache(None)
        return
    env = {k: v for k, v in os.environ.items()
           if (k.startswith("TOOLKIT_") and k not in (CACHE_ENV, "TOOLKIT_PLAIN_PROGRESS")) or k in CACHE_KEY_ENV}
    fields = {"target": spec, "cfg": cfg, "world_size": world_size, "backend": backend, "seed": seed,
              "threads": threads, "cluster": cluster, "accelerate_args": accelerate_args, "env": env,
              "toolkit": str(Path(__file__).resolve().parents[1]),  # the code
              # the caller's folder only where a cfg value may be a relative path (nvme_path): a lesson reads no
              # other, so a test (in the repository's root) and a notebook (in notebooks/) share one launch
              "cwd": os.getcwd() if any(isinstance(v, str) and os.sep in v and not os.path.isabs(v)
                                        for v in cfg.values()) else None}
    text = json.dumps(fields, sort_keys=True, default=repr)
    key = hashlib.sha256(text.encode()).hexdigest()[:32]
    path = Path(folder) / f"{key}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".key.json").write_text(text)  # what was hashed: a miss is found by comparing these
    with open(path.with_suffix(".lock"), "w") as lock:
        if fcntl is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield _SessionCache(path)


# ---- 9. a batch's launch server -----------------------------------------------------------------------------
SERVER_READY_S = 120.0  # a launch server's imports on a loaded 2-core machine


@dataclass
class LaunchServer:
    """A running launch (or kernel) server: its socket, its process and its log (a line per request served or
    declined)."""
    path: str
    pid: int
    log: Path
    ready: bool

    def summary(self) -> str:
        """How many requests it served and declined so far, and why it declined them."""
        lines = self.log.read_text().splitlines()
        served = sum(line.startswith("served") for line in lines)
        declined = [line.removeprefix("declined: ") for line in lines if line.startswith("declined")]
        why = "".join(f"; {n} as {reason}" for reason, n in collections.Counter(declined).items())
        return f"{served} served, {len(declined)} declined (started afresh){why}"


@contextlib.contextmanager
def serving(threads: int = 1, role: str = "launcher", interpreter: list[str] | None = None):
    """Run a launch server (``toolkit.runtime.launch_server``) for the launches of this process and its children
    (``TOOLKIT_LAUNCH_SERVER``), then stop it. ``role="kernel"``: a server of notebook kernels instead
    (``TOOLKIT_KERNEL_SERVER``, for papermill's ``kernel_manager_class=launch_server.kernel_manager_class()``).

    ``threads``: the intra-op threads of the launches it will serve (``launch(..., threads=)``); launches with
    another count, or from a process whose environment differs, start a fresh launcher as without a server.
    ``interpreter``: the server's interpreter and options (what precedes ``-m`` in a kernelspec's argv; this
    process's by default): a kernel is served only from the interpreter its kernelspec names.
    Yields a :class:`LaunchServer` (``ready`` False: it did not start, and every launch or kernel starts afresh)."""
    if role not in ("launcher", "kernel"):
        raise ValueError(f"role={role!r}; allowed: 'launcher', 'kernel'")
    variable = launch_server.SERVER_ENV if role == "launcher" else launch_server.KERNEL_SERVER_ENV
    folder = Path(tempfile.mkdtemp(prefix=f"toolkit-{role}-server-"))
    path, log_path = str(folder / "socket"), folder / "server.log"
    previous = os.environ.get(variable)
    os.environ[variable] = path
    env = child_env(threads, forked=True) if role == "launcher" else dict(os.environ)
    with open(log_path, "w") as log:
        proc = subprocess.Popen([*(interpreter or [sys.executable]), "-m", "toolkit.runtime.launch_server", path,
                                 str(os.getpid()), role],
                                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        end = time.monotonic() + SERVER_READY_S
        while "ready" not in log_path.read_text() and proc.poll() is None and time.monotonic() < end:
            time.sleep(0.05)
        ready = proc.poll() is None and "ready" in log_path.read_text()
        if not ready:
            os.environ.pop(variable)
            print(f"{role} server did not start; each starts afresh:\n{log_path.read_text()}", file=sys.stderr)
        yield LaunchServer(path, proc.pid, log_path, ready)
    finally:
        if previous is None:
            os.environ.pop(variable, None)
        else:
            os.environ[variable] = previous
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(folder, ignore_errors=True)
