"""Explorers: a figure that redraws as its controls move, live with a kernel and precomputed without one.

::

    explore(draw, {"schedule": ["1f1b", "dualpipev"], "m": [4, 8, 16]}, defaults={"m": 8})

    draw(schedule=..., m=...) -> go.Figure          any figure, subplots included

    live         ipywidgets: a dropdown per list of strings, a slider per list of numbers; every change
                 calls draw(**values), so every combination is there. Needs a running kernel (JupyterLab).
    precomputed  one plotly figure carrying the same controls as plotly dropdowns/sliders. It is drawn
                 for each value of each control with the others at their defaults (the sum of the list
                 lengths, not their product), and a control switches which traces are visible: it works
                 wherever plotly.js runs — the HTML book, nbviewer, an e-mailed .html — with no kernel.
                 Moving one control puts the others back to their defaults, and the title says so.

In a notebook ``explore(...)`` shows both (the live one first); ``precompute(...)`` returns the figure only.
The precomputed figure's ``layout.meta["explorer"]`` names its controls (the browser tests use it).
"""
from __future__ import annotations

from numbers import Number
import json
from typing import Any, Callable, Mapping, Sequence

import plotly.graph_objects as go
import plotly.io as pio

from . import PALETTE, Figure, mime_bundle, theme

DROPDOWN_PX, SLIDER_PX, AXIS_PX = 46, 90, 64   # vertical room each control takes below the plot


