"""A notebook's static prose states no measured number or comparison of its own: those are rendered from the
run (``display(Markdown(f"..."))``) or pinned by an assert a few cells above (CONTRIBUTING.md, "Prose").

The check reads the percent-format sources (``notebooks/src/NN-name.py``). In every markdown cell it leaves
out fenced code blocks (diagrams, formulas), inline code, math, quote blocks (``> ...``) and text in
quotation marks (what a source says, in its words), splits the rest into clauses (sentences, ``;``-separated parts, list items) and flags a clause that

- states a measured-looking number: a percentage (``35 %``), a ratio (``4.7×``, ``4.7x``), a decibel figure
  (``8 dB``), a number with a fractional part or thousands separators and a unit of bytes, time or
  bandwidth (``1.27 MB``, ``0.5 ms``, ``75,000 bytes``), or an approximate number (``≈ 8``, ``~35``,
  ``about 1.5``, in words too: "about half", "a few percent", "an order of magnitude"), or
- states a comparison: "faster than", "more than", "lower than", ..., "outperforms", "N times".

A flagged clause passes when it

- is marked as a source's claim: it contains "claim(s/ed)", "the paper/article/source/authors
  says/reports/...", or a tag in parentheses ``(paper)``, ``(article)``, ``(source)``, ``(spec)``,
  ``(datasheet)``, ``(theory)``, ``(formula)``, ``(by construction)``; or
- is pinned: every flagged number appears literally in an ``assert`` of one of the PIN_WINDOW code cells
  just above the markdown cell, and, for a comparison, one of those asserts compares (``<``, ``>``).

Separately, a figure or table drawn from a simulator or cost model (a code cell that calls ``plan(`` or
mentions ``simulat``) must say so in its title: "simulat…" or "cost model".

The check applies to every notebook (ENFORCED).
"""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "notebooks" / "src"
ENFORCED = sorted(p.stem for p in SRC.glob("*.py"))  # every notebook
PIN_WINDOW = 3  # code cells above a markdown cell whose asserts may pin its numbers

_spec = importlib.util.spec_from_file_location("nb_tool", ROOT / "tools" / "nb.py")
nb_tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(nb_tool)

NUM = r"\d+(?:[.,]\d+)*"
UNIT = r"(?:[kKMGT]i?B|B|bytes?|ms|µs|us|ns|s|seconds?|minutes?|GB/s|MB/s|TB/s|Gb/s|TFLOP/s|FLOP/s|bits?)"
NUMBER_PATTERNS = [
    re.compile(rf"(?<![\w.]){NUM}\s?%"),  # 35 %, −46%
    re.compile(rf"(?<![\w.]){NUM}\s?×"),  # 4.7×, 1.5 ×
    re.compile(rf"(?<![\w.]){NUM}x\b"),  # 4.7x
    re.compile(rf"(?<![\w.]){NUM}\s?dB\b"),  # 8 dB
    re.compile(rf"(?<![\w.])\d+\.\d+\s?{UNIT}(?![\w])"),  # 1.27 MB, 0.5 ms
    re.compile(rf"(?<![\w.])\d{{1,3}}(?:,\d{{3}})+\s?{UNIT}(?![\w])"),  # 75,000 bytes
    re.compile(rf"(?:≈|~|\babout|\baround|\broughly)\s?{NUM}"),  # ≈ 8, about 35: an approximate result
    # in words: "about half a millisecond", "roughly twice", "a few percent", "an order of magnitude"
    re.compile(r"\b(?:about|around|roughly|nearly|almost)\s+(?:half|a third|a quarter|twice|double|triple|"
               r"an order of magnitude)\b|\ba few percent\b|\ban order of magnitude\b", re.I),
]
COMPARISON = re.compile(r"\b(?:faster|slower|more|less|fewer|larger|smaller|bigger|higher|lower|better|worse|"
                        r"cheaper|dearer)\s+than\b|\boutperform\w*|\bbeats?\b|\b\d+(?:\.\d+)?\s+times\b", re.I)
SOURCE_MARK = re.compile(r"\bclaim(?:s|ed)?\b|\b(?:paper|article|source|authors?)\s+(?:says?|reports?|writes?|"
                         r"recommends?|states?|quotes?)\b|\((?:paper|article|source|spec|datasheet|theory|formula|"
                         r"by construction)\b[^)]*\)", re.I)


def cells(name: str) -> list:
    return nb_tool.parse((SRC / f"{name}.py").read_text()).cells


def prose(markdown: str) -> str:
    """The markdown a reader takes as this notebook's own statements: no code, math or quotes."""
    text = re.sub(r"```.*?```", " ", markdown, flags=re.S)  # fenced blocks: diagrams, formulas
    text = re.sub(r"\$\$.*?\$\$", " ", text, flags=re.S)
    text = re.sub(r"\$[^$\n]+\$", " ", text)
    text = re.sub(r"`[^`\n]*`", " ", text)
    text = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith(">"))
    return re.sub(r'"[^"]*"|“[^”]*”', " ", text)  # quotation marks: someone else's words


