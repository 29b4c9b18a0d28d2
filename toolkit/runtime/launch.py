"""Run a lesson on N real processes from a notebook or a script.

::

    notebook / script                    accelerate launch (subprocess, own session)
    ─────────────────                    ───────────────────────────────────────────
    launch("l00_foundations", 4, cfg) ─► torchrun ─► rank 0..3: python -m toolkit.runtime.worker spec.json
          │  polls out_dir:                              │ init_process_group (gloo | nccl)
          │   progress.rank0.json  ◄──────────────────── │ run(ctx, cfg)  -> rank{r}.json
          │   rank{r}.error.json   ◄──────────────────── │ exception      -> rank{r}.error.json
          │   rank{r}.stack.txt    ◄──────────────────── │ watchdog dump before the deadline
          ▼
    [result of rank 0, ..., result of rank 3]    or LaunchError naming the failing rank

The whole process tree is killed on failure, on timeout and on KeyboardInterrupt
(the stop button in Jupyter), so no rank outlives its launch.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

from .context import resolve_backend


class LaunchError(RuntimeError):
    """A rank raised, crashed or the launch timed out. ``rank`` is the first failing rank (or None)."""

    def __init__(self, message: str, rank: int | None = None, traceback: str = "", log: str = ""):
        super().__init__(message)
        self.rank, self.traceback, self.log = rank, traceback, log


class LaunchTimeout(LaunchError, TimeoutError):
    """The launch ran past ``timeout_s``; the stacks of the unfinished ranks are attached."""


class RankResults(list):
    """Per-rank results (index = rank) plus ``wall_s``, ``out_dir`` and the launcher ``log``."""

    wall_s: float = 0.0
    out_dir: Path | None = None
    log: str = ""


def _in_notebook() -> bool:
    try:
        from IPython import get_ipython
        shell = get_ipython()
        return shell is not None and shell.__class__.__name__ == "ZMQInteractiveShell"
    except ImportError:
        return False


class _Progress:
    """A progress bar in JupyterLab; plain log lines under papermill, CI and scripts."""

    def __init__(self, title: str, mode: str):
        self.title, self.start, self.last_line, self.last_key = title, time.monotonic(), 0.0, None
        if mode == "auto":
            plain = os.environ.get("TOOLKIT_PLAIN_PROGRESS") or os.environ.get("CI") or not _in_notebook()
            mode = "plain" if plain else "widget"
        self.mode, self.bar = mode, None
        if mode == "widget":
            try:
                import ipywidgets as w
                from IPython.display import display
                self.bar = w.IntProgress(value=0, min=0, max=1, description="starting",
                                         layout=w.Layout(width="45%"))
                self.label = w.Label(title)
                display(w.HBox([self.bar, self.label]))
            except ImportError:
                self.mode = "plain"
        if self.mode == "plain":
            print(f"[launch] {title}: starting", flush=True)

    def update(self, done: int, total: int, message: str) -> None:
        elapsed = time.monotonic() - self.start
        if self.mode == "widget" and self.bar is not None:
            self.bar.max, self.bar.value = max(total, 1), done
            self.bar.description = f"{done}/{total}"
            self.label.value = f"{self.title} · {message} · {elapsed:.1f}s"
        elif self.mode == "plain":
            key = (done * 10 // max(total, 1), message)
            if key != self.last_key and time.monotonic() - self.last_line > 2.0:
                print(f"[launch] {self.title}: {done}/{total} {message} ({elapsed:.1f}s)", flush=True)
                self.last_key, self.last_line = key, time.monotonic()

    def close(self, status: str) -> None:
        elapsed = time.monotonic() - self.start
        if self.mode == "widget" and self.bar is not None:
            self.bar.bar_style = "success" if status == "done" else "danger"
            self.bar.value = self.bar.max
            self.bar.description = status
            self.label.value = f"{self.title} · {status} in {elapsed:.1f}s"
        elif self.mode == "plain":
            print(f"[launch] {self.title}: {status} in {elapsed:.1f}s", flush=True)


def kill_tree(pid: int, grace_s: float = 3.0) -> None:
    """SIGTERM the process and all its descendants, then SIGKILL whatever is left."""
    import psutil
    try:
        root = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    procs = root.children(recursive=True) + [root]
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


def validate_launch(lesson: str, world_size: int, cfg: dict, backend: str) -> tuple[object, dict, str]:
    """All checks that can run before any process starts; returns (module, cfg, backend)."""
    from .worker import resolve_lesson
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    backend = resolve_backend(backend)
    if backend == "nccl":
        import torch
        if world_size > torch.cuda.device_count():
            raise ValueError(f"world_size={world_size} exceeds the {torch.cuda.device_count()} visible GPUs "
                             "(nccl runs one rank per GPU)")
    cores = os.cpu_count() or 1
    if backend == "gloo" and world_size > cores:
        warnings.warn(f"world_size={world_size} is more ranks than the {cores} CPU cores: ranks will share cores "
                      "and timings will be slower (results are unaffected)", stacklevel=3)
    if not isinstance(cfg, dict):
        raise ValueError(f"cfg must be a dict, got {type(cfg).__name__}")
    module, _ = resolve_lesson(lesson)
    validate = getattr(module, "validate", None)
    if validate is not None:
        cfg = validate(dict(cfg), world_size) or cfg
    return module, cfg, backend


def launch(lesson: str, world_size: int, cfg: dict | None = None, *, backend: str = "auto",
           timeout_s: float = 120.0, seed: int = 0, threads: int = 1, progress: str = "auto",
           accelerate_args: list[str] | None = None, out_dir: str | Path | None = None,
           keep_files: bool = False) -> RankResults:
    """Run ``lesson`` on ``world_size`` processes with ``accelerate launch`` and return each rank's result.

    Args:
        lesson: ``"l00_foundations"`` (a module in ``toolkit.lessons``), ``"pkg.module"`` or
            ``"pkg.module:function"``; the function is ``fn(ctx, cfg) -> dict``. A module-level
            ``validate(cfg, world_size)`` runs here first, before any process starts.
        world_size: number of ranks (processes).
        cfg: JSON-able lesson configuration, passed to every rank.
        backend: ``"auto"`` (nccl with GPUs, else gloo), ``"gloo"`` or ``"nccl"``.
        timeout_s: the whole launch is killed after this; collectives time out a bit earlier.
        seed: seeds Python, NumPy and torch identically on every rank.
        threads: intra-op threads per rank.
        progress: ``"auto"``, ``"widget"``, ``"plain"`` or ``"none"``.
        accelerate_args: extra ``accelerate launch`` arguments, e.g. multi-node
            ``["--num_machines", "2", "--machine_rank", "0", "--main_process_ip", "node0",
            "--main_process_port", "29500"]`` or ``["--config_file", "cluster.yaml"]``.
        out_dir: where ranks write results (a temporary folder by default, removed after).
        keep_files: keep ``out_dir`` (logs, per-rank stacks) after a successful launch.

    Raises:
        ValueError: bad arguments (before anything starts).
        LaunchError: a rank failed; the message names it and carries its traceback.
        LaunchTimeout: past ``timeout_s``; carries the stacks of the ranks still running.
    """
    cfg = dict(cfg or {})
    _, cfg, backend = validate_launch(lesson, world_size, cfg, backend)
    if progress not in ("auto", "widget", "plain", "none"):
        raise ValueError(f"progress={progress!r}; allowed: 'auto', 'widget', 'plain', 'none'")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    tmp = Path(out_dir) if out_dir else Path(tempfile.mkdtemp(prefix="toolkit-"))
    tmp.mkdir(parents=True, exist_ok=True)
    for stale in list(tmp.glob("rank*")) + list(tmp.glob("progress.*")):
        stale.unlink()
    spec = {"lesson": lesson, "cfg": cfg, "backend": backend, "seed": seed, "threads": threads,
            "timeout_s": timeout_s, "deadline": time.time() + timeout_s,
            "collective_timeout_s": max(5.0, timeout_s * 0.8), "out_dir": str(tmp)}
    spec_path = tmp / "spec.json"
    spec_path.write_text(json.dumps(spec))
    extra = list(accelerate_args or [])
    cmd = [sys.executable, "-m", "accelerate.commands.launch"]
    if "--config_file" not in extra:
        cmd += ["--multi_gpu", "--num_processes", str(world_size), "--num_machines", "1",
                "--mixed_precision", "no", "--dynamo_backend", "no", "--monitor_interval", "0.1"]
        if "--main_process_port" not in extra:
            cmd += ["--main_process_port", "0"]
    cmd += extra + ["-m", "toolkit.runtime.worker", str(spec_path)]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]),
                                                        os.environ.get("PYTHONPATH")])))
    log_path = tmp / "launch.log"
    title = f"{lesson} x{world_size} ({backend})"
    bar = _Progress(title, progress) if progress != "none" else None
    start = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            while proc.poll() is None:
                if time.monotonic() - start > timeout_s:
                    stacks = _read_stacks(tmp, world_size)
                    kill_tree(proc.pid)
                    if bar:
                        bar.close("timed out")
                    raise LaunchTimeout(
                        f"launch of {lesson!r} on {world_size} ranks timed out after {timeout_s:.0f}s "
                        f"(ranks without a result: {_unfinished(tmp, world_size)}); all processes killed.\n"
                        + stacks, rank=None, traceback=stacks, log=_tail(log_path))
                if bar:
                    _show_progress(bar, tmp)
                time.sleep(0.05)
        except BaseException:
            kill_tree(proc.pid)
            raise
    wall = time.monotonic() - start
    errors = sorted((json.loads(p.read_text()) for p in tmp.glob("rank*.error.json")), key=lambda e: e["time"])
    missing = _unfinished(tmp, world_size)
    if errors or missing or proc.returncode != 0:
        if bar:
            bar.close("failed")
        if errors:
            first = errors[0]
            others = ", ".join(str(e["rank"]) for e in errors[1:])
            raise LaunchError(
                f"rank {first['rank']} of {world_size} failed with {first['type']}: {first['message']}"
                + (f"\n(ranks {others} failed after it)" if others else "")
                + f"\n--- traceback of rank {first['rank']} ---\n{first['traceback']}",
                rank=first["rank"], traceback=first["traceback"], log=_tail(log_path))
        raise LaunchError(f"launch exited with code {proc.returncode}; ranks without a result: {missing}.\n"
                          f"--- launcher log (tail) ---\n{_tail(log_path)}", rank=missing[0] if missing else None,
                          log=_tail(log_path))
    results = RankResults(json.loads((tmp / f"rank{r}.json").read_text()) for r in range(world_size))
    results.wall_s, results.log = wall, log_path.read_text()
    if bar:
        bar.close("done")
    if keep_files or out_dir:
        results.out_dir = tmp
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    return results


def _show_progress(bar: _Progress, tmp: Path) -> None:
    path = tmp / "progress.rank0.json"
    if path.exists():
        try:
            p = json.loads(path.read_text())
        except (json.JSONDecodeError, OSError):
            return
        bar.update(p["done"], p["total"], p["message"])


def _unfinished(tmp: Path, world_size: int) -> list[int]:
    return [r for r in range(world_size) if not (tmp / f"rank{r}.json").exists()]


def _read_stacks(tmp: Path, world_size: int, wait_s: float = 5.0) -> str:
    """Stacks the watchdogs of unfinished ranks dumped just before the deadline."""
    deadline = time.monotonic() + wait_s
    out = []
    for r in _unfinished(tmp, world_size):
        path = tmp / f"rank{r}.stack.txt"
        while time.monotonic() < deadline and not (path.exists() and path.stat().st_size):
            time.sleep(0.1)
        text = path.read_text() if path.exists() else ""
        out.append(f"--- stack of rank {r} at the deadline ---\n{text.strip() or '(no stack dumped)'}")
    return "\n".join(out)


def _tail(path: Path, n: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""
