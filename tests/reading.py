"""What a learner reads in a lesson's outputs, checked cell by cell on every executed notebook of the suite: nbval's
runs at the notebooks' defaults (emulated clusters included; ``conftest.py`` hands it each cell's outputs) and the
papermill runs of ``tests/test_notebooks.py``.

- a cell that calls ``headline(...)`` shows the headline once: no raw value (the record) as the cell's result;
- a paragraph or list item the run rendered (markdown, headline included) has at most ``PARAGRAPH_WORDS`` words:
  a longer one is a table or a list of its figures;
- a cell that prints source (``viz.listing``, ``inspect.getsource`` or ``getdoc``) prints at most ``LISTING_LINES``
  non-blank lines: the code that matters, and where the rest is;
- a table shows no ``null`` / ``None`` / ``nan`` (a variant named "none" is a name);
- a figure's title and its axes name no two different time units (a title "(ms)" over an axis "time (cost units)").
"""
from __future__ import annotations

import re

PARAGRAPH_WORDS = 120
LISTING_LINES = 40
HEADLINE_MIME = "application/vnd.llm-scale-toolkit.headline+json"
PLOTLY = "application/vnd.plotly.v1+json"
SOURCE_PRINTERS = re.compile(r"\b(getsource|getdoc|listing)\(")
ITEM = re.compile(r"^\s*(?:[-*+]|\d+[.)])\s+")
TIME_UNITS = {"ms": "ms", "µs": "µs", "us": "µs", "ns": "ns", "s": "s", "sec": "s", "second": "s", "seconds": "s",
              "min": "min", "minutes": "min", "cost units": "cost units", "cost unit": "cost units"}
_UNIT = "|".join(sorted((re.escape(u) for u in TIME_UNITS), key=len, reverse=True))
_WORD_UNIT = re.compile(rf"(?<![\w/])({_UNIT})(?![\w/])")


def paragraphs(markdown: str):
    """The paragraphs and list items of ``markdown`` (tables and fenced code left out)."""
    for block in re.split(r"\n\s*\n", markdown):
        if block.lstrip().startswith(("|", "```")):
            continue
        unit: list[str] = []
        for line in block.splitlines():
            if ITEM.match(line) and unit:
                yield " ".join(unit)
                unit = []
            unit.append(ITEM.sub("", line, count=1))  # the item's text, its marker left out
        if unit:
            yield " ".join(unit)


def _text(value) -> str:
    return "".join(value) if isinstance(value, list) else str(value or "")


def title_units(title: str) -> set[str]:
    """Time units a figure title states: a parenthesised unit, alone or first in a comma list ("(ms)",
    "(seconds)", "(dB, rank 0)")."""
    found = set()
    for group in re.findall(r"\(([^()]*)\)", re.sub(r"<[^>]+>", " ", title)):
        for part in group.split(","):
            unit = TIME_UNITS.get(part.strip().lower())
            if unit:
                found.add(unit)
    return found


def axis_units(title: str) -> set[str]:
    """Time units an axis title names ("time (cost units)", "step (ms)", "µs (virtual time)", "virtual ms");
    a lone "s" only as the whole unit in parentheses."""
    found = {TIME_UNITS[m.lower()] for m in _WORD_UNIT.findall(title) if m.lower() != "s"}
    found |= {"s" for group in re.findall(r"\(([^()]*)\)", title) if group.strip() == "s"}
    return found


def figure_problems(figure: dict) -> list[str]:
    layout = figure.get("layout", {})
    title = layout.get("title", {})
    title = _text(title.get("text") if isinstance(title, dict) else title)
    problems = []
    for trace in figure.get("data", []):
        if trace.get("type") == "table":
            cells = trace.get("cells", {}).get("values", [])
            bad = [v for column in cells for v in column if v is None or str(v) in ("null", "None", "nan", "NaN")]
            if bad:
                problems.append(f"table {title!r} shows {bad[0]!r} ({len(bad)} cells): a row without a value")
    units = title_units(title)
    if units:
        for name, axis in layout.items():
            if re.fullmatch(r"[xy]axis\d*", name) and isinstance(axis, dict):
                text = axis.get("title", "")
                text = _text(text.get("text") if isinstance(text, dict) else text)
                if axis_units(text) and not axis_units(text) & units:
                    problems.append(f"figure {title!r} says {sorted(units)} over the axis {text!r}")
    return problems


def cell_problems(source: str, outputs: list) -> list[str]:
    """What is wrong, for a learner, with one executed cell (its source and its outputs, nbformat dicts)."""
    problems = []
    if "headline(" in source and any(o.get("output_type") == "execute_result" for o in outputs):
        problems.append("the headline cell also shows a raw value as its result")
    for o in outputs:
        data = o.get("data", {})
        markdown = _text(data.get("text/markdown")) if "text/markdown" in data else ""
        for unit in paragraphs(markdown):
            words = len(unit.split())
            if words > PARAGRAPH_WORDS:
                problems.append(f"a rendered paragraph of {words} words (at most {PARAGRAPH_WORDS}): "
                                f"{unit[:80]!r}...")
        if PLOTLY in data:
            figure = data[PLOTLY]
            problems += figure_problems(figure if isinstance(figure, dict) else {})
    if SOURCE_PRINTERS.search(source):
        printed = "".join(_text(o.get("text")) for o in outputs if o.get("output_type") == "stream")
        lines = [line for line in printed.splitlines() if line.strip() and not line.startswith("[launch]")]
        if len(lines) > LISTING_LINES:
            problems.append(f"prints a listing of {len(lines)} lines (at most {LISTING_LINES}): {source[:60]!r}")
    return problems


def notebook_problems(nb) -> list[str]:
    """``cell_problems`` of every code cell of an executed notebook, each prefixed with its cell index."""
    return [f"cell {i}: {p}" for i, cell in enumerate(nb.cells) if cell.cell_type == "code"
            for p in cell_problems(cell.source, cell.get("outputs", []))]
