"""Entry point of every rank: ``python -m toolkit.runtime.worker SPEC_JSON``.

Reads the launch spec written by :func:`toolkit.runtime.launch.launch`, takes the caller's working
directory and ``sys.path``, loads the target (an imported function or shipped source, see
``toolkit.runtime.target``), builds the rank's :class:`~toolkit.runtime.context.Context`, runs the
function and writes ``rank{r}.json`` (the result) or ``rank{r}.error.json`` (the traceback) into the
spec's ``out_dir`` — each written to a temporary name and renamed, so the launcher never reads half a
file. A watchdog dumps every thread's stack to ``rank{r}.stack.txt`` shortly before the launcher's
deadline, so a hung rank still tells where it hung.
"""
from __future__ import annotations

import faulthandler
import json
import os
import sys
import time
import traceback
from pathlib import Path


def to_jsonable(obj):
    """Tensors, NumPy values, dataclasses and tuples -> plain JSON types."""
    import dataclasses

    import torch
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().tolist()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return to_jsonable(dataclasses.asdict(obj))
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if hasattr(obj, "tolist"):  # numpy scalars/arrays
        return obj.tolist()
    if isinstance(obj, float) and obj != obj:
        return None
    return obj


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


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    out = Path(spec["out_dir"])
    rank = int(os.environ.get("RANK", 0))
    stack_file = open(out / f"rank{rank}.stack.txt", "w")
    # dump every thread's stack 2 s before the launcher's deadline (absolute: a rank may start late on a busy host)
    faulthandler.dump_traceback_later(max(spec["deadline"] - time.time() - 2.0, 0.5), exit=False, file=stack_file)
    try:
        adopt_caller(spec)
        from toolkit.runtime.context import init_context
        from toolkit.runtime.target import load
        fn = load(spec["target"])
        ctx = init_context(spec["backend"], timeout_s=spec["collective_timeout_s"], seed=spec["seed"],
                           out_dir=out, threads=spec["threads"], phases=spec.get("phases"),
                           cluster=spec.get("cluster"))
        result = fn(ctx, spec["cfg"])
        write_atomic(out / f"rank{rank}.json", json.dumps(to_jsonable(result if result is not None else {})))
        import gc

        import torch.distributed as dist
        if dist.is_initialized():
            gc.collect()  # DDP with a Python comm hook must be collected before its process group goes away
            dist.destroy_process_group()
        return 0
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the notebook
        err = {"rank": rank, "time": time.time(), "type": type(exc).__name__, "message": str(exc),
               "traceback": traceback.format_exc()}
        write_atomic(out / f"rank{rank}.error.json", json.dumps(err))
        print(err["traceback"], file=sys.stderr, flush=True)
        return 1
    finally:
        faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
