"""The main job: execute every lesson notebook with papermill, then write the HTML book (tools/book.py).

    python tools/run_all.py --preset default --out out        # (what `make run` does)
    python tools/run_all.py --preset full --backend nccl -p world_size=8 --only 03 16

Writes out/notebooks/NN-name.ipynb (executed), out/summary.json (status and seconds per notebook, and its
longest cells: where its time went),
out/html/NN-name.html (one offline page per lesson), out/index.html (with each notebook's time) and
out/results.html + out/results.json (the course results page: each lesson's headline measurement beside its
source's claim, collected from the executed notebooks' ``toolkit.report.headline`` outputs) and out/machine.json
(``toolkit.runtime.machine.fingerprint()``: the CPU, its bf16 and AVX-512 instructions, torch's kernels, which the
summary, the index and the results page show beside the times).
On CPU the notebooks' kernels and their launches are forked from a kernel and a launcher imported once
(``toolkit.runtime.server_process``): a fresh launcher spends 4–5 s on imports per launch, a fresh kernel 1.4 s
importing torch; the last lines say how many each server served.
Exits non-zero if any notebook failed; the others still run. A ``-p`` name one of the notebooks does not declare
stops it before any notebook runs (exit status 2), naming the notebook's parameters.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KERNEL = "python3"


def _value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def slowest_cells(executed: Path, n: int = 3) -> list[dict]:
    """The ``n`` longest code cells of an executed notebook, by papermill's per-cell duration: ``{"cell": index,
    "seconds", "code": its first line}``, longest first (empty when the notebook holds no durations)."""
    try:
        cells = json.loads(executed.read_text())["cells"]
    except (OSError, ValueError, KeyError):
        return []
    rows = []
    for i, cell in enumerate(cells):
        duration = cell.get("metadata", {}).get("papermill", {}).get("duration")
        if cell.get("cell_type") == "code" and duration is not None:
            source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
            first = next((ln.strip() for ln in source.splitlines() if ln.strip() and not ln.startswith("#")), "")
            rows.append({"cell": i, "seconds": round(duration, 2), "code": first[:80]})
    return sorted(rows, key=lambda r: -r["seconds"])[:n]


def run_notebooks(notebooks: list[Path], out: Path, params: dict, preset: str, rows: list, nb_tool) -> None:
    """Execute each notebook into ``out/notebooks``, appending its row (status, seconds, slowest cells) to ``rows``."""
    for i, nb in enumerate(notebooks, 1):
        print(f"[{i}/{len(notebooks)}] {nb.stem} (preset={preset})", flush=True)
        target = out / "notebooks" / nb.name
        start, status, error = time.monotonic(), "ok", ""
        try:
            nb_tool.execute(nb, target, params, kernel_name=KERNEL)
        except Exception as exc:  # noqa: BLE001 - report and go on with the other lessons
            status, error = "failed", str(exc).strip().splitlines()[-1][:300] if str(exc).strip() else repr(exc)
        seconds = time.monotonic() - start
        longest = slowest_cells(target)
        print(f"    {status} in {seconds:.1f} s {error}", flush=True)
        if longest:
            print("    longest cells: " + "; ".join(f"{c['seconds']:.1f} s cell {c['cell']} ({c['code'][:40]})"
                                                   for c in longest), flush=True)
        rows.append({"name": nb.stem, "status": status, "seconds": round(seconds, 2), "preset": preset,
                     "error": error, "slowest_cells": longest})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="default", choices=["smoke", "default", "full"])
    ap.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    ap.add_argument("--out", default="out")
    ap.add_argument("--only", nargs="*", help="notebook number prefixes, e.g. 00 03")
    ap.add_argument("-p", "--param", action="append", default=[], help="extra papermill parameter NAME=VALUE")
    args = ap.parse_args(argv)

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import book
    import nb as nb_tool

    from toolkit.runtime.caller_start import serving
    from toolkit.runtime.machine import describe, fingerprint

    params = {"preset": args.preset, "backend": args.backend}
    for p in args.param:
        name, eq, value = p.partition("=")
        if not (eq and name):
            ap.error(f"-p {p!r}: expected NAME=VALUE")
        params[name] = _value(value)
    notebooks = sorted((ROOT / "notebooks").glob("*.ipynb"))
    if args.only:
        notebooks = [nb for nb in notebooks if any(nb.name.startswith(o) for o in args.only)]
    unknown = []  # every notebook's parameters checked before the first one runs
    for nb in notebooks:
        try:
            nb_tool.check_parameters(nb, params)
        except ValueError as exc:
            unknown.append(str(exc))
    if unknown:
        ap.error("unknown parameter (-p NAME=VALUE must name a parameter of every notebook run):\n  "
                 + "\n  ".join(unknown))
    os.environ.setdefault("TOOLKIT_PLAIN_PROGRESS", "1")
    out = (ROOT / args.out).resolve() if not Path(args.out).is_absolute() else Path(args.out)
    (out / "notebooks").mkdir(parents=True, exist_ok=True)
    (out / "html").mkdir(parents=True, exist_ok=True)
    machine = fingerprint()
    (out / "machine.json").write_text(json.dumps(machine, indent=1))
    print(f"machine: {describe(machine)}", flush=True)
    rows = []
    with contextlib.ExitStack() as stack:
        servers, started = {}, time.monotonic()
        if args.backend != "nccl":  # a launcher and a kernel imported once, forked for each launch and notebook
            from jupyter_client.kernelspec import KernelSpecManager
            argv = KernelSpecManager().get_kernel_spec(KERNEL).argv  # the kernel's interpreter and its options
            servers = {"launcher": stack.enter_context(serving()),
                       "kernel": stack.enter_context(serving(role="kernel", interpreter=argv[:argv.index("-m")]))}
            print(f"launch and kernel servers: {'ready' if all(s.ready for s in servers.values()) else 'not started'} "
                  f"in {time.monotonic() - started:.1f} s", flush=True)
        serving_s = time.monotonic() - started
        run_notebooks(notebooks, out, params, args.preset, rows, nb_tool)
        for role, server in servers.items():
            print(f"{role} server: {server.summary()}", flush=True)
    ran, done = list(rows), {r["name"] for r in rows}  # --only: keep the other notebooks' last results
    old = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else []
    rows = sorted(rows + [r for r in old if r.get("name") not in done and (out / "notebooks" / f"{r['name']}.ipynb")
                          .exists()], key=lambda r: r["name"])
    (out / "summary.json").write_text(json.dumps(rows, indent=1))
    if (Path(__file__).resolve().parent / "api_page.py").exists():  # the API page the index links to
        import api_page
        api_page.main(["--out", str(out)])
    pages = book.build(out, rows, params, machine)
    print(f"HTML book: {len(pages)} pages; course time {sum(r['seconds'] for r in rows):.1f} s (and "
          f"{serving_s:.1f} s starting the servers) on {describe(machine)}", flush=True)
    failed = [r["name"] for r in ran if r["status"] != "ok"]
    print(f"{len(ran) - len(failed)}/{len(ran)} notebooks ok; index: {out / 'index.html'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
