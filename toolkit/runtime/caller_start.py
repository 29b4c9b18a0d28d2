"""How the caller starts the launcher process (``toolkit.runtime.launcher_process``): its environment, and the
client of a batch's launch server (``toolkit.runtime.server_process``), which forks a pre-imported launcher
where a fresh interpreter would spend 4–5 s on imports::

    start_launcher(cmd, env)  ── TOOLKIT_LAUNCH_SERVER set and the server accepts ──►  ServedProcess (forked)
                              └─ otherwise ─────────────────────────────────────────►  subprocess.Popen (fresh)

Either way the caller watches a process with the same ``pid``, ``poll()``, ``wait()`` and exit status
(``toolkit.runtime.caller_watch``). ``serving()`` runs a server for a batch (``make run``, the test session).
"""
from __future__ import annotations

import collections
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from . import server_process  # light: the standard library only

RANK_ENV = "TOOLKIT_LAUNCHED_RANK"  # set in every rank; launch() refuses to start ranks from inside one
SERVER_READY_S = 120.0  # a launch server's imports on a loaded 2-core machine


def child_env(threads: int, forked: bool) -> dict:
    """The launcher's environment: this process's, with the ranks' thread count and the toolkit importable."""
    root = str(Path(__file__).resolve().parents[2])  # the toolkit's checkout, importable even if not installed
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1", **{RANK_ENV: "1"},
               PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    if forked:  # torchrun's --start-method fork --run-path, which accelerate launch's parser does not pass on
        env.update(PET_START_METHOD="fork", PET_RUN_PATH="1")
    return env


def start_launcher(cmd: list[str], env: dict, log, log_path: Path):
    """The launcher, forked by the batch's launch server when one serves this launch (its imports done once),
    else a fresh interpreter in a session of its own."""
    server = os.environ.get(server_process.SERVER_ENV)
    if server and env.get("PET_START_METHOD") == "fork":
        served = request(server, cmd, env, log_path)
        if served is not None:
            return served
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


class ServedProcess:
    """A process the server forked, watched like the ``subprocess.Popen`` of a fresh one: ``pid``, ``poll()``,
    ``wait()``, ``returncode`` (negative: the signal that ended it), ``send_signal``, ``terminate``, ``kill``."""

    stdin = stdout = stderr = None  # its streams go to the log it was given

    def __init__(self, conn: socket.socket, pid: int, buffer: bytes = b""):
        self.pid, self.returncode = pid, None
        self._conn, self._buffer = conn, buffer
        conn.setblocking(False)

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() > end:
                raise subprocess.TimeoutExpired(f"served process {self.pid}", timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def poll(self) -> int | None:
        if self.returncode is None:
            data = None
            if b"\n" not in self._buffer:
                try:
                    data = self._conn.recv(4096)
                except BlockingIOError:
                    return None
                self._buffer += data
            if b"\n" in self._buffer:
                self.returncode = int(json.loads(self._buffer.split(b"\n")[0])["returncode"])
            elif not data:  # the watcher is gone without a word (killed): no status to read
                self.returncode = -signal.SIGKILL
            if self.returncode is not None:
                self._conn.close()
        return self.returncode


def request(path: str, cmd: list[str], env: dict, log_path: Path, cwd: str | None = None) -> ServedProcess | None:
    """Ask the server at ``path`` to fork ``cmd``: its role's program (``python -m toolkit.runtime.launcher_process
    ARGS`` or ``python -m ipykernel_launcher ARGS``) with ``env``, ``cwd`` (this process's by default) and ``log_path``
    as its stdout and stderr. None if there is no server there or it declines (another interpreter or
    environment, changed sources): the caller starts a fresh interpreter."""
    split = cmd.index("-m")
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.settimeout(10.0)
        conn.connect(path)
        conn.sendall(json.dumps({"interpreter": cmd[:split], "program": cmd[split + 1], "args": cmd[split + 2:],
                                 "env": env, "cwd": cwd or os.getcwd(), "log": str(log_path),
                                 "limits": server_process.process_limits(),
                                 "sources": server_process.sources()}).encode() + b"\n")
        buffer = b""
        while b"\n" not in buffer and (data := conn.recv(4096)):
            buffer += data
        line, _, rest = buffer.partition(b"\n")
        reply = json.loads(line or b"{}")
    except (OSError, ValueError):
        conn.close()
        return None
    if "pid" not in reply:
        conn.close()
        return None
    return ServedProcess(conn, int(reply["pid"]), rest)


# ---- a batch's server --------------------------------------------------------------------------------------------
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
    """Run a launch server (``toolkit.runtime.server_process``) for the launches of this process and its children
    (``TOOLKIT_LAUNCH_SERVER``), then stop it. ``role="kernel"``: a server of notebook kernels instead
    (``TOOLKIT_KERNEL_SERVER``, which ``tools/nb.py``'s papermill runs ask through their kernel manager).

    ``threads``: the intra-op threads of the launches it will serve (``launch(..., threads=)``); launches with
    another count, or from a process whose environment differs, start a fresh launcher as without a server.
    ``interpreter``: the server's interpreter and options (what precedes ``-m`` in a kernelspec's argv; this
    process's by default): a kernel is served only from the interpreter its kernelspec names.
    Yields a :class:`LaunchServer` (``ready`` False: it did not start, and every launch or kernel starts afresh)."""
    if role not in ("launcher", "kernel"):
        raise ValueError(f"role={role!r}; allowed: 'launcher', 'kernel'")
    variable = server_process.SERVER_ENV if role == "launcher" else server_process.KERNEL_SERVER_ENV
    folder = Path(tempfile.mkdtemp(prefix=f"toolkit-{role}-server-"))
    path, log_path = str(folder / "socket"), folder / "server.log"
    previous = os.environ.get(variable)
    os.environ[variable] = path
    env = child_env(threads, forked=True) if role == "launcher" else dict(os.environ)
    with open(log_path, "w") as log:
        proc = subprocess.Popen([*(interpreter or [sys.executable]), "-m", "toolkit.runtime.server_process", path,
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
