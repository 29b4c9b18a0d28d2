"""The HTML book (tools/book.py) without a browser: every script is local, figures become plotly divs, widget
views become a note, titles and navigation, the index shows each notebook's time and the course's total.
(tests/test_browser.py opens the pages in Chromium.)"""
from __future__ import annotations

import html
import json
import re
import sys
from pathlib import Path

import nbformat
import plotly.io as pio
import pytest

from toolkit import viz
from toolkit.runtime.machine import describe, fingerprint

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import book  # noqa: E402

PLOTLY, WIDGET = book.PLOTLY, book.WIDGET


def _figure_output(fig) -> nbformat.NotebookNode:
    return nbformat.v4.new_output("display_data", data={PLOTLY: json.loads(pio.to_json(fig)),
                                                        "text/plain": "<Figure>"})


def _lesson(number: str, title: str, figures: int) -> nbformat.NotebookNode:
    explorer = viz.explore(lambda n: viz.lines({"y": [n, n + 1]}, title=f"n={n}"), {"n": [1, 2, 3]})
    code = nbformat.v4.new_code_cell("explore(...)", execution_count=1)
    code.outputs = [nbformat.v4.new_output("display_data", data={WIDGET: {"model_id": "abc", "version_major": 2,
                                                                          "version_minor": 0},
                                                                 "text/plain": "VBox(...)"})]
    code.outputs += [_figure_output(viz.bars([{"x": "a", "y": i}], "x", "y")) for i in range(figures - 1)]
    code.outputs.append(_figure_output(explorer.figure))
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell(f"# {number} · {title}\n\nMath: $a^2$."), code])
    nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": {}}}
    return nb


@pytest.fixture
def out(tmp_path) -> Path:
    (tmp_path / "notebooks").mkdir()
    for number, title, figures in [("00", "First *lesson*", 2), ("03", "Second: `code`", 1)]:
        nbformat.write(_lesson(number, title, figures), tmp_path / "notebooks" / f"{number}-x.ipynb")
    return tmp_path


def test_pages_load_only_local_scripts_and_draw_every_figure(out):
    rows = [{"name": "00-x", "status": "ok", "seconds": 12.5, "error": ""},
            {"name": "03-x", "status": "failed", "seconds": 130.25, "error": "boom"}]
    pages = book.build(out, rows, {"preset": "smoke"})
    assert [(p["name"], p["title"], p["figures"]) for p in pages] == [
        ("00-x", "00 · First lesson", 2), ("03-x", "03 · Second: code", 1)]
    for p in pages:
        text = (out / "html" / p["href"]).read_text()
        assert f"<title>{p['title']}</title>" in text
        sources = re.findall(r"<(?:script|link)[^>]+(?:src|href)=\"([^\"]+)\"", text)
        assert sources, "no script at all"
        for src in sources:
            assert "://" not in src and not src.startswith("//"), f"{p['name']} loads {src}"
            assert (out / "html" / src.split("?")[0]).exists(), f"{src} is not in the book"
        assert "require.js" not in text and "unpkg" not in text and "cdn" not in text.lower()
        assert text.count("Plotly.newPlot(") == p["figures"]
        assert "needs a running kernel" in text          # the widget view became a note
        assert "application/vnd.jupyter.widget-state" not in text
    first, second = [(out / "html" / p["href"]).read_text() for p in pages]
    assert 'href="03-x.html" rel="next"' in first and 'rel="prev"' not in first
    assert 'href="00-x.html" rel="prev"' in second and 'href="../index.html"' in second
    index = (out / "index.html").read_text()
    assert "12.5 s" in index and "2 min 10.2 s" in index          # each notebook's time
    assert "Course run time: <b>2 min 22.8 s</b> for 2 notebooks" in index
    assert "href='html/00-x.html'>00 · First lesson</a>" in index and "boom" in index
    assert "api.html" not in index


def test_one_copy_of_plotly_and_mathjax_per_book(out):
    book.build(out, [])
    static = out / "html" / "static"
    assert (static / "plotly.min.js").stat().st_size > 1_000_000
    assert (static / "mathjax" / "tex-svg.js").exists()
    pages = sum(f.stat().st_size for f in (out / "html").glob("*.html"))
    assert pages < 1_000_000, "pages carry plotly.js or MathJax themselves"


