"""The rank process's entry point: ``python -m toolkit.runtime.rank_process SPEC_JSON`` in a fresh interpreter, or
this file run by torchrun (``--run-path``) in a rank forked from the pre-imported launcher
(``toolkit.runtime.launcher_process``).

Reads the launch spec written by :func:`toolkit.runtime.launch.launch`, takes the caller's working
directory and ``sys.path``, loads the target (an imported function or shipped source, see
``toolkit.runtime.target``), builds the rank's :class:`~toolkit.runtime.context.Context`, runs the
function and writes ``rank{r}.json`` (the result) or ``rank{r}.error.json`` (the exception, with
``cause: "out of memory"`` when it is one) into the spec's ``out_dir`` — each written to a temporary name
and renamed, so the caller never reads half a file.

A rank never outlives its launch, even when nobody is left to kill it::

    caller (launch)  ──►  torchrun's agent  ──►  rank r
    SIGKILLed, or a                              ├─ guard thread: the caller's pid is gone ──► exit at once
    restarted kernel                             ├─ PR_SET_PDEATHSIG: the agent is gone ──► SIGKILL (the kernel)
                                                 └─ faulthandler timer, deadline + 1 s: every thread's stack
                                                    to rank{r}.stack.txt, then exit (a C thread: no GIL needed)

so a hung rank still tells where it hung, and a crash in native code (SIGSEGV, SIGBUS, SIGABRT) leaves
its Python stack in ``rank{r}.crash.txt``.
"""
from __future__ import annotations

import ctypes
import errno
import faulthandler
import json
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
import traceback
from pathlib import Path

DEADLINE_GRACE_S = 1.0  # a rank still running this long after the launch's deadline dumps its stacks and exits
CALLER_POLL_S = 0.2
CALLER_GONE_EXIT = 75  # the exit code of a rank whose caller vanished (no one is left to read its result)
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def to_jsonable(obj, where: str = "result"):
    """Tensors, NumPy values, dataclasses and tuples -> plain JSON types (NaN -> None).

    Anything else is a ``TypeError`` naming where it sits in the result (``result['curve'][2]``) and its type.
    """
    import dataclasses

    import torch
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return None if obj != obj else obj
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().tolist()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return to_jsonable(dataclasses.asdict(obj), where)
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v, f"{where}[{k!r}]") for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    if hasattr(obj, "tolist") and hasattr(obj, "dtype"):  # NumPy scalars and arrays
        return to_jsonable(obj.tolist(), where)
    text = repr(obj)
    raise TypeError(f"the function's result is not JSON-able: {where} is a {type(obj).__qualname__} "
                    f"({text[:60] + '...' if len(text) > 60 else text}). Return numbers, strings, lists and dicts "
                    "(tensors, NumPy values and dataclasses are converted)")


