"""Plotly figures with one look for every lesson. Each function returns a ``go.Figure`` (a ``Figure``, which
a kernel draws without plotly's renderer registry: see its docstring).

They render in JupyterLab (plotly's mimetype, drawn by the jupyterlab-plotly extension) and in the
HTML book ``make run`` writes (``tools/book.py`` draws the same mimetype with one shared, local copy
of plotly.js). Colours are fixed per meaning, so "F" is the same blue and "activations" the same red
in every lesson. ``explore`` turns any ``draw(**values) -> Figure`` into an explorer that works live
in JupyterLab and, precomputed, without a kernel.
"""
from __future__ import annotations

import json
import math
import os
import sys
from typing import Iterable, Sequence

import plotly.graph_objects as go
import plotly.io as pio

PALETTE = ["#3366cc", "#dc3912", "#ff9900", "#109618", "#990099", "#0099c6", "#dd4477", "#66aa00", "#b82e2e",
           "#316395"]
COLORS = {
    # pipeline actions
    "F": "#3366cc", "B": "#109618", "I": "#109618", "W": "#ff9900", "BW": "#0b7a2e", "F&B": "#7b3fbf", "R": "#990099", "S": "#0099c6", "T": "#dd4477",
    "send": "#9e9e9e", "recv": "#bdbdbd", "comm": "#757575", "idle": "#eeeeee", "optimizer": "#795548",
    # memory categories
    "param": "#3366cc", "grad": "#109618", "optim": "#ff9900", "act": "#dc3912", "comm_buf": "#757575",
    "params": "#3366cc", "grads": "#109618", "activations": "#dc3912", "host": "#9e9e9e",
    "other": "#9e9e9e",
}
CATEGORY_ORDER = ["param", "grad", "optim", "act", "comm"]
PLOTLY_MIME = "application/vnd.plotly.v1+json"

pio.templates["toolkit"] = go.layout.Template(layout=go.Layout(
    font=dict(family="Inter, Helvetica, Arial, sans-serif", size=13, color="#222"),
    title=dict(x=0.01, xanchor="left", font=dict(size=16)),
    paper_bgcolor="white", plot_bgcolor="white", colorway=PALETTE,
    xaxis=dict(showgrid=True, gridcolor="#eee", zeroline=False, linecolor="#999", ticks="outside"),
    yaxis=dict(showgrid=True, gridcolor="#eee", zeroline=False, linecolor="#999", ticks="outside"),
    legend=dict(orientation="h", yanchor="bottom", y=1.02, xanchor="right", x=1),
    margin=dict(l=60, r=20, t=70, b=50), hoverlabel=dict(font_size=12)))


def in_kernel() -> bool:
    """True in a Jupyter kernel (JupyterLab, papermill, nbval): the shell that displays plotly's mimetype."""
    ipython = sys.modules.get("IPython")  # not imported: certainly no kernel
    shell = ipython.get_ipython() if ipython is not None else None
    return shell is not None and shell.__class__.__name__ == "ZMQInteractiveShell"


def mime_bundle(fig: go.Figure) -> dict:
    """The figure as plotly's ``plotly_mimetype`` renderer writes it: ``{"application/vnd.plotly.v1+json": ...}``."""
    return {PLOTLY_MIME: json.loads(pio.to_json(fig, validate=False, remove_uids=False))}


class Figure(go.Figure):
    """A ``go.Figure`` that a Jupyter kernel draws straight from plotly's mimetype, as plotly's ``show()`` would.

    Plotly's own path (``show()``, or a figure as a cell's value) first imports its renderer registry, which
    imports nbformat, whose jsonschema builds the grammars of ``rfc3987-syntax`` when it is installed (JupyterLab
    installs it): 1.5–3 s once per kernel on a 2-core machine, which every lesson paid for its first figure.
    Outside a kernel, or with arguments (``show(renderer="png")``), it is plotly's ``show``.
    """

    def show(self, *args, **kwargs) -> None:
        if args or kwargs or not in_kernel():
            return super().show(*args, **kwargs)
        from IPython.display import display
        display(mime_bundle(self), raw=True)

    def _ipython_display_(self) -> None:
        if in_kernel():
            self.show()
        else:
            super()._ipython_display_()


def color_of(key: str, i: int = 0) -> str:
    return COLORS.get(key, PALETTE[i % len(PALETTE)])


def theme(fig: go.Figure, title: str | None = None, height: int | None = None) -> go.Figure:
    """Apply the toolkit look (and optionally a title/height)."""
    fig.update_layout(template="toolkit")
    if title is not None:
        fig.update_layout(title=title)
    if height:
        fig.update_layout(height=height)
    return fig


