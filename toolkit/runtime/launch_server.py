"""A launcher kept warm for a batch of launches: each launch forks it instead of starting a fresh interpreter.

Before torchrun's agent starts a single rank, a fresh launcher (``python -m toolkit.runtime.launcher``) spends
4–5 s importing torch, torch._dynamo, accelerate and the runtime: a fifth of a short lesson's launch on 2 cores.
A batch of launches (``tools/run_all.py``, the test session) starts one server that imports them once; every
launch in a process that inherits ``TOOLKIT_LAUNCH_SERVER`` (the batch's notebook kernels, its test workers)
hands its command to it::

    launch() ── socket: argv, environment, cwd, log ──►  server (imported once)
       │                                                    └─ fork ─► watcher ── fork ─► launcher ─► agent ─► ranks
       ◄─────────── the launcher's pid, then its exit status ────┘

The launcher is the one a fresh interpreter would run: the caller's argv, environment, working directory and
log, in a session of its own; ``launch`` watches it as it watches a fresh one (the same timeout, ``kill_tree`` of
its pid, the same report of a failure). The server serves a launch only if the caller's environment is the one
it imported under (aside from what a kernel, a notebook, pytest or torch set in the caller: ``CALLER_ENV``), with
the same interpreter and the toolkit's sources unchanged since; otherwise ``request`` returns None and ``launch``
starts a fresh launcher. Served launches fork their ranks as every CPU launch does (``toolkit.runtime.launcher``), so the ranks compute
the same bits. The server leaves when its owner stops it (``toolkit.runtime.launch.serving``), or when the
owner's process is gone.

A notebook opened by hand in JupyterLab has no server: each launch there starts its own launcher.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import socket
import sys
import traceback
from pathlib import Path

SERVER_ENV = "TOOLKIT_LAUNCH_SERVER"  # the server's socket path, inherited by the processes that may use it
CALLER_ENV = ("CLICOLOR", "CLICOLOR_FORCE", "FORCE_COLOR", "GIT_PAGER", "PAGER", "MPLBACKEND", "TERM",
              "PYDEVD_USE_FRAME_EVAL",  # ipykernel's, in a notebook's kernel
              "PLOTLY_RENDERER",  # toolkit.viz's, in a notebook
              "COLUMNS", "LINES",  # the terminal's size (pytest's)
              "TORCHINDUCTOR_CACHE_DIR", "CUBLAS_WORKSPACE_CONFIG")  # torch's, once the caller imports inductor
CALLER_PREFIXES = ("JPY_", "PYTEST_")  # Jupyter's, and pytest's (PYTEST_CURRENT_TEST changes with every test)
PACKAGE = Path(__file__).resolve().parents[1]  # toolkit/


def import_env(env: dict) -> dict:
    """The environment the preloaded modules may have read: all of it but what a caller's own process sets once
    it runs (``CALLER_ENV``, ``CALLER_PREFIXES``: none of the preloaded modules reads these when imported)."""
    return {k: v for k, v in env.items() if k not in CALLER_ENV and not k.startswith(CALLER_PREFIXES)}


def sources() -> str:
    """The interpreter and the toolkit's sources (paths and modification times), as one digest."""
    h = hashlib.sha256(sys.executable.encode())
    for path in sorted(PACKAGE.rglob("*.py")):
        h.update(f"{path}:{path.stat().st_mtime_ns}\0".encode())
    return h.hexdigest()


def mismatch(env: dict, own_env: dict, digest: str, own_digest: str) -> str:
    """Why a request cannot be served by a server that imported under ``own_env`` and ``own_digest`` ('' if it
    can): the variables that differ, or the sources."""
    env, own_env = import_env(env), import_env(own_env)
    differ = sorted(k for k in env.keys() | own_env.keys() if env.get(k) != own_env.get(k))
    if differ:
        return "the environment differs in " + ", ".join(differ)
    return "" if digest == own_digest else "the interpreter or the toolkit's sources changed"


# ---- the caller's side ------------------------------------------------------------------------------------------
class ServedLauncher:
    """A launcher the server forked, watched like the ``subprocess.Popen`` of a fresh one: ``pid``, ``poll()``,
    ``returncode`` (negative: the signal that ended it)."""

    def __init__(self, conn: socket.socket, pid: int, buffer: bytes = b""):
        self.pid, self.returncode = pid, None
        self._conn, self._buffer = conn, buffer
        conn.setblocking(False)

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


def request(path: str, args: list[str], env: dict, log_path: Path) -> ServedLauncher | None:
    """Ask the server at ``path`` to fork ``python -m toolkit.runtime.launcher ARGS`` with ``env``, this process's
    working directory and ``log_path`` as its stdout and stderr. None if there is no server there or it declines
    (another environment, changed sources): the caller starts a fresh launcher."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.settimeout(10.0)
        conn.connect(path)
        conn.sendall(json.dumps({"args": args, "env": env, "cwd": os.getcwd(), "log": str(log_path),
                                 "sources": sources()}).encode() + b"\n")
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
    return ServedLauncher(conn, int(reply["pid"]), rest)


# ---- the server's side ------------------------------------------------------------------------------------------
def serve(path: str, owner: int) -> None:
    """Import once, then fork a launcher for each request it can serve (``mismatch``), until ``owner`` is gone (its
    parent: the process that called ``toolkit.runtime.launch.serving``)."""
    own_env, own_digest = dict(os.environ), sources()  # before the imports: one sets TORCHINDUCTOR_CACHE_DIR
    from toolkit.runtime import launcher
    launcher.preload()

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    listener.settimeout(1.0)
    print("ready", flush=True)
    while os.getppid() == owner:
        _reap()
        try:
            conn, _ = listener.accept()
        except socket.timeout:
            continue
        with conn:
            conn.settimeout(10.0)
            try:
                req = json.loads(conn.makefile("rb").readline())
            except (OSError, ValueError):
                continue
            why = mismatch(req["env"], own_env, req["sources"], own_digest)
            if why:
                print(f"declined: {why}", flush=True)
                conn.sendall(json.dumps({"declined": why}).encode() + b"\n")
                continue
            if os.fork() == 0:
                listener.close()
                _watch(conn, req)
            print(f"served: {' '.join(req['args'][-1:])}", flush=True)


def _reap() -> None:
    """Collect the watchers that have ended (no zombies accumulate in a long batch)."""
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass


def _watch(conn: socket.socket, req: dict) -> None:
    """The watcher: fork the launcher, tell the caller its pid, wait for it, tell its exit status, leave."""
    os.setsid()  # out of the owner's process group: a Ctrl-C there reaches the caller, which kills the tree
    pid = os.fork()
    if pid == 0:
        conn.close()
        _run_launcher(req)
    with contextlib.suppress(OSError):
        conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    _, status = os.waitpid(pid, 0)
    with contextlib.suppress(OSError):
        conn.sendall(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
    os._exit(0)


def _run_launcher(req: dict) -> None:
    """Become ``python -m toolkit.runtime.launcher ARGS`` run by the caller: its streams, environment, directory."""
    code = 1
    try:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD):
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
        log = os.open(req["log"], os.O_WRONLY | os.O_APPEND)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        os.environ.clear()
        os.environ.update(req["env"])
        os.chdir(req["cwd"])
        sys.path[0] = req["cwd"]  # as `python -m` sets it
        from toolkit.runtime import launcher
        sys.argv = [launcher.__file__, *req["args"]]
        launcher.main()  # leaves by os._exit(0) when every rank has succeeded
        code = 0
    except SystemExit as stop:
        if isinstance(stop.code, int) or stop.code is None:
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - as the interpreter would: the traceback, exit status 1
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]))