def test_index_links_the_api_page_when_there_is_one(out):
    (out / "html").mkdir()
    (out / "html" / "api.html").write_text("<title>API</title>")
    book.build(out, [])
    assert "<a href='html/api.html'>" in (out / "index.html").read_text()


def test_cli_says_what_is_missing(tmp_path, capsys):
    assert book.main([str(tmp_path)]) == 2
    assert "no executed notebooks" in capsys.readouterr().err


def test_results_page_collects_each_lessons_headline(out):
    from toolkit import report
    rec = report.record("03", "DualPipeV", "bubble 0.21 vs 0.38", value=0.55, unit="ratio", claim="fewer bubbles",
                        source="DeepSeek-V3", reproduced=True)
    path = out / "notebooks" / "03-x.ipynb"
    nb = nbformat.read(path, as_version=4)
    nb.cells[-1].outputs.append(nbformat.v4.new_output("display_data", data={report.MIME: rec,
                                                                             "text/markdown": "**Headline**"}))
    nbformat.write(nb, path)
    machine = fingerprint()
    (out / "machine.json").write_text(json.dumps(machine))  # what run_all leaves beside the notebooks
    book.build(out, [{"name": "00-x", "status": "failed", "seconds": 1.0}, {"name": "03-x", "status": "ok",
                                                                             "seconds": 2.0}])
    written = json.loads((out / "results.json").read_text())
    lessons = {r["name"]: r for r in written["lessons"]}
    assert lessons["03-x"]["headline"] == rec and lessons["00-x"]["headline"] is None
    assert written["machine"] == machine
    page = (out / "results.html").read_text()
    assert "bubble 0.21 vs 0.38" in page and "notebook failed" in page
    glossary = page[page.index('<h2 id="glossary">'):]  # the headlines' terms, each defined (issue 41)
    for term in ("edgc", "ZeRO-k · b", "launch-bound", "matched", "S→T state", "virtual time", "within noise"):
        assert html.escape(term) in glossary, term
    index = (out / "index.html").read_text()
    assert "<a href='results.html'>" in index
    for text in (page, index):  # the times and verdicts say which machine they are from
        assert f"Machine: {html.escape(describe(machine))}" in text


def test_results_page_says_whether_each_emulated_verdict_holds_across_the_band(out):
    from toolkit import report
    sens = {"value": 0.9, "band": {"compute x0.7": 0.95, "links x0.8": 1.02}}  # the last point flips the verdict
    flips = report.band("step ratio", sens, lambda v: v < 1)
    holds = report.band("step ratio", {"value": 0.9, "band": {"compute x0.7": 0.95}}, lambda v: v < 1)
    assert flips["holds"] is None and (flips["low"], flips["high"]) == (0.9, 1.02) and holds["holds"] is True
    for name, b in (("00-x", holds), ("03-x", flips)):
        rec = report.record(name[:2], "overlap", "hidden 40 %", emulated="step 0.90x on h100-ib400",
                            emulated_reproduced=None if b["holds"] is None else True, emulated_band=b)
        path = out / "notebooks" / f"{name}.ipynb"
        nb = nbformat.read(path, as_version=4)
        nb.cells[-1].outputs.append(nbformat.v4.new_output("display_data", data={report.MIME: rec, "text/markdown": "h"}))
        nbformat.write(nb, path)
    book.build(out, [{"name": "00-x", "status": "ok", "seconds": 1.0}, {"name": "03-x", "status": "ok",
                                                                         "seconds": 2.0}])
    page = html.unescape((out / "results.html").read_text())
    assert "Emulated verdicts that hold across the calibration's sensitivity band: 1; that\ndepend on it" in page
    assert "(not decidable on the emulated cluster): 1." in page
    assert "step ratio 0.9, 0.9 to 1.02 with the achieved compute x0.7-1.3 and the links x0.8-1.2: depends on " \
           "calibration: not decidable on the emulated cluster" in page
    assert "step ratio 0.9, 0.9 to 0.95" in page and "holds across the band" in page
    with pytest.raises(ValueError, match="emulated_band needs the emulated measurement"):
        report.record("03", "overlap", "hidden", emulated_band=flips)
