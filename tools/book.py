"""The HTML book: one page per executed lesson notebook and an index, readable offline.

    python tools/book.py [OUT]     # rebuild OUT/index.html and OUT/html/*.html (OUT defaults to out) from
                                   # OUT/notebooks/*.ipynb and OUT/summary.json, without re-running anything
                                   # (tools/run_all.py, i.e. `make run`, calls build() after executing)

::

    out/index.html                 the lessons, their status and run time, the course's total time
    out/html/NN-name.html          one page per lesson: JupyterLab's look, previous / index / next links
    out/html/static/               one shared copy of every script the pages load:
        plotly.min.js              from the installed plotly package
        mathjax/                   MathJax 3 (SVG output: no web fonts, which file:// pages could not
                                   load) from the django-static-mathjax package, a plain copy of MathJax
        book.css

Nothing is fetched from a network when a page opens (a cluster node, a plane): no CDN, no require.js.
- A plotly figure (plotly's mimetype, what ``toolkit.viz`` emits) becomes a ``<div>`` that the shared
  plotly.min.js draws, with its own sliders and dropdowns where it has them (``toolkit.viz.explore``).
- An ipywidgets view needs a kernel: it becomes a note; the precomputed explorer next to it works here.
- A page's title is the lesson's first heading.
"""
from __future__ import annotations

import argparse
import html
import json
import re
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEMPLATES = Path(__file__).resolve().parent / "book_template"
PLOTLY = "application/vnd.plotly.v1+json"
WIDGET = "application/vnd.jupyter.widget-view+json"
WIDGET_NOTE = ('<div class="book-widget-note">Live explorer (ipywidgets): it needs a running kernel, so open this '
               'notebook in JupyterLab (<code>make lab</code>). The precomputed explorer below works here.</div>')
MATHJAX_PARTS = ["tex-svg.js", "input/tex/extensions", "a11y", "ui"]   # of MathJax's es5/ folder
CSS = """
.book-nav { display: flex; justify-content: space-between; align-items: center; gap: 1em; max-width: 1200px;
  margin: 0.6em auto; padding: 0.5em 1em; border: 1px solid #ddd; border-radius: 4px; background: #fafafa;
  font-family: Inter, Helvetica, Arial, sans-serif; font-size: 14px; }
.book-nav a { color: #3366cc; text-decoration: none; } .book-nav a:hover { text-decoration: underline; }
.book-widget-note { padding: 0.5em 0.8em; border-left: 3px solid #ff9900; background: #fff8ec; font-size: 13px; }
"""


def lesson_title(nb, fallback: str) -> str:
    """The first markdown heading, without its markup (``# 00 · Foundations: ...`` -> ``00 · Foundations: ...``)."""
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("#"):
                    text = re.sub(r"[*_`]", "", line.lstrip("#").strip())
                    return re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return fallback


def plotly_div(figure: dict) -> str:
    """A figure as a div drawn by the page's (shared) plotly.js; its own controls keep working."""
    import plotly.io as pio
    height = figure.get("layout", {}).get("height") or 450
    return pio.to_html(figure, include_plotlyjs=False, full_html=False, validate=False, default_height=f"{height}px",
                       config={"displaylogo": False, "responsive": True})


def offline_notebook(nb) -> tuple[object, int]:
    """Rewrite outputs so the page needs no kernel and no CDN; returns (notebook, plotly figures drawn)."""
    figures = 0
    nb.metadata.pop("widgets", None)  # no widget state: nbconvert would load the widget renderer from a CDN
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if PLOTLY in data:
                out["data"] = {"text/html": plotly_div(data[PLOTLY])}
                figures += 1
            elif WIDGET in data:
                out["data"] = {"text/html": WIDGET_NOTE}
    return nb, figures


def copy_assets(static: Path) -> None:
    """plotly.js and MathJax into ``static`` (once per book; skipped when already there)."""
    import plotly
    static.mkdir(parents=True, exist_ok=True)
    plotly_js = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    if not (static / "plotly.min.js").exists() or (static / "plotly.min.js").stat().st_size != plotly_js.stat().st_size:
        shutil.copyfile(plotly_js, static / "plotly.min.js")
    mathjax = mathjax_dir()
    for part in MATHJAX_PARTS:
        src, dst = mathjax / part, static / "mathjax" / part
        if dst.exists():
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(src, dst) if src.is_dir() else shutil.copyfile(src, dst)
    (static / "book.css").write_text(CSS)


def mathjax_dir() -> Path:
    try:
        import mathjax  # the django-static-mathjax package: MathJax's own files, no Django needed
    except ImportError as err:  # a dependency of the project (pyproject.toml); say how to get it
        raise RuntimeError("the HTML book needs MathJax from the django-static-mathjax package: "
                           "pip install django-static-mathjax (make env installs it)") from err
    return Path(mathjax.__file__).parent / "static" / "mathjax" / "es5"


