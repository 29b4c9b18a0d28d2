"""Entry point of every rank: ``python -m toolkit.runtime.worker SPEC_JSON``.

Reads the launch spec written by :func:`toolkit.runtime.launch.launch`, builds the
rank's :class:`~toolkit.runtime.context.Context`, runs the lesson and writes
``rank{r}.json`` (the result) or ``rank{r}.error.json`` (the traceback) into the
spec's ``out_dir``. A watchdog dumps every thread's stack to ``rank{r}.stack.txt``
shortly before the launcher's deadline, so a hung rank still tells where it hung.
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


def resolve_lesson(ref: str):
    """``"pkg.mod"`` -> ``pkg.mod.run``; ``"pkg.mod:fn"`` -> ``pkg.mod.fn``; short names look in toolkit.lessons."""
    import importlib
    module_name, _, fn_name = ref.partition(":")
    if "." not in module_name:
        module_name = f"toolkit.lessons.{module_name}"
    module = importlib.import_module(module_name)
    fn = getattr(module, fn_name or "run", None)
    if fn is None:
        raise ValueError(f"lesson {ref!r}: module {module_name} has no function {fn_name or 'run'!r}")
    return module, fn


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    out = Path(spec["out_dir"])
    rank = int(os.environ.get("RANK", 0))
    stack_file = open(out / f"rank{rank}.stack.txt", "w")
    # dump every thread's stack 2 s before the launcher's deadline (absolute: a rank may start late on a busy host)
    faulthandler.dump_traceback_later(max(spec["deadline"] - time.time() - 2.0, 0.5), exit=False, file=stack_file)
    try:
        from toolkit.runtime.context import init_context
        _, fn = resolve_lesson(spec["lesson"])
        ctx = init_context(spec["backend"], timeout_s=spec["collective_timeout_s"], seed=spec["seed"],
                           out_dir=out, threads=spec["threads"])
        result = fn(ctx, spec["cfg"])
        payload = json.dumps(to_jsonable(result if result is not None else {}))
        (out / f"rank{rank}.json.tmp").write_text(payload)
        (out / f"rank{rank}.json.tmp").replace(out / f"rank{rank}.json")
        import gc

        import torch.distributed as dist
        if dist.is_initialized():
            gc.collect()  # DDP with a Python comm hook must be collected before its process group goes away
            dist.destroy_process_group()
        return 0
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the notebook
        err = {"rank": rank, "time": time.time(), "type": type(exc).__name__, "message": str(exc),
               "traceback": traceback.format_exc()}
        (out / f"rank{rank}.error.json").write_text(json.dumps(err))
        print(err["traceback"], file=sys.stderr, flush=True)
        return 1
    finally:
        faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