def clauses(markdown: str) -> list[str]:
    out = []
    for block in re.split(r"\n\s*\n|\n(?=\s*(?:[-*]|\d+\.)\s)|\n(?=#)|\n(?=\|)", prose(markdown)):
        text = " ".join(block.split())
        out += [c for c in re.split(r"(?<=[.;!?])\s+(?=\S)", text) if c.strip()]
    return out


def flagged_numbers(clause: str) -> list[str]:
    return [m.group(0) for pat in NUMBER_PATTERNS for m in pat.finditer(clause)]


def pins(code_cells: list[str]) -> tuple[str, bool]:
    """All assert statements of ``code_cells`` as one text, and whether one of them compares with < or >."""
    lines = []
    for src in code_cells:
        inside = False
        for line in src.splitlines():
            stripped = line.strip()
            if stripped.startswith("assert "):
                inside = True
            elif stripped and not line.startswith((" ", "\t")):
                inside = False
            if inside:
                lines.append(line)
    text = "\n".join(lines)
    return text, bool(re.search(r"(?<![-=])[<>](?!>)", text))


def problems(name: str, cs: list | None = None) -> list[str]:
    """What breaks the convention in notebook ``name`` (or in the parsed cells ``cs``), one line each."""
    found = []
    cs = cells(name) if cs is None else cs
    for i, cell in enumerate(cs):
        if cell.cell_type == "code":
            src = cell.source
            if re.search(r"\bplan\(|simulat", src) and re.search(r"\bviz\.\w+\(", src):
                titles = " ".join(re.findall(r"title\s*=\s*f?[\"']([^\"']*)", src))
                if titles and not re.search(r"simulat|cost model", titles, re.I):
                    found.append(f"{name} cell {i}: a simulator/cost-model figure must say so in its title: {titles!r}")
            continue
        above = [c.source for c in cs[:i] if c.cell_type == "code"][-PIN_WINDOW:]
        asserts, compares = pins(above)
        for clause in clauses(cell.source):
            numbers, comparison = flagged_numbers(clause), COMPARISON.search(clause)
            if not numbers and not comparison or SOURCE_MARK.search(clause):
                continue
            unpinned = [n for n in numbers if re.sub(r"[\s%×x]|dB|" + UNIT + "$", "", n).strip() not in asserts]
            if unpinned or (comparison and not compares):
                what = ", ".join(unpinned) if unpinned else f"comparison {comparison.group(0)!r}"
                found.append(f"{name} cell {i}: {what} in static prose (render it from the run, pin it by an "
                             f"assert above, or mark it as a source's claim): {clause!r}")
    return found


@pytest.mark.parametrize("name", ENFORCED)
def test_static_prose_states_no_unpinned_measurement(name):
    found = problems(name)
    assert not found, "\n".join(found)


def test_enforced_notebooks_exist():
    assert all((SRC / f"{n}.py").exists() for n in ENFORCED)


# ---- the checker itself must catch what it is for, and let through what the convention allows ------------

def _check(markdown: str, code_above: str = "") -> list[str]:
    nb = f"# %%\n{code_above or 'x = 1'}\n\n# %% [markdown]\n" + "\n".join(f"# {l}" for l in markdown.splitlines())
    return problems("selftest", nb_tool.parse(nb).cells)


@pytest.mark.parametrize("text", [
    "ZeRO-3 took 4.7× longer here.", "The saving is 35 % of the bytes.", "Each step sends 1.27 MB.",
    "SDP4Bit is faster than the baseline.", "H32 adds about 8 dB of SNR.", "It sent 75,000 bytes per step.",
    "The loss is 2.5x the baseline's.", "- a list item: 0.43× above the target",
    "The ops last about half a millisecond.", "The loss moved by a few percent.", "It is an order of magnitude off.",
])
def test_measured_statements_are_caught(text):
    assert _check(text), text


@pytest.mark.parametrize("text,code", [
    ("> The paper claims 4.7× fewer bytes.", ""),
    ("The article claims a 38% → 9% bubble.", ""),
    ("On A100 the peaks are the same, 312 TFLOP/s each (datasheet).", ""),
    ("The formula gives `1.5 × DDP` bytes.", ""),
    ("```\n  ZeRO-3   ~1.5 × DDP\n```", ""),
    ("The weights cost at most 0.26× of bf16.", "assert w_ratio <= 0.26"),
    ("Checkpointing blocks keeps less than checkpointing attention.", "assert by['block'] < by['attn']"),
    ("Two ranks, 4 bits per value, groups of 128.", ""),
    ("Training in 8 bits halves the bytes of every operand; the two halves of an F&B.", ""),
])
def test_allowed_statements_pass(text, code):
    assert not _check(text, code), text