def gantt(spans: Iterable[dict], color_by: str = "kind", title: str = "", label: str | None = "mb",
          time_unit: str = "ms", lane: str | None = None, unit_label: str | None = None) -> go.Figure:
    """Per-rank timeline: one row per rank, one bar per span, coloured by ``span[color_by]`` (or ``meta``).

    ``spans`` are ``Timeline.to_json()`` dicts (rank, kind, start, end, meta) from any number of ranks, their
    times in seconds, shown in ``time_unit`` ("s", "ms", "us"); ``unit_label`` names the unit on the axis and in
    the hover text instead (times already in another unit, e.g. a simulator's "cost units", with
    ``time_unit="s"``: shown as they are); ``label`` names a meta field written inside each bar (micro-batch by
    default); ``lane`` names a meta field that splits each rank's row in several (e.g. "compute" and "comm").
    """
    scale = {"s": 1.0, "ms": 1e3, "us": 1e6}[time_unit]
    unit = unit_label or time_unit
    spans = list(spans)
    origin = min((s["start"] for s in spans), default=0.0)  # the chart starts at the first span
    spans = [{**s, "start": s["start"] - origin, "end": s["end"] - origin} for s in spans]
    groups: dict[str, list[dict]] = {}
    for s in spans:
        key = str(s.get(color_by, s.get("meta", {}).get(color_by, "")))
        groups.setdefault(key, []).append(s)
    fig = Figure()
    for i, (key, items) in enumerate(groups.items()):
        fig.add_trace(go.Bar(
            base=[s["start"] * scale for s in items], x=[(s["end"] - s["start"]) * scale for s in items],
            y=[_row(s, lane) for s in items], orientation="h", name=key, marker_color=color_of(key, i),
            marker_line=dict(color="white", width=0.5),
            text=[str(s.get("meta", {}).get(label, "")) if label else "" for s in items], textposition="inside",
            insidetextanchor="middle",
            customdata=[[s["kind"], str(s.get("meta", {}))] for s in items],
            hovertemplate="%{customdata[0]} %{customdata[1]}<br>%{base:.3f} + %{x:.3f} " + unit
                          + "<extra></extra>"))
    rows = sorted({(s["rank"], str(s.get("meta", {}).get(lane, "") or "")) for s in spans}) if lane else \
        sorted({(s["rank"], "") for s in spans})
    labels = [_row({"rank": r, "meta": {lane: x}}, lane) for r, x in rows]
    fig.update_layout(barmode="overlay", bargap=0.25, xaxis_title=f"time ({unit})",
                      yaxis=dict(categoryorder="array", categoryarray=list(reversed(labels))))
    return theme(fig, title, height=140 + 45 * max(len(labels), 1))


def _row(span: dict, lane: str | None) -> str:
    value = span.get("meta", {}).get(lane, "") if lane else ""
    return f"rank {span['rank']}" + (f" · {value}" if value not in ("", None) else "")


def memory_over_time(samples: Sequence[dict], title: str = "", categories: Sequence[str] | None = None,
                     x: str = "t", unit: str = "MiB") -> go.Figure:
    """Stacked areas of bytes by category over samples (dicts with ``x`` and one key per category)."""
    div = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]
    cats = list(categories) if categories else [c for c in CATEGORY_ORDER if any(c in s for s in samples)]
    xs = [s.get(x, i) for i, s in enumerate(samples)]
    fig = Figure()
    for i, c in enumerate(cats):
        fig.add_trace(go.Scatter(x=xs, y=[s.get(c, 0) / div for s in samples], name=c, stackgroup="mem",
                                 mode="lines", line=dict(width=0.5, color=color_of(c if c != "comm" else "comm_buf", i)),
                                 hovertext=[s.get("label", "") for s in samples]))
    fig.update_layout(xaxis_title=x, yaxis_title=unit)
    return theme(fig, title)


