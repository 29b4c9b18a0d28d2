"""The caller watching a launch: the process tree it started, and what the ranks left behind when it ends.

::

    run_ranks   poll the launcher until it exits; past the deadline read the ranks' stacks, then kill the tree
                once (on an interrupt too: the stop button in Jupyter)
    collect     every rank's result, or
    failure     a LaunchError: the root cause first (``root_cause``: which rank, and the exception, "out of
                memory", the signal or the exit code), then the other ranks' failures as its consequences

It reads the files each rank writes (``toolkit.runtime.rank_process``: ``rank{r}.json``, ``.error.json``,
``.stack.txt``, ``.crash.txt``, each renamed into place whole) and torchrun's report in ``launch.log``.
"""
from __future__ import annotations

import json
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from .caller_start import start_launcher


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


# ---- how each rank ended -----------------------------------------------------------------------------------
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

