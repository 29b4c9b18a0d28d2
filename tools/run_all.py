"""The main job: execute every lesson notebook with papermill, export HTML, write an index page.

    python tools/run_all.py --preset default --out out        # (what `make run` does)
    python tools/run_all.py --preset full --backend nccl -p world_size=8 --only 03 16

Writes out/notebooks/NN-name.ipynb (executed), out/html/NN-name.html and out/index.html.
Exits non-zero if any notebook failed; the others still run.
"""
from __future__ import annotations

import argparse
import html
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="default", choices=["smoke", "default", "full"])
    ap.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    ap.add_argument("--out", default="out")
    ap.add_argument("--only", nargs="*", help="notebook number prefixes, e.g. 00 03")
    ap.add_argument("-p", "--param", action="append", default=[], help="extra papermill parameter NAME=VALUE")
    args = ap.parse_args(argv)

    import nbformat
    import papermill as pm
    from nbconvert import HTMLExporter

    os.environ.setdefault("TOOLKIT_PLAIN_PROGRESS", "1")
    out = (ROOT / args.out).resolve() if not Path(args.out).is_absolute() else Path(args.out)
    (out / "notebooks").mkdir(parents=True, exist_ok=True)
    (out / "html").mkdir(parents=True, exist_ok=True)
    params = {"preset": args.preset, "backend": args.backend}
    params.update({k: _value(v) for k, _, v in (p.partition("=") for p in args.param)})
    notebooks = sorted((ROOT / "notebooks").glob("*.ipynb"))
    if args.only:
        notebooks = [nb for nb in notebooks if any(nb.name.startswith(o) for o in args.only)]
    rows, exporter = [], HTMLExporter(template_name="lab")
    for i, nb in enumerate(notebooks, 1):
        print(f"[{i}/{len(notebooks)}] {nb.stem} (preset={args.preset})", flush=True)
        target = out / "notebooks" / nb.name
        start, status, error = time.monotonic(), "ok", ""
        try:
            pm.execute_notebook(str(nb), str(target), parameters=params, cwd=str(nb.parent), progress_bar=False,
                                kernel_name="python3")
        except Exception as exc:  # noqa: BLE001 - report and go on with the other lessons
            status, error = "failed", str(exc).strip().splitlines()[-1][:300] if str(exc).strip() else repr(exc)
        seconds = time.monotonic() - start
        if target.exists():
            body, _ = exporter.from_notebook_node(nbformat.read(target, as_version=4))
            (out / "html" / f"{nb.stem}.html").write_text(body)
        print(f"    {status} in {seconds:.1f} s {error}", flush=True)
        rows.append({"name": nb.stem, "status": status, "seconds": seconds, "error": error})
    (out / "index.html").write_text(_index(rows, params))
    (out / "summary.json").write_text(json.dumps(rows, indent=1))
    failed = [r["name"] for r in rows if r["status"] != "ok"]
    print(f"{len(rows) - len(failed)}/{len(rows)} notebooks ok; index: {out / 'index.html'}")
    return 1 if failed else 0


def _index(rows: list[dict], params: dict) -> str:
    trs = "\n".join(
        f"<tr><td><a href='html/{r['name']}.html'>{html.escape(r['name'])}</a></td>"
        f"<td class='{r['status']}'>{r['status']}</td><td>{r['seconds']:.1f} s</td>"
        f"<td><a href='notebooks/{r['name']}.ipynb'>ipynb</a></td><td>{html.escape(r['error'])}</td></tr>"
        for r in rows)
    return f"""<!doctype html><meta charset="utf-8"><title>llm-scale-toolkit lessons</title>
<style>body{{font-family:Inter,Helvetica,Arial,sans-serif;margin:2em;color:#222}}table{{border-collapse:collapse}}
td,th{{padding:.35em .9em;border-bottom:1px solid #ddd;text-align:left}}.ok{{color:#109618}}.failed{{color:#dc3912}}</style>
<h1>llm-scale-toolkit: executed lessons</h1><p>parameters: {html.escape(json.dumps(params))}</p>
<table><tr><th>lesson</th><th>status</th><th>time</th><th>notebook</th><th>error</th></tr>
{trs}</table>"""


if __name__ == "__main__":
    sys.exit(main())