def test_a_comparison_needs_an_inequality_assert_and_numbers_the_same_literal():
    assert _check("Blocks keep less than attention.", "assert ok")
    assert _check("The ratio is 0.251×.", "assert ratio <= 0.26")


def test_simulator_figures_must_be_labelled():
    code = 'res = simulate(s)\nviz.lines(res, title="Bubble per schedule").show()'
    assert any("simulator" in p for p in _check("Text.", code))
    code = 'res = simulate(s)\nviz.lines(res, title="Bubble per schedule (simulated)").show()'
    assert not _check("Text.", code)


# ---- what a run renders (tests/reading.py, applied to every executed cell by conftest.py and test_notebooks) ----
from reading import LISTING_LINES, PARAGRAPH_WORDS, cell_problems  # noqa: E402

TABLE = "application/vnd.plotly.v1+json"


def _figure(title: str, x: str = "", table: list | None = None) -> dict:
    data = [{"type": "table", "cells": {"values": table}}] if table else []
    return {"output_type": "display_data", "data": {TABLE: {"data": data, "layout": {
        "title": {"text": title}, "xaxis": {"title": {"text": x}}}}}}


def test_what_a_learner_reads_is_checked_cell_by_cell():
    wall = " ".join(["word"] * (PARAGRAPH_WORDS + 1))
    md = {"output_type": "display_data", "data": {"text/markdown": f"Short.\n\n- {wall}\n- short"}}
    listing = {"output_type": "stream", "name": "stdout", "text": "x = 1\n\n" * (LISTING_LINES + 1)}
    record = {"output_type": "execute_result", "data": {"text/plain": "{'lesson': '03'}"}}
    found = cell_problems("headline('03', ...)", [record]) + cell_problems("display(Markdown(text))", [md]) \
        + cell_problems("print(viz.listing(fn))", [listing]) \
        + cell_problems("show()", [_figure("Simulated step (ms)", "time (cost units)"),
                                   _figure("Loss table", table=[["baseline", "fp8"], [None, "baseline"]])])
    expected = ["the headline cell also shows a raw value as its result",
                f"a rendered paragraph of {PARAGRAPH_WORDS + 1} words",
                f"prints a listing of {LISTING_LINES + 1} lines",
                "figure 'Simulated step (ms)' says ['ms'] over the axis 'time (cost units)'",
                "table 'Loss table' shows None"]
    assert len(found) == len(expected) and all(f.startswith(e) for f, e in zip(found, expected)), found
    fine = [_figure("Step (trimmed mean, this machine)", "step (ms)"), _figure("One step (µs, virtual time)", "µs"),
            _figure("Schedule, simulated (ms)", "time (ms)"), _figure("SNR (dB, rank 0)", "time (s)"),
            {"output_type": "display_data", "data": {"text/markdown": "- short\n- " + " ".join(["w"] * 100)}},
            {"output_type": "stream", "name": "stdout", "text": "x = 1\n\n" * LISTING_LINES}]
    assert cell_problems("print(inspect.getsource(fn)); headline('03')", fine) == []


def test_listing_shows_the_lines_that_matter_and_where_the_rest_is():
    from toolkit.pipeline import dualpipev
    from toolkit.viz import listing
    text = listing(dualpipev, start="# 1", end="ranks.append")
    lines = text.splitlines()
    assert lines[0].startswith("def dualpipev(") and lines[1].endswith('..."""') and lines[2].strip() == "..."
    assert "# 1" in lines[3] and "ranks.append(acts)" in lines[-3] and lines[-2].strip() == "..."
    assert lines[-1].startswith("# the whole of it: toolkit/pipeline/schedule.py:")
    assert len(lines) <= LISTING_LINES
    with pytest.raises(ValueError, match=r"the listing of 'dualpipev' is \d+ lines, more than limit=40"):
        listing(dualpipev)
    with pytest.raises(ValueError, match="start='no such line' is not in the source of 'dualpipev'"):
        listing(dualpipev, start="no such line")
    from toolkit.memory.nvme import DiskAdamW  # decorated (torch.no_grad): its own file and lines
    assert listing(DiskAdamW.step, start="for k, j", end="free.append(b)").splitlines()[-1].startswith(
        "# the whole of it: toolkit/memory/nvme.py:")
    from toolkit.pipeline import vocab_parallel
    whole = listing(vocab_parallel.c0)  # short: all of it, its one-line docstring, no pointer
    assert "# the whole of it" not in whole and whole.splitlines()[1].strip().startswith('"""The first barrier')


def test_a_table_shows_no_null():
    from toolkit import viz
    fig = viz.table([{"run": "baseline", "against": None, "x": float("nan")}, {"run": "fp8", "against": "baseline",
                                                                              "x": 1.5}], formats={"x": ".2f"})
    assert [list(c) for c in fig.data[0].cells.values] == [["baseline", "fp8"], [viz.EMPTY, "baseline"],
                                                           [viz.EMPTY, "1.50"]]