def cause_of(exc: BaseException) -> str | None:
    """``"out of memory"`` when ``exc`` is one, whatever its class: ``MemoryError`` from Python, ``RuntimeError``
    from torch's CPU allocator ("can't allocate memory"), ``torch.OutOfMemoryError`` on CUDA, ENOMEM."""
    text = str(exc).lower()
    if isinstance(exc, MemoryError) or getattr(exc, "errno", None) == errno.ENOMEM or "out of memory" in text or \
            "can't allocate memory" in text or "bad_alloc" in text:
        return "out of memory"
    return None


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename (readers see all or nothing)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def adopt_caller(spec: dict) -> None:
    """The caller's working directory and ``sys.path`` (its entries first), so its modules import here too."""
    cwd = spec.get("cwd")
    if cwd and os.path.isdir(cwd):
        os.chdir(cwd)
    caller = [p for p in spec.get("sys_path", []) if p]
    sys.path[:] = caller + [p for p in sys.path if p not in caller]


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this rank when its parent (torchrun's agent) dies, however it dies (Linux)."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def process_start(pid: int) -> float | None:
    """When process ``pid`` started, as an identity that a reused pid cannot share: on Linux its start in clock
    ticks since boot, read from ``/proc`` (exact, and unmoved by a wall-clock adjustment, which shifts
    ``psutil``'s ``create_time`` by the adjustment); elsewhere ``psutil``'s ``create_time``. None if it is gone
    or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()  # after "pid (comm)": state is field 3, starttime 22
        return None if fields[0] in "ZX" else float(fields[19])
    except FileNotFoundError:
        return None
    except OSError:  # no /proc: another OS
        import psutil
        try:
            proc = psutil.Process(pid)
            return None if proc.status() == psutil.STATUS_ZOMBIE else proc.create_time()
        except psutil.NoSuchProcess:
            return None


def watch_caller(caller: dict, rank: int) -> None:
    """A daemon thread that ends this rank as soon as the process that called ``launch`` is gone (killed, or a
    restarted kernel): torchrun's agent runs in its own session and survives it, so nothing else would. The
    caller is identified by its pid and its start (``process_start``), so a pid reused by another process
    counts as gone."""
    def gone() -> bool:
        return process_start(caller["pid"]) != caller["started"]

    def watch() -> None:
        while not gone():
            time.sleep(CALLER_POLL_S)
        print(f"[rank {rank}] the process that called launch (pid {caller['pid']}) is gone: exiting",
              file=sys.stderr, flush=True)
        os._exit(CALLER_GONE_EXIT)

    threading.Thread(target=watch, name="toolkit-caller-watch", daemon=True).start()


def fresh_signal_handlers() -> None:
    """A rank forked from torchrun's agent inherits the agent's Python signal handlers (its SIGTERM handler
    raises an exception in whatever the rank runs); give it a fresh interpreter's: SIGINT raises
    KeyboardInterrupt, every other signal does what the system does."""
    for sig in signal.valid_signals():
        if callable(signal.getsignal(sig)):
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)


def main(spec_path: str) -> int:
    die_with_parent()
    if multiprocessing.parent_process() is not None:
        fresh_signal_handlers()
    spec = json.loads(Path(spec_path).read_text())
    out = Path(spec["out_dir"])
    rank = int(os.environ.get("RANK", 0))
    if spec["caller"]["host"] == socket.gethostname():  # out_dir shared by machines: the caller's pid is local
        watch_caller(spec["caller"], rank)
    faulthandler.enable(open(out / f"rank{rank}.crash.txt", "w"))  # SIGSEGV, SIGBUS, SIGABRT...: the stack
    # past the deadline: every stack, then exit (absolute: a rank may start late on a busy host; no cancel, so a
    # rank that hangs while exiting ends too)
    faulthandler.dump_traceback_later(max(spec["deadline"] + DEADLINE_GRACE_S - time.time(), 0.5), exit=True,
                                      file=open(out / f"rank{rank}.stack.txt", "w"))
    try:
        adopt_caller(spec)
        from toolkit.runtime.context import init_context
        from toolkit.runtime.target import load
        fn = load(spec["target"])
        ctx = init_context(spec["backend"], timeout_s=spec["collective_timeout_s"], seed=spec["seed"],
                           out_dir=out, threads=spec["threads"], phases=spec.get("phases"),
                           cluster=spec.get("cluster"))
        result = fn(ctx, spec["cfg"])
        ctx.finish()  # the bar's last report, before the result the caller waits for
        write_atomic(out / f"rank{rank}.json", json.dumps(to_jsonable(result if result is not None else {})))
        import gc

        import torch.distributed as dist
        if dist.is_initialized():
            gc.collect()  # DDP with a Python comm hook must be collected before its process group goes away
            dist.destroy_process_group()
        return 0
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the notebook
        err = {"rank": rank, "time": time.time(), "type": type(exc).__name__, "message": str(exc),
               "cause": cause_of(exc), "traceback": traceback.format_exc()}
        write_atomic(out / f"rank{rank}.error.json", json.dumps(err))
        print(err["traceback"], file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    code = main(sys.argv[1])
    sys.stdout.flush()
    sys.stderr.flush()
    if multiprocessing.parent_process() is not None:
        # forked by torchrun's agent (launch's pre-imported start): the agent waits for this function's return,
        # and multiprocessing then leaves with os._exit itself
        sys.exit(code)
    # The result is on disk and the process group is gone: skip the interpreter's teardown, where a native
    # thread still joinable at static destruction can abort the rank ("terminate called without an active
    # exception", SIGABRT) after it has finished its work, which would fail a launch that succeeded.
    os._exit(code)
