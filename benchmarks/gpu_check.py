"""Every GPU path the CPU machines cannot run, checked on one GPU, with one summary table.

    bash benchmarks/gpu_check.sh            (this file, under a time limit: 8 minutes by default)
    python benchmarks/gpu_check.py [--only kernels offload ...] [--dir benchmarks/gpu]

Each module ``benchmarks/gpu/<name>.py`` exposes ``check() -> list[dict]``: rows ``{"check": str, "ok": bool,
"value": str}`` (it may assume CUDA is available; it imports what it needs inside ``check``). Engineers add a
module there for each GPU-only path they write. This driver imports every module in turn, runs its check
(an exception becomes a failed row naming it, so one broken module does not hide the others), prints one
table and exits 1 if any row is not ok. Without a GPU it says so and exits 0: the CPU test suite covers
everything else.

Modules here now: ``kernels`` (compiled Triton kernels bit-equal to the torch references; GB/s against a
device-to-device copy and the theoretical peak), ``memory_tracker`` (CUDA memory statistics beside the exact
count), ``offload`` (the CUDA side-stream path of activation offload), ``lesson_full`` (a lesson at preset
``full`` on one GPU).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # lets checks switch on deterministic algorithms
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CHECK_DIR = ROOT / "benchmarks" / "gpu"

from toolkit.runtime import machine  # noqa: E402


def discover(directory: Path = CHECK_DIR) -> list[Path]:
    """The check modules of ``directory`` (every ``*.py`` not starting with an underscore), sorted."""
    return sorted(p for p in Path(directory).glob("*.py") if not p.name.startswith("_"))


def load(path: Path):
    spec = importlib.util.spec_from_file_location(f"gpu_check_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_module(path: Path) -> list[dict]:
    """Rows of one module's ``check()``, each with ``module`` and the module's ``seconds``; failures as rows."""
    start = time.monotonic()
    try:
        check = getattr(load(path), "check", None)
        if not callable(check):
            raise TypeError(f"{path.name} has no check() function")
        rows = check()
        if not isinstance(rows, list) or not rows:
            raise TypeError(f"check() must return a non-empty list of rows, got {rows!r:.100}")
        out = []
        for row in rows:
            ok = (isinstance(row, dict) and isinstance(row.get("check"), str) and isinstance(row.get("ok"), bool)
                  and isinstance(row.get("value"), str))
            out.append(dict(row) if ok else {"check": f"{path.stem}: malformed row", "ok": False,
                                             "value": f"{row!r:.120} (need check: str, ok: bool, value: str)"})
    except Exception as exc:  # noqa: BLE001 - one module's failure is a row, the others still run
        last = traceback.extract_tb(exc.__traceback__)[-1]
        out = [{"check": f"{path.stem}: check() raised", "ok": False,
                "value": f"{type(exc).__name__}: {exc} ({Path(last.filename).name}:{last.lineno})"}]
    seconds = time.monotonic() - start
    return [{**row, "module": path.stem, "seconds": seconds} for row in out]


def table(rows: list[dict]) -> str:
    """The summary: one line per row, module, check, ok, value."""
    head = ("module", "check", "ok", "value")
    cells = [[r["module"], r["check"], "ok" if r["ok"] else "FAIL", r["value"]] for r in rows]
    widths = [max(len(head[i]), *(len(c[i]) for c in cells)) if cells else len(head[i]) for i in range(3)]
    line = lambda c: "  ".join(x.ljust(w) for x, w in zip(c[:3], widths)) + "  " + c[3]
    return "\n".join([line(list(head)), line(["-" * w for w in widths] + ["-" * 5])] + [line(c) for c in cells])


def report(rows: list[dict], seconds: float) -> int:
    """Print the table and a verdict; the exit code: 1 if any row failed."""
    failed = [r for r in rows if not r["ok"]]
    modules = sorted({r["module"] for r in rows})
    print(table(rows))
    print(f"\n{len(rows)} checks from {len(modules)} modules in {seconds:.0f} s: "
          + ("all ok" if not failed else f"{len(failed)} FAILED: " + "; ".join(r["check"] for r in failed)))
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=CHECK_DIR, help="folder of check modules")
    parser.add_argument("--only", nargs="*", default=None, help="module names to run (default: all)")
    args = parser.parse_args(argv)
    print(f"machine: {machine.describe()}", flush=True)  # what the times below mean
    paths = discover(args.dir)
    if args.only:
        unknown = sorted(set(args.only) - {p.stem for p in paths})
        if unknown:
            print(f"gpu_check: no module {unknown} in {args.dir}; there are {[p.stem for p in paths]}")
            return 2
        paths = [p for p in paths if p.stem in args.only]
    import torch
    if not torch.cuda.is_available():
        print(f"gpu_check: no CUDA GPU visible (torch {torch.__version__}, torch.cuda.is_available() is False): "
              f"nothing to check on this machine. {len(paths)} check modules wait for a GPU: "
              + ", ".join(p.stem for p in paths))
        return 0
    props = torch.cuda.get_device_properties(0)
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    print(f"gpu_check: {props.name}, {props.total_memory / 2**30:.0f} GiB, torch {torch.__version__}, "
          f"CUDA {torch.version.cuda}, triton {triton_version}; modules: {', '.join(p.stem for p in paths)}",
          flush=True)
    start, rows = time.monotonic(), []
    for path in paths:
        got = run_module(path)
        bad = sum(not r["ok"] for r in got)
        print(f"  {path.stem}: {len(got)} checks, {bad} failed, {got[0]['seconds']:.1f} s", flush=True)
        rows += got
    print()
    return report(rows, time.monotonic() - start)


if __name__ == "__main__":
    sys.exit(main())
