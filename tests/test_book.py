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
    from toolkit.runtime.bench import Claim, judge
    rec = report.record("03", "DualPipeV", "bubble 0.21 vs 0.38", value=0.55, unit="ratio", claim="fewer bubbles",
                        source="DeepSeek-V3", reproduced=judge(Claim.ratio("bubble ratio", 0.5), 0.55))
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
    glossary = page[page.index('<h2 id="glossary">'):]  # the headlines' terms, each defined
    for term in ("edgc", "ZeRO-k · b", "launch-bound", "matched", "S→T state", "virtual time", "within noise"):
        assert html.escape(term) in glossary, term
    index = (out / "index.html").read_text()
    assert "<a href='results.html'>" in index
    for text in (page, index):  # the times and verdicts say which machine they are from
        assert f"Machine: {html.escape(describe(machine))}" in text


def test_results_page_counts_the_four_words_and_names_each_band(out):
    """One rule judges every claim: the results page counts reproduced, direction only, not reproduced and not
    decidable (and checks apart), and each judged row names the band that would have reproduced it. On the
    emulated cluster the interval is the model's sensitivity band: a ratio whose band straddles 1 is not
    decidable, never "faster"."""
    from toolkit import report
    from toolkit.runtime.bench import Claim, check, judge
    claim = Claim.ratio("static / dynamic step", 1.48)
    sens = {"value": 1.05, "band": {"compute x0.7": 1.02, "links x0.8": 0.98}}  # the last point flips the sign
    flips = report.band("static / dynamic step", sens)
    assert (flips["value"], flips["low"], flips["high"]) == (1.05, 0.98, 1.05)
    straddles = judge(claim, flips["value"], flips["low"], flips["high"], report.SENSITIVITY)
    assert straddles.word == "not decidable" and "contains no effect" in straddles.why
    rows = {"00-x": judge(claim, 1.4, 1.3, 1.5, report.SENSITIVITY), "03-x": straddles,
            "05-x": judge(claim, 1.02), "06-x": judge(claim, 0.9)}
    assert [j.word for j in rows.values()] == ["reproduced", "not decidable", "direction only", "not reproduced"]
    for name, j in rows.items():
        rec = report.record(name[:2], "overlap", "hidden 40 %", reproduced=check("bitwise", True),
                            emulated="step on h100-ib400", emulated_reproduced=j)
        path = out / "notebooks" / f"{name}.ipynb"
        nb = nbformat.read(path, as_version=4) if path.exists() else _lesson(name[:2], "A lesson", 1)
        nb.cells[-1].outputs.append(nbformat.v4.new_output("display_data", data={report.MIME: rec, "text/markdown": "h"}))
        nbformat.write(nb, path)
    book.build(out, [{"name": n, "status": "ok", "seconds": 1.0} for n in rows])
    page = html.unescape((out / "results.html").read_text())
    assert ("On the emulated cluster: reproduced: 1 (within ±25% of the claimed 1.48×); direction only: 1 (within "
            "±25% of the claimed 1.48×); not reproduced: 1 (within ±25% of the claimed 1.48×); not decidable: 1 "
            "(within ±25% of the claimed 1.48×).") in page
    assert "The runs: reproduced: 0; direction only: 0; not reproduced: 0; not decidable: 0; check holds: 4" in page
    assert "the interval [0.98, 1.05] contains no effect (1)" in page
    with pytest.raises(ValueError, match="emulated_reproduced needs the emulated measurement"):
        report.record("03", "overlap", "hidden", reproduced=check("bitwise", True), emulated_reproduced=straddles)