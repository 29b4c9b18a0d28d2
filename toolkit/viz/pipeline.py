"""Pipeline figures: schedule Gantt charts (simulated or measured), memory held over time, and an
interactive schedule explorer (ipywidgets) that re-simulates as you move its sliders.

    schedule_gantt(sim or spans)   one row per rank, one bar per action (F, B, I, W, F&B, R)
    memory_steps(sim)              stage-chunks of activations each rank holds over the step
    explorer(...)                  schedule, p, m, op costs -> Gantt + memory + bubble/step line, live

Every function returns plain plotly figures (static in exported HTML); only ``explorer`` needs a kernel.
"""
from __future__ import annotations

import plotly.graph_objects as go

from toolkit.pipeline.schedule import SCHEDULES, from_torch, make_schedule
from toolkit.pipeline.simulate import Costs, SimResult, simulate

from . import color_of, gantt, theme

KIND_COLORS = {"I": "#7cb342"}  # input-gradient backward: a lighter green than B (full backward)


def schedule_gantt(source: SimResult | list[dict], title: str = "", label: str = "mb") -> go.Figure:
    """Gantt chart of a simulated step (``SimResult``, time in cost units) or of measured spans
    (``Timeline.to_json()`` dicts from the executor, time in ms)."""
    simulated = isinstance(source, SimResult)
    spans = source.spans if simulated else source
    if not simulated:  # measured: start the axis at the step's first action
        t0 = min(s["start"] for s in source)
        spans = [{**s, "start": s["start"] - t0, "end": s["end"] - t0} for s in source]
    fig = gantt(spans, title=title, label=label, time_unit="s" if simulated else "ms")
    fig.for_each_trace(lambda t: t.update(marker_color=KIND_COLORS[t.name]) if t.name in KIND_COLORS else None)
    if simulated:
        fig.update_layout(xaxis_title="time (cost units)")
    return fig


def memory_steps(sim: SimResult, title: str = "") -> go.Figure:
    """Activation stage-chunks held by each rank over the simulated step."""
    fig = go.Figure()
    for r, curve in enumerate(sim.memory):
        fig.add_trace(go.Scatter(x=[t for t, _ in curve], y=[n for _, n in curve], mode="lines", line_shape="hv",
                                 name=f"rank {r}", line=dict(color=color_of(f"rank {r}", r))))
    fig.update_layout(xaxis_title="time (cost units)", yaxis_title="stage-chunks held")
    return theme(fig, title)


def simulate_named(name: str, p: int, m: int, costs: Costs, **options) -> SimResult:
    """Build schedule ``name`` (``make_schedule`` names, or ``"torch:zbv"`` etc.) and simulate it."""
    kind, _, plain = name.rpartition(":")
    schedule = from_torch(plain, p, m) if kind else make_schedule(name, p, m, **options)
    return simulate(schedule, costs)


def explorer(schedule: str = "dualpipev", p: int = 4, m: int = 8, costs: Costs | None = None):
    """An interactive explorer: pick a schedule, p, m and the op costs; the Gantt chart, the memory held
    and the bubble/step time redraw from the simulator. Returns the ipywidgets box (display it)."""
    import ipywidgets as w

    c = costs or Costs(1, 2, 1)
    names = sorted(SCHEDULES) + ["torch:zbv"]
    ctrl = {
        "schedule": w.Dropdown(options=names, value=schedule, description="schedule"),
        "p": w.IntSlider(value=p, min=1, max=8, description="p (ranks)"),
        "m": w.IntSlider(value=m, min=1, max=32, description="m (micro-b.)"),
        "F": w.FloatSlider(value=c.F, min=0.1, max=5, step=0.1, description="F"),
        "B": w.FloatSlider(value=c.B, min=0.2, max=10, step=0.1, description="B (full)"),
        "W": w.FloatSlider(value=c.W, min=0.1, max=5, step=0.1, description="W (of B)"),
        "overlap": w.FloatSlider(value=(c.fb / (c.F + c.B)), min=0.5, max=1.0, step=0.05,
                                 description="F&B/(F+B)"),
        "comm": w.FloatSlider(value=c.comm, min=0, max=2, step=0.05, description="comm"),
    }
    out = w.Output()

    def redraw(_=None):
        v = {k: x.value for k, x in ctrl.items()}
        out.clear_output(wait=True)
        with out:
            try:
                cost = Costs(v["F"], v["B"], v["W"], FB=v["overlap"] * (v["F"] + v["B"]), comm=v["comm"])
                sim = simulate_named(v["schedule"], v["p"], v["m"], cost)
            except ValueError as err:  # e.g. m too small for the schedule: say why instead of drawing
                print(f"cannot simulate: {err}")
                return
            print(f"step {sim.makespan:.2f}   bubble (worst rank) {sim.bubble:.2f}   "
                  f"bubble fraction {sim.bubble_fraction:.1%}   peak activations per rank (micro-batches) "
                  f"{[round(x, 2) for x in sim.peak_mb]}")
            # plotly's mimetype only: the "notebook" renderer inside an Output widget makes papermill/nbclient
            # wait for its whole timeout
            schedule_gantt(sim, title=f"{v['schedule']}, p={v['p']}, m={v['m']}").show(renderer="plotly_mimetype")
            memory_steps(sim, title="activations held").show(renderer="plotly_mimetype")

    for x in ctrl.values():
        x.observe(redraw, names="value")
    redraw()
    controls = list(ctrl.values())
    return w.VBox([w.HBox(controls[:3]), w.HBox(controls[3:6]), w.HBox(controls[6:]), out])
