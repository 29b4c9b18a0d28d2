"""The server process of a batch: a launcher, or a notebook kernel, imported once and forked for each request.

Before torchrun's agent starts a single rank, a fresh launcher (``python -m toolkit.runtime.launcher_process``)
spends 4–5 s importing torch, torch._dynamo, accelerate and the runtime: a fifth of a short lesson's launch on 2
cores; a fresh notebook kernel spends 1.4 s importing torch before its first cell's work. A batch
(``tools/run_all.py``; the test session, for launches) starts a server per role that imports these once and forks
one for each request from a process that inherits its address (``TOOLKIT_LAUNCH_SERVER``,
``TOOLKIT_KERNEL_SERVER``)::

    launch() ─── socket: interpreter, argv, environment, cwd, log ───►  server "launcher" (imported once)
       │                                                                   └─ fork ─► watcher ─ fork ─► launcher
       ◄──────────── the launcher's pid, then its exit status ──────────────────┘        └─► agent ─► ranks

    papermill (tools/nb.py's kernel manager) ─── the same, for ipykernel_launcher ───►  server "kernel" ─► kernel

The served process is the one a fresh interpreter would have run: the caller's argv, environment, working
directory and log, in a session of its own. The caller's side (``toolkit.runtime.caller_start``: ``serving``,
``request``) watches a served launcher as a fresh one (the same timeout, ``kill_tree`` of its pid, the same
failure report); its ranks are forked from it as every CPU launch's are (``toolkit.runtime.launcher_process``),
so they compute the same bits, and it takes the caller's resource limits, umask, priority and CPUs, as a child
of the caller would. A server serves a request only from the same interpreter and options, with the same
environment (aside from what a kernel, a notebook, pytest or torch set in the caller: ``CALLER_ENV``), limits
the served process can take and the toolkit's sources unchanged since it started (``mismatch``); otherwise the
caller starts a fresh interpreter. If a caller dies first, its watcher ends the served process. A server leaves
when its owner stops it (``serving``) or is gone.

A notebook opened by hand in JupyterLab has no server: its kernel and each of its launches start afresh.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import resource
import select
import signal
import socket
import sys
import time
import traceback
from pathlib import Path

SERVER_ENV = "TOOLKIT_LAUNCH_SERVER"  # the launcher server's socket path, inherited by the processes that may use it
KERNEL_SERVER_ENV = "TOOLKIT_KERNEL_SERVER"  # the kernel server's
CALLER_POLL_S = 0.2  # how often a watcher looks whether its process or its caller has ended
PROGRAMS = {"launcher": "toolkit.runtime.launcher_process", "kernel": "ipykernel_launcher"}  # what each role forks
CALLER_ENV = ("CLICOLOR", "CLICOLOR_FORCE", "FORCE_COLOR", "GIT_PAGER", "PAGER", "MPLBACKEND", "TERM",
              "PYDEVD_USE_FRAME_EVAL",  # ipykernel's, in a notebook's kernel
              "PLOTLY_RENDERER",  # toolkit.viz's, in a notebook
              "COLUMNS", "LINES",  # the terminal's size (pytest's)
              "TORCHINDUCTOR_CACHE_DIR", "CUBLAS_WORKSPACE_CONFIG")  # torch's, once the caller imports inductor
CALLER_PREFIXES = ("JPY_", "PYTEST_")  # Jupyter's, and pytest's (PYTEST_CURRENT_TEST changes with every test)
PACKAGE = Path(__file__).resolve().parents[1]  # toolkit/
RLIMITS = sorted(name for name in dir(resource) if name.startswith("RLIMIT_"))


def import_env(env: dict) -> dict:
    """The environment the preloaded modules may have read: all of it but what a caller's own process sets once
    it runs (``CALLER_ENV``, ``CALLER_PREFIXES``) and the servers' addresses: none of the preloaded modules reads
    these when imported."""
    return {k: v for k, v in env.items() if k not in CALLER_ENV + (SERVER_ENV, KERNEL_SERVER_ENV)
            and not k.startswith(CALLER_PREFIXES)}


def sources() -> str:
    """The toolkit's sources (paths and modification times), as one digest."""
    h = hashlib.sha256()
    for path in sorted(PACKAGE.rglob("*.py")):
        h.update(f"{path}:{path.stat().st_mtime_ns}\0".encode())
    return h.hexdigest()


def interpreter() -> list[str]:
    """This process's interpreter and its options (``python -X...``): what precedes ``-m`` in its command."""
    return sys.orig_argv[:sys.orig_argv.index("-m")] if "-m" in sys.orig_argv else [sys.executable]


def process_limits() -> dict:
    """What a process passes on to its children besides its environment: its resource limits (``ulimit``),
    umask, scheduling priority (nice) and the CPUs it may run on (``taskset``)."""
    umask = os.umask(0)
    os.umask(umask)
    return {"rlimits": {name: resource.getrlimit(getattr(resource, name)) for name in RLIMITS}, "umask": umask,
            "nice": os.getpriority(os.PRIO_PROCESS, 0), "cpus": sorted(os.sched_getaffinity(0))}


def _above(limit: int, ceiling: int) -> bool:
    infinite = resource.RLIM_INFINITY
    return ceiling != infinite and (limit == infinite or limit > ceiling)