def build(out: Path, rows: list[dict] | None = None, params: dict | None = None,
          machine: dict | None = None) -> list[dict]:
    """Write ``out/html/*.html`` from ``out/notebooks/*.ipynb`` and ``out/index.html``; returns one dict per page
    (name, title, href, figures). ``rows`` are run_all's per-notebook results (status, seconds, error);
    ``machine`` the fingerprint of the machine they ran on (default: ``out/machine.json``, run_all's)."""
    import nbformat
    from nbconvert import HTMLExporter

    rows = rows if rows is not None else _summary(out)
    machine = machine if machine is not None else _machine(out)
    notebooks = sorted((out / "notebooks").glob("*.ipynb"))
    html_dir = out / "html"
    copy_assets(html_dir / "static")
    books, pages = [nbformat.read(p, as_version=4) for p in notebooks], []
    for path, nb in zip(notebooks, books):
        pages.append({"name": path.stem, "title": lesson_title(nb, path.stem), "href": f"{path.stem}.html"})
    exporter = HTMLExporter(template_name="book", extra_template_basedirs=[str(TEMPLATES)])
    for i, (page, nb) in enumerate(zip(pages, books)):
        nb, page["figures"] = offline_notebook(nb)
        nb.metadata["title"] = page["title"]
        book = {"static": "static", "index": "../index.html", "prev": pages[i - 1] if i else None,
                "next": pages[i + 1] if i + 1 < len(pages) else None}
        body, _ = exporter.from_notebook_node(nb, resources={"book": book, "metadata": {"name": page["name"]}})
        (html_dir / page["href"]).write_text(body)
    write_results(out, notebooks, rows, params or {}, machine)
    (out / "index.html").write_text(index_page(pages, rows, params or {}, api=(html_dir / "api.html").exists(),
                                               results=True, machine=machine))
    return pages


def write_results(out: Path, notebooks: list[Path], rows: list[dict], params: dict, machine: dict | None) -> None:
    """``out/results.json`` and ``out/results.html``: each lesson's headline, collected from its executed notebook
    (``toolkit.report.headline`` outputs), with the notebook's run status."""
    from toolkit import report

    status = {r["name"]: r.get("status") for r in rows}
    lessons = [{"name": p.stem, "status": status.get(p.stem, "not run"), "headline": report.collect(p)}
               for p in notebooks if p.stem[:1].isdigit()]  # lessons only (not the your-experiment template)
    report.write_results(lessons, out, params, machine)


def _summary(out: Path) -> list[dict]:
    path = out / "summary.json"
    return json.loads(path.read_text()) if path.exists() else []


def _machine(out: Path) -> dict | None:
    path = out / "machine.json"
    return json.loads(path.read_text()) if path.exists() else None


def _seconds(s: float) -> str:
    return f"{s:.1f} s" if s < 120 else f"{int(s // 60)} min {s % 60:04.1f} s"


def index_page(pages: list[dict], rows: list[dict], params: dict, api: bool = False, results: bool = False,
               machine: dict | None = None) -> str:
    """The book's front page: each lesson with its status and time, the total, the machine they were measured
    on, links to pages and notebooks."""
    from toolkit.runtime.machine import describe

    by_name = {r["name"]: r for r in rows}
    names = [p["name"] for p in pages] + [r["name"] for r in rows if r["name"] not in {p["name"] for p in pages}]
    titles = {p["name"]: p["title"] for p in pages}
    trs = []
    for name in names:
        r = by_name.get(name, {})
        status, seconds = r.get("status", "not run"), r.get("seconds")
        link = (f"<a href='html/{name}.html'>{html.escape(titles[name])}</a>" if name in titles
                else html.escape(name))
        trs.append(f"<tr><td>{link}</td><td class='{html.escape(status.replace(' ', '-'))}'>{html.escape(status)}</td>"
                   f"<td class='num'>{_seconds(seconds) if seconds is not None else ''}</td>"
                   f"<td>{html.escape(str(r.get('preset', '')))}</td>"
                   f"<td><a href='notebooks/{name}.ipynb'>ipynb</a></td>"
                   f"<td>{html.escape(r.get('error', ''))}</td></tr>")
    total = sum(r.get("seconds", 0.0) for r in rows)
    timed = f"<p>Course run time: <b>{_seconds(total)}</b> for {len(rows)} notebooks" if rows else "<p>"
    timed += f" (parameters {html.escape(json.dumps(params))})</p>" if params else "</p>"
    timed += f"<p>Machine: {html.escape(describe(machine))}</p>" if machine else ""
    api_link = "<p><a href='html/api.html'>API reference</a> — the toolkit's public functions.</p>" if api else ""
    if results:
        api_link += ("<p><a href='results.html'>Course results</a> — each lesson's headline measurement beside its "
                     "source's claim, and whether this run reproduces it.</p>")
    return f"""<!doctype html><html lang="en"><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1.0"><title>llm-scale-toolkit: the lessons</title>
<style>body{{font-family:Inter,Helvetica,Arial,sans-serif;margin:2em auto;max-width:1100px;color:#222;padding:0 1em}}
table{{border-collapse:collapse}}td,th{{padding:.35em .9em;border-bottom:1px solid #ddd;text-align:left}}
td.num{{text-align:right;white-space:nowrap}}.ok{{color:#109618}}.failed{{color:#dc3912}}a{{color:#3366cc}}</style>
<h1>llm-scale-toolkit: the lessons</h1>
<p>Each page is a lesson notebook as it ran: its figures, explorers and checks. Every page works offline.</p>
{timed}{api_link}
<table><tr><th>lesson</th><th>status</th><th>time</th><th>preset</th><th>notebook</th><th>error</th></tr>
{chr(10).join(trs)}
</table></html>
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?", default="out", help="the folder run_all.py wrote (default: out)")
    args = ap.parse_args(argv)
    out = Path(args.out) if Path(args.out).is_absolute() else ROOT / args.out
    if not (out / "notebooks").is_dir():
        print(f"{out / 'notebooks'}: no executed notebooks (run: make run)", file=sys.stderr)
        return 2
    pages = build(out)
    print(f"{len(pages)} pages, {sum(p['figures'] for p in pages)} figures; index: {out / 'index.html'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