def _label(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _numeric(values: Sequence) -> bool:
    return all(isinstance(v, Number) and not isinstance(v, bool) for v in values)


def _check(controls: Mapping[str, Sequence], defaults: Mapping[str, Any] | None) -> tuple[dict, dict]:
    if not controls:
        raise ValueError("controls: give at least one {name: [values]}")
    lists = {}
    for name, values in controls.items():
        values = list(values)
        if not values:
            raise ValueError(f"controls[{name!r}]: empty list; give the values to explore")
        lists[name] = values
    unknown = set(defaults or {}) - set(lists)
    if unknown:
        raise ValueError(f"defaults: {sorted(unknown)} are not controls; allowed: {sorted(lists)}")
    base = {}
    for name, values in lists.items():
        value = (defaults or {}).get(name, values[len(values) // 2] if _numeric(values) else values[0])
        if value not in values:
            raise ValueError(f"defaults[{name!r}] = {value!r} is not one of controls[{name!r}] = {values}")
        base[name] = value
    return lists, base


def _failed(message: str) -> go.Figure:
    fig = Figure()
    fig.add_annotation(text=message, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper")
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return theme(fig, title="cannot draw these settings")


def _draw(draw: Callable[..., go.Figure], values: dict) -> go.Figure:
    try:
        return draw(**values)
    except ValueError as err:  # e.g. a schedule that needs more micro-batches: say why instead of drawing
        return _failed(f"cannot draw: {err}")


def _settings(values: dict) -> str:
    return ", ".join(f"{k}={_label(v)}" for k, v in values.items())


def precompute(draw: Callable[..., go.Figure], controls: Mapping[str, Sequence],
               defaults: Mapping[str, Any] | None = None) -> go.Figure:
    """One plotly figure with a dropdown (strings) or slider (numbers) per control, drawn in advance.

    ``draw(**values)`` is called once for the defaults and once per other value of each control; a
    ``ValueError`` it raises becomes a figure that says so. Strings get dropdowns, numbers sliders.
    """
    lists, base = _check(controls, defaults)
    states = [dict(base)] + [{**base, name: v} for name, values in lists.items() for v in values if v != base[name]]
    figures = [json.loads(pio.to_json(_draw(draw, s), validate=False)) for s in states]  # plain dicts: fast
    index = {(name, _label(s[name])): i for i, s in reversed(list(enumerate(states))) for name in lists
             if all(s[k] == base[k] for k in lists if k != name)}

    data, owner, shown_as = [], [], []
    for i, f in enumerate(figures):
        for trace in f.get("data", []):
            shown = trace.get("visible", True)
            data.append({**trace, "visible": shown if i == 0 else False})
            owner.append(i)
            shown_as.append(shown)

    def layout_of(i: int) -> dict:
        lay = figures[i].get("layout", {})
        keep = {k: v for k, v in lay.items() if k.startswith(("xaxis", "yaxis")) or k in ("annotations", "shapes")}
        for k in ("annotations", "shapes"):
            keep.setdefault(k, [])
        title = dict(lay.get("title", {}))
        text = title.get("text") or ""
        changed = {k: v for k, v in states[i].items() if v != base[k]}
        note = f"{_settings(changed)}, others at defaults" if changed else "defaults"
        title["text"] = f"{text}<br><sup>{note}</sup>" if text else note
        keep["title"] = title
        return keep

    def margin(f: dict, side: str, default: int) -> int:
        value = f.get("layout", {}).get("margin", {}).get(side)
        return int(value) if value is not None else default

    dropdowns = [n for n in lists if not _numeric(lists[n])]
    sliders = [n for n in lists if _numeric(lists[n])]
    top = margin(figures[0], "t", 70)
    columns = 2 if len(sliders) > 2 else 1  # many sliders: two columns
    axis_px = AXIS_PX if any(tr.get("type", "scatter") != "table" for tr in data) else 8  # a table has no x axis
    bottom = axis_px + DROPDOWN_PX * bool(dropdowns) + SLIDER_PX * -(-len(sliders) // columns)
    plot_h = max(max(int(f.get("layout", {}).get("height") or 450) - margin(f, "t", 70) - margin(f, "b", 50)
                     for f in figures), 120)
    total = top + plot_h + bottom  # room for the largest state's plot, then the controls below it

    def reset_others(name: str) -> dict:
        out = {}
        for j, other in enumerate(dropdowns):
            if other != name:
                out[f"updatemenus[{j}].active"] = lists[other].index(base[other])
        for j, other in enumerate(sliders):
            if other != name:
                out[f"sliders[{j}].active"] = lists[other].index(base[other])
        return out

    def args(name: str, value) -> list:
        i = index[(name, _label(value))]
        visible = [shown_as[t] if owner[t] == i else False for t in range(len(owner))]
        return [{"visible": visible}, {**layout_of(i), **reset_others(name)}]

    menus = []
    for j, name in enumerate(dropdowns):
        menus.append(dict(
            type="dropdown", direction="up", showactive=True, active=lists[name].index(base[name]),
            x=j / max(len(dropdowns), 1), xanchor="left", y=-(axis_px / plot_h), yanchor="top",
            pad=dict(t=4, r=8), buttons=[dict(label=f"{name}: {_label(v)}", method="update", args=args(name, v))
                                         for v in lists[name]]))
    bars = []
    for j, name in enumerate(sliders):
        offset = axis_px + DROPDOWN_PX * bool(dropdowns) + SLIDER_PX * (j // columns)
        bars.append(dict(
            active=lists[name].index(base[name]), x=(j % columns) / columns, len=0.94 / columns if columns > 1 else 1,
            xanchor="left", y=-(offset / plot_h), yanchor="top",
            pad=dict(t=28, b=4), currentvalue=dict(prefix=f"{name} = ", visible=True, xanchor="left"),
            steps=[dict(label=_label(v), method="update", args=args(name, v)) for v in lists[name]]))
    layout = {**figures[0].get("layout", {}), **layout_of(0), "updatemenus": menus, "sliders": bars,
              "height": total, "margin": {**figures[0].get("layout", {}).get("margin", {}), "b": bottom},
              "meta": {"explorer": {"controls": {n: [_label(v) for v in lists[n]] for n in lists},
                                    "defaults": {n: _label(v) for n, v in base.items()}, "states": len(states)}}}
    return Figure({"data": data, "layout": layout})


class Explorer:
    """What ``explore`` returns: shows the live widget (when a kernel can run it) and the precomputed figure."""

    def __init__(self, draw: Callable[..., go.Figure], controls: Mapping[str, Sequence],
                 defaults: Mapping[str, Any] | None = None):
        self.draw = draw
        self.controls, self.defaults = _check(controls, defaults)
        self.figure = precompute(draw, self.controls, self.defaults)

    def widget(self):
        """The live version: ipywidgets controls and an output area redrawn on every change."""
        import ipywidgets as w
        from IPython.display import display

        style, ctrl = {"description_width": "initial"}, {}
        for name, values in self.controls.items():
            options = [(_label(v), v) for v in values]
            kind = w.SelectionSlider if _numeric(values) else w.Dropdown
            extra = {"continuous_update": False} if kind is w.SelectionSlider else {}
            ctrl[name] = kind(options=options, value=self.defaults[name], description=name, style=style,
                              layout=w.Layout(width="auto", min_width="220px"), **extra)
        out = w.Output()

        def redraw(_=None):
            values = {k: c.value for k, c in ctrl.items()}
            with out:
                out.clear_output(wait=True)
                try:
                    fig = self.draw(**values)
                except ValueError as err:
                    print(f"cannot draw {_settings(values)}: {err}")
                    return
                # plotly's mimetype only: the "notebook" renderer inside an Output widget makes
                # papermill/nbclient wait for its whole timeout
                display(mime_bundle(fig), raw=True)

        for c in ctrl.values():
            c.observe(redraw, names="value")
        redraw()
        head = w.HTML("<b>Live explorer</b> (this kernel redraws every combination)")
        box = w.VBox([head, w.HBox(list(ctrl.values()), layout=w.Layout(flex_flow="row wrap")), out])
        box.add_class("toolkit-explorer")
        return box

    def _ipython_display_(self) -> None:
        from IPython.display import Markdown, display
        try:
            from IPython import get_ipython
            live = get_ipython() is not None and get_ipython().__class__.__name__ == "ZMQInteractiveShell"
            if live:
                display(self.widget())
        except ImportError:
            pass
        display(Markdown(f"*Precomputed explorer (works without a kernel, e.g. in the HTML book): each control "
                         f"moves one setting, the others stay at their defaults ({_settings(self.defaults)}).*"))
        display(self.figure)


def explore(draw: Callable[..., go.Figure], controls: Mapping[str, Sequence],
            defaults: Mapping[str, Any] | None = None) -> Explorer:
    """An explorer of ``draw(**values)`` over ``controls`` ({name: [values]}); display it (last line of a cell).

    Strings become dropdowns, numbers sliders; ``defaults`` picks the starting value of each control
    (the first string, the middle number otherwise). Bad controls or defaults raise ``ValueError``.
    """
    return Explorer(draw, controls, defaults)


def what_if(sensitivity: dict, bars: Mapping[str, str], title: str, unit: str = "ms", scale: float = 1e3,
            note: Callable[[dict], str] | None = None) -> Explorer:
    """A what-if explorer over an emulated run replayed on other figures (``Emulator.sensitivity(..., grid=)``):
    sliders for the achieved compute (x the calibrated efficiency) and the links' bandwidth, bars of the
    replayed quantities ``bars`` ({label: key of the quantity's dict}) in ``unit`` (seconds x ``scale``), and
    ``note(values)`` in the title (e.g. the ratio the verdict reads). Every point is a replay of the same run."""
    grid = sensitivity["grid"]
    cells = {(c, b): grid["values"][i][j] for i, c in enumerate(grid["compute"])
             for j, b in enumerate(grid["bandwidth"])}

    def draw(compute: float, bandwidth: float) -> go.Figure:
        v = cells[(compute, bandwidth)]
        y = [v[key] * scale for key in bars.values()]
        fig = Figure(go.Bar(x=list(bars), y=y, text=[f"{x:.3g}" for x in y], textposition="outside",
                            marker_color=[PALETTE[i % len(PALETTE)] for i in range(len(bars))]))
        extra = f": {note(v)}" if note else ""
        fig.update_layout(yaxis_title=f"virtual time ({unit})", showlegend=False)
        return theme(fig, f"{title} at compute x{compute:g}, links x{bandwidth:g} (replayed){extra}")

    return explore(draw, {"compute": list(grid["compute"]), "bandwidth": list(grid["bandwidth"])},
                   defaults={"compute": 1.0, "bandwidth": 1.0})