def mismatch(req: dict, role: str, own_env: dict, own_digest: str) -> str:
    """Why a request cannot be served by this server of ``role``, which imported under ``own_env`` and
    ``own_digest`` ('' if it can): another program, another interpreter, a resource limit or priority the served
    process could not take, variables that differ, or changed sources."""
    if req["program"] != PROGRAMS[role]:
        return f"this server forks {PROGRAMS[role]}"
    if req["interpreter"] != interpreter():
        return f"another interpreter or its options ({' '.join(req['interpreter'])})"
    own = process_limits()
    higher = [name for name, (_, hard) in req["limits"]["rlimits"].items() if _above(hard, own["rlimits"][name][1])]
    if higher:
        return "a resource limit above the server's: " + ", ".join(higher)
    if req["limits"]["nice"] < own["nice"]:
        return "a higher scheduling priority than the server's"
    if not set(req["limits"]["cpus"]) <= set(own["cpus"]):
        return "CPUs the server may not run on"
    env, own_env = import_env(req["env"]), import_env(own_env)
    differ = sorted(k for k in env.keys() | own_env.keys() if env.get(k) != own_env.get(k))
    if differ:
        return "the environment differs in " + ", ".join(differ)
    return "" if req["sources"] == own_digest else "the toolkit's sources changed"


# ---- serving ----------------------------------------------------------------------------------------------------
def preload_kernel() -> None:
    """What every lesson's kernel imports before its first cell's work: ipykernel, then torch (plotly stays out:
    ``toolkit.viz`` sets its renderer before plotly.io is first imported)."""
    import torch  # noqa: F401

    from ipykernel import kernelapp  # noqa: F401


def serve(path: str, owner: int, role: str) -> None:
    """Import once for ``role`` ("launcher" or "kernel"), then fork one for each request it can serve
    (``mismatch``), until ``owner`` is gone (its parent: the process that called ``caller_start.serving``)."""
    own_env, own_digest = dict(os.environ), sources()  # before the imports: one sets TORCHINDUCTOR_CACHE_DIR
    if role == "launcher":
        from toolkit.runtime import launcher_process
        launcher_process.preload()
    else:
        preload_kernel()

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
            why = mismatch(req, role, own_env, own_digest)
            if why:
                print(f"declined: {why}", flush=True)
                conn.sendall(json.dumps({"declined": why}).encode() + b"\n")
                continue
            if os.fork() == 0:
                listener.close()
                _watch(conn, req, role)
            print(f"served: {' '.join(req['args'][-1:])}", flush=True)


def _reap() -> None:
    """Collect the watchers that have ended (no zombies accumulate in a long batch)."""
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass


def _watch(conn: socket.socket, req: dict, role: str) -> None:
    """The watcher: fork the served process, tell the caller its pid, wait for it, tell its exit status, leave.

    If the caller goes first (its end of the connection closes: a killed notebook runner, a restarted kernel),
    the served process gets SIGTERM, as a fresh kernel's parent poller would end it (a launch's ranks also see
    their caller gone, ``toolkit.runtime.rank_process``)."""
    os.setsid()  # out of the owner's process group: a Ctrl-C there reaches the caller, which kills the tree
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # an interrupt sent to the group is the served process's
    pid = os.fork()
    if pid == 0:
        conn.close()
        _run(req, role)
    with contextlib.suppress(OSError):
        conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    caller_gone = False
    while not (ended := os.waitpid(pid, os.WNOHANG))[0]:
        if caller_gone:
            time.sleep(CALLER_POLL_S)
        elif select.select([conn], [], [], CALLER_POLL_S)[0] and not _peek(conn):
            caller_gone = True
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
    status = ended[1]
    with contextlib.suppress(OSError):
        conn.sendall(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
    os._exit(0)


def _peek(conn: socket.socket) -> bytes:
    """What the caller has sent and no one has read: b"" once it has closed its end (or is gone)."""
    try:
        return conn.recv(1, socket.MSG_PEEK)
    except OSError:
        return b""


def _run(req: dict, role: str) -> None:
    """Become ``python -m toolkit.runtime.launcher_process ARGS`` (or ``-m ipykernel_launcher ARGS``) as the caller
    would have started it: its streams, resource limits, umask, priority, environment, working directory and argv."""
    code = 1
    try:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD):
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
        log = os.open(req["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        limits = req["limits"]  # the caller's: a child of theirs would have inherited them (mismatch: they fit)
        for name, (soft, hard) in limits["rlimits"].items():
            resource.setrlimit(getattr(resource, name), (soft, hard))
        os.umask(limits["umask"])
        os.setpriority(os.PRIO_PROCESS, 0, limits["nice"])
        os.sched_setaffinity(0, limits["cpus"])
        os.environ.clear()
        os.environ.update(req["env"])
        os.chdir(req["cwd"])
        sys.path[0] = req["cwd"]  # as `python -m` sets it
        if role == "launcher":
            from toolkit.runtime import launcher_process
            sys.argv = [launcher_process.__file__, *req["args"]]
            launcher_process.main()  # leaves by os._exit(0) when every rank has succeeded
        else:
            from ipykernel import kernelapp
            sys.argv = [kernelapp.__file__, *req["args"]]
            kernelapp.launch_new_instance()  # returns when the kernel is shut down
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
    serve(sys.argv[1], int(sys.argv[2]), sys.argv[3])
