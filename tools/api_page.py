"""Write the API page of the HTML book from the public API table and the docstrings: out/html/api.html.

    python tools/api_page.py [--out out]

One self-contained page (inline CSS, no script, nothing fetched): for every name ``toolkit`` exports
(``toolkit/api.py``), grouped by area, its signature, what it is, the shapes, what runs on every rank, a
three-line example, the module it lives in and its full docstring. The book's index links it.
"""
from __future__ import annotations

import argparse
import html
import inspect
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CSS = """
body { font: 15px/1.5 -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; color: #222; max-width: 980px;
       margin: 2em auto; padding: 0 1em; }
h1 { font-size: 1.7em; } h2 { margin-top: 2em; border-bottom: 1px solid #ddd; padding-bottom: .2em; }
h3 { margin: 1.6em 0 .3em; font-family: ui-monospace, Menlo, Consolas, monospace; font-size: 1.05em; }
code, pre { font-family: ui-monospace, Menlo, Consolas, monospace; font-size: 13px; }
pre { background: #f6f8fa; padding: .7em 1em; overflow-x: auto; border-radius: 4px; }
pre.doc { background: #fff; border-left: 3px solid #ddd; border-radius: 0; }
.sig { color: #555; } .where { color: #888; font-size: 13px; }
dl { display: grid; grid-template-columns: 8em 1fr; gap: .2em 1em; margin: .4em 0; } dt { color: #666; }
nav a { margin-right: 1em; } nav { line-height: 2; }
"""


def render() -> str:
    from toolkit import api
    parts = [f"<!doctype html><html lang='en'><head><meta charset='utf-8'><title>llm-scale-toolkit API</title>"
             f"<style>{CSS}</style></head><body>",
             "<p><a href='../index.html'>&larr; lessons</a></p><h1>llm-scale-toolkit: the public API</h1>",
             f"<pre class='doc'>{html.escape(inspect.getdoc(api) or '')}</pre>", "<nav>"]
    parts += [f"<a href='#{_anchor(e.name)}'>{html.escape(e.name)}</a>" for e in api.ENTRIES]
    parts.append("</nav>")
    for area in api.AREAS:
        parts.append(f"<h2 id='{_anchor(area)}'>{html.escape(area)}</h2>")
        for e in (e for e in api.ENTRIES if e.area == area):
            obj = e.load()
            parts.append(
                f"<h3 id='{_anchor(e.name)}'>{html.escape(e.name)}</h3>"
                f"<div class='sig'><code>{html.escape(api.signature(obj))}</code></div>"
                f"<div class='where'>{html.escape(e.where.replace(':', '.'))}</div>"
                f"<p>{html.escape(e.what)}</p><dl><dt>shapes</dt><dd>{html.escape(e.shapes)}</dd>"
                f"<dt>every rank</dt><dd>{html.escape(e.ranks)}</dd></dl>"
                f"<pre>{html.escape(e.example)}</pre>"
                f"<pre class='doc'>{html.escape(inspect.getdoc(obj) or '')}</pre>")
    parts.append("</body></html>")
    return "\n".join(parts)


def _anchor(text: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in text.lower())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="out", help="the book's folder (the page goes to OUT/html/api.html)")
    args = ap.parse_args(argv)
    out = Path(args.out) if Path(args.out).is_absolute() else ROOT / args.out
    (out / "html").mkdir(parents=True, exist_ok=True)
    path = out / "html" / "api.html"
    path.write_text(render())
    print(f"API page: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