def bars(rows: Sequence[dict], x: str, y: str, color: str | None = None, title: str = "", barmode: str = "group",
         yaxis_title: str | None = None, text_format: str | None = None, log_y: bool = False) -> go.Figure:
    """Bar chart from a list of dicts: one bar per row at ``row[x]`` of height ``row[y]``, grouped by ``row[color]``."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(str(r[color]) if color else y, []).append(r)
    fig = Figure()
    for i, (key, items) in enumerate(groups.items()):
        vals = [r[y] for r in items]
        fig.add_trace(go.Bar(x=[r[x] for r in items], y=vals, name=key, marker_color=color_of(key, i),
                             text=[format(v, text_format) for v in vals] if text_format else None,
                             textposition="outside" if text_format else None))
    fig.update_layout(barmode=barmode, xaxis_title=x, yaxis_title=yaxis_title or y, showlegend=bool(color))
    if log_y:
        fig.update_yaxes(type="log")
    return theme(fig, title)


def lines(series: dict[str, Sequence[float]], x: Sequence[float] | None = None, title: str = "",
          xaxis_title: str = "", yaxis_title: str = "", log_x: bool = False, log_y: bool = False,
          dash: dict[str, str] | None = None) -> go.Figure:
    """One line per named series (e.g. loss curves: {"baseline": [...], "int8": [...]})."""
    fig = Figure()
    for i, (name, ys) in enumerate(series.items()):
        xs = list(x) if x is not None else list(range(len(ys)))
        fig.add_trace(go.Scatter(x=xs, y=list(ys), name=name, mode="lines+markers" if len(ys) <= 30 else "lines",
                                 line=dict(color=color_of(name, i), dash=(dash or {}).get(name))))
    fig.update_layout(xaxis_title=xaxis_title, yaxis_title=yaxis_title)
    if log_x:
        fig.update_xaxes(type="log")
    if log_y:
        fig.update_yaxes(type="log")
    return theme(fig, title)


def heatmap(z: Sequence[Sequence[float]], x: Sequence | None = None, y: Sequence | None = None, title: str = "",
            colorbar_title: str = "", text_format: str | None = ".3g", colorscale: str = "Viridis") -> go.Figure:
    """Annotated heatmap (values written in the cells when ``text_format`` is set)."""
    fig = Figure(go.Heatmap(z=z, x=x, y=y, colorscale=colorscale, colorbar=dict(title=colorbar_title),
                               text=[[format(v, text_format) for v in row] for row in z] if text_format else None,
                               texttemplate="%{text}" if text_format else None))
    for axis, labels in (("xaxis", x), ("yaxis", y)):  # "32", "64", "tensor": labels, not numbers (plotly would
        if labels is not None and any(isinstance(v, str) for v in labels):  # put "tensor" at NaN)
            fig.update_layout({axis: {"type": "category", "automargin": True}})  # long row labels stay whole
    return theme(fig, title)


EMPTY = "—"
"""What a table shows where a row has no value (``table``)."""


def table(rows: Sequence[dict], title: str = "", formats: dict[str, str] | None = None) -> go.Figure:
    """A plotly table of dicts (columns from the first row), with optional per-column formats. A cell a row has
    no value for (None, NaN, or the key missing) shows ``EMPTY``, never "null"."""
    if not rows:
        return theme(Figure(), title)
    cols = list(rows[0])
    fmt = formats or {}

    def cell(value, column):
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return EMPTY
        return format(value, fmt[column]) if column in fmt else value

    cells = [[cell(r.get(c), c) for r in rows] for c in cols]
    fig = Figure(go.Table(header=dict(values=cols, fill_color="#f3f3f3", align="left"),
                             cells=dict(values=cells, align="left")))
    return theme(fig, title, height=120 + 28 * len(rows))


def waterfall(steps: Sequence[str], values: Sequence[float], title: str = "", yaxis_title: str = "",
              text_format: str = ".3g") -> go.Figure:
    """What each step changed: the first value as a bar, then one floating bar per step from the value before it
    to its own (green down, red up), and the last value as a total bar. ``values[i]`` is the quantity after
    ``steps[i]`` (``steps[0]`` the starting point)."""
    deltas = [values[0]] + [b - a for a, b in zip(values, values[1:])] + [values[-1]]
    fig = Figure(go.Waterfall(
        x=[*steps, "result"], y=deltas, measure=["absolute"] + ["relative"] * (len(values) - 1) + ["total"],
        text=[format(v, text_format) for v in deltas], textposition="outside",
        increasing=dict(marker_color=COLORS["act"]), decreasing=dict(marker_color=COLORS["grad"]),
        totals=dict(marker_color=COLORS["param"]), connector=dict(line=dict(color="#999", width=1))))
    fig.update_layout(yaxis_title=yaxis_title, showlegend=False)
    return theme(fig, title)


def human_bytes(n: float) -> str:
    """1536 -> '1.50 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


from .explore import Explorer, explore, precompute, what_if  # noqa: E402  (needs theme above)
from .listing import listing  # noqa: E402

__all__ = ["Figure", "mime_bundle", "in_kernel", "theme", "gantt", "memory_over_time", "bars", "lines", "heatmap", "table", "waterfall", "human_bytes",
           "COLORS", "PALETTE", "color_of", "explore", "precompute", "Explorer", "what_if", "listing", "EMPTY"]


def _use_notebook_renderer() -> None:
    """In a Jupyter kernel, plotly's mimetype only: JupyterLab draws it, and so does the HTML book (with one
    shared plotly.js), instead of every executed notebook carrying its own 4.8 MB copy. Set through plotly's
    ``PLOTLY_RENDERER`` (a user's own setting wins) while its renderer registry is not imported yet: importing
    it is what ``Figure`` avoids."""
    if not in_kernel():
        return
    if "plotly.io._renderers" in sys.modules:
        pio.renderers.default = "plotly_mimetype"
    else:
        os.environ.setdefault("PLOTLY_RENDERER", "plotly_mimetype")


_use_notebook_renderer()
