"""Pipeline figures: schedule Gantt charts (simulated or measured), memory held over time, and a
schedule explorer that re-simulates as you move its controls.

    schedule_gantt(sim or spans)   one row per rank, one bar per action (F, B, I, W, F&B, R)
    memory_steps(sim)              stage-chunks of activations each rank holds over the step
    schedule_view(sim)             both, one above the other (one figure)
    explorer(...)                  schedule, p, m, op costs -> schedule_view, live and precomputed

Every function returns plain plotly figures; ``explorer`` is a ``toolkit.viz.explore`` explorer (live
with a kernel, precomputed for the HTML book).
"""
from __future__ import annotations

import plotly.graph_objects as go

from toolkit.pipeline.schedule import SCHEDULES, from_torch, make_schedule, torch_order_missing
from toolkit.pipeline.simulate import Costs, SimResult, simulate

from . import Figure, color_of, gantt, theme

KIND_COLORS = {"I": "#7cb342"}  # input-gradient backward: a lighter green than B (full backward)


def schedule_gantt(source: SimResult | list[dict], title: str = "", label: str = "mb",
                   unit: str = "cost units") -> go.Figure:
    """Gantt chart of a simulated step (``SimResult``: its times in the unit of the costs it was simulated with,
    ``unit``; "cost units" when they are not times) or of measured spans (``Timeline.to_json()`` dicts from the
    executor, shown in ms)."""
    simulated = isinstance(source, SimResult)
    spans = source.spans if simulated else source
    if not simulated:  # measured: start the axis at the step's first action
        t0 = min(s["start"] for s in source)
        spans = [{**s, "start": s["start"] - t0, "end": s["end"] - t0} for s in source]
    fig = gantt(spans, title=title, label=label, time_unit="s" if simulated else "ms",  # simulated: as they are
                unit_label=unit if simulated else None)
    fig.for_each_trace(lambda t: t.update(marker_color=KIND_COLORS[t.name]) if t.name in KIND_COLORS else None)
    return fig


def memory_steps(sim: SimResult, title: str = "", unit: str = "cost units") -> go.Figure:
    """Activation stage-chunks held by each rank over the simulated step (time in ``unit``, as ``schedule_gantt``)."""
    fig = Figure()
    for r, curve in enumerate(sim.memory):
        fig.add_trace(go.Scatter(x=[t for t, _ in curve], y=[n for _, n in curve], mode="lines", line_shape="hv",
                                 name=f"rank {r}", line=dict(color=color_of(f"rank {r}", r))))
    fig.update_layout(xaxis_title=f"time ({unit})", yaxis_title="stage-chunks held")
    return theme(fig, title)


def simulate_named(name: str, p: int, m: int, costs: Costs, **options) -> SimResult:
    """Build schedule ``name`` (``make_schedule`` names, or ``"torch:zbv"`` etc.) and simulate it."""
    kind, _, plain = name.rpartition(":")
    schedule = from_torch(plain, p, m) if kind else make_schedule(name, p, m, **options)
    return simulate(schedule, costs)


def schedule_view(sim: SimResult, title: str = "", unit: str = "cost units") -> go.Figure:
    """The simulated step's Gantt chart above the activation chunks each rank holds (one figure, shared x)."""
    from plotly.subplots import make_subplots

    chart, held = schedule_gantt(sim, unit=unit), memory_steps(sim, unit=unit)
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, row_heights=[0.64, 0.36], vertical_spacing=0.07,
                        figure=Figure())
    for trace in chart.data:
        fig.add_trace(trace, row=1, col=1)
    for trace in held.data:
        fig.add_trace(trace.update(showlegend=False), row=2, col=1)
    fig.update_layout(barmode="overlay", bargap=0.25)
    fig.update_yaxes(categoryorder="array", categoryarray=chart.layout.yaxis.categoryarray, row=1, col=1)
    fig.update_yaxes(title_text="chunks held", row=2, col=1)
    fig.update_xaxes(title_text=f"time ({unit})", row=2, col=1)
    return theme(fig, title, height=(chart.layout.height or 320) + 200)


def explorer(schedule: str = "dualpipev", p: int = 4, m: int = 8, costs: Costs | None = None):
    """Pick a schedule, p, m and the op costs; the Gantt chart, the memory held and the bubble redraw from
    the simulator. Returns a ``toolkit.viz.Explorer``: in a notebook it shows the live (ipywidgets)
    explorer and the precomputed plotly one that also works in the HTML book."""
    from . import explore

    c = costs or Costs(1, 2, 1)

    def draw(schedule: str, p: int, m: int, F: float, B: float, W: float, overlap: float, comm: float):
        cost = Costs(F, B, W, FB=overlap * (F + B), comm=comm)
        sim = simulate_named(schedule, p, m, cost)
        return schedule_view(sim, title=f"{schedule}, p={p}, m={m}: step {sim.makespan:.2f} cost units, bubble "
                                        f"{sim.bubble_fraction:.1%}, peak chunks {max(sim.peak_mb):.2f}")

    def grid(values: list, value):
        return sorted(set(values) | {value})

    overlap = round((c.fb / (c.F + c.B)) * 20) / 20
    controls = {
        "schedule": sorted(SCHEDULES) + ([] if torch_order_missing("zbv") else ["torch:zbv"]),  # torch >= 2.8
        "p": grid([2, 3, 4, 6, 8], p),
        "m": grid([2, 4, 6, 8, 12, 16, 24, 32], m),
        "F": grid([0.5, 1.0, 1.5, 2.0], c.F),
        "B": grid([1.0, 2.0, 3.0, 4.0], c.B),
        "W": grid([0.25, 0.5, 1.0, 1.5], c.W),
        "overlap": grid([0.5, 0.6, 0.7, 0.8, 0.9, 1.0], overlap),
        "comm": grid([0.0, 0.1, 0.25, 0.5, 1.0], c.comm),
    }
    return explore(draw, controls, defaults={"schedule": schedule, "p": p, "m": m, "F": c.F, "B": c.B, "W": c.W,
                                             "overlap": overlap, "comm": c.comm})
