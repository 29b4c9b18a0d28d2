"""toolkit.viz.explore: one explorer helper, live (ipywidgets) and precomputed (plotly controls, no kernel)."""
from __future__ import annotations

import plotly.graph_objects as go
import pytest

from toolkit import viz
from toolkit.viz.explore import precompute

CONTROLS = {"kind": ["a", "b", "c"], "n": [1, 2, 4, 8]}


def draw(kind: str, n: int) -> go.Figure:
    fig = go.Figure([go.Scatter(x=list(range(n)), y=[n] * n, name=f"{kind}{n}")])
    if kind == "c":
        fig.add_trace(go.Bar(x=[0], y=[1], name="extra"))   # states may have different numbers of traces
    return viz.theme(fig, title=f"{kind} {n}")


def names_shown(fig: go.Figure, visible: list) -> list[str]:
    return [t.name for t, v in zip(fig.data, visible) if v]


def test_one_state_per_value_of_each_control_with_the_others_at_defaults():
    calls = []
    fig = precompute(lambda **v: calls.append(v) or draw(**v), CONTROLS, defaults={"n": 2})
    assert calls == [{"kind": "a", "n": 2}, {"kind": "b", "n": 2}, {"kind": "c", "n": 2},
                     {"kind": "a", "n": 1}, {"kind": "a", "n": 4}, {"kind": "a", "n": 8}]
    assert fig.layout.meta["explorer"] == {"controls": {"kind": ["a", "b", "c"], "n": ["1", "2", "4", "8"]},
                                           "defaults": {"kind": "a", "n": "2"}, "states": 6}
    assert names_shown(fig, [t.visible for t in fig.data]) == ["a2"]          # the defaults are shown first
    (menu,), (slider,) = fig.layout.updatemenus, fig.layout.sliders
    assert [b.label for b in menu.buttons] == ["kind: a", "kind: b", "kind: c"] and menu.active == 0
    assert [s.label for s in slider.steps] == ["1", "2", "4", "8"] and slider.active == 1
    c = menu.buttons[2].args
    assert names_shown(fig, c[0]["visible"]) == ["c2", "extra"]
    assert c[1]["sliders[0].active"] == 1                                       # the slider goes back to n=2
    assert "kind=c, others at defaults" in c[1]["title"]["text"]
    eight = slider.steps[3].args
    assert names_shown(fig, eight[0]["visible"]) == ["a8"] and eight[1]["updatemenus[0].active"] == 0
    assert names_shown(fig, slider.steps[1].args[0]["visible"]) == ["a2"]


def test_a_draw_that_refuses_settings_becomes_a_message():
    def picky(kind, n):
        if n > 4:
            raise ValueError("n must be at most 4")
        return draw(kind, n)
    fig = precompute(picky, CONTROLS)
    args = fig.layout.sliders[0].steps[3].args
    assert "cannot draw" in args[1]["title"]["text"]
    assert args[1]["annotations"][0]["text"] == "cannot draw: n must be at most 4"


@pytest.mark.parametrize("controls, defaults, words", [
    ({}, None, "controls"),
    ({"n": []}, None, "controls['n']"),
    (CONTROLS, {"m": 1}, "defaults: ['m']"),
    (CONTROLS, {"n": 3}, "defaults['n'] = 3"),
])
def test_bad_controls_name_the_parameter(controls, defaults, words):
    with pytest.raises(ValueError, match=None) as err:
        viz.explore(draw, controls, defaults)
    assert words in str(err.value)


def test_live_widget_has_readable_labels_and_redraws():
    import ipywidgets as w
    explorer = viz.explore(draw, CONTROLS)
    box = explorer.widget()
    controls = box.children[1].children
    assert [c.description for c in controls] == ["kind", "n"]
    assert all(c.style.description_width == "initial" for c in controls)   # no "m (micro-…" cut
    assert isinstance(controls[0], w.Dropdown) and isinstance(controls[1], w.SelectionSlider)
    assert "toolkit-explorer" in box._dom_classes


def test_heatmap_labels_that_look_like_numbers_stay_labels():
    """["32", "64", "tensor"] on a numeric axis puts "tensor" at NaN: the column vanishes, the browser logs errors."""
    fig = viz.heatmap([[1, 2, 3]], x=["32", "64", "tensor"], y=["int8"])
    assert fig.layout.xaxis.type == "category" and fig.layout.yaxis.type == "category"
    assert viz.heatmap([[1, 2]], x=[0.5, 1.5]).layout.xaxis.type is None   # numbers stay numbers


def test_a_figure_is_plotlys_mimetype_bundle():
    import plotly.io as pio
    fig = viz.bars([{"x": "a", "y": 1.5}, {"x": "b", "y": 2.0}], x="x", y="y", title="t")
    assert isinstance(fig, viz.Figure) and isinstance(fig, go.Figure)
    assert viz.mime_bundle(fig) == pio.renderers["plotly_mimetype"].to_mimebundle(fig.to_dict())


def test_a_kernel_draws_a_figure_without_plotlys_renderer_registry():
    """show() and a figure as a cell's value emit the mimetype only, and never import nbformat (1.5-3 s/kernel)."""
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3")
    try:
        outputs = []

        def run(code: str) -> None:
            reply = kc.execute_interactive(code, timeout=120, output_hook=outputs.append)
            assert reply["content"]["status"] == "ok", reply["content"]

        run("from toolkit import viz\nfig = viz.lines({'loss': [2.0, 1.5]}, title='t')")
        run("fig.show()")
        run("fig")
        run("import sys, os; print(sorted(m for m in ('nbformat', 'plotly.io._renderers') if m in sys.modules), "
            "os.environ['PLOTLY_RENDERER'])")
        shown = [m["content"]["data"] for m in outputs if m["msg_type"] in ("display_data", "execute_result")]
        assert len(shown) == 2 and all(set(d) == {viz.PLOTLY_MIME} for d in shown)
        printed = "".join(m["content"]["text"] for m in outputs if m["msg_type"] == "stream")
        assert printed.strip() == "[] plotly_mimetype"
    finally:
        km.shutdown_kernel(now=True)


def test_saving_drops_the_plotly_png_snapshot_that_would_replace_the_figure(tmp_path):
    """toolkit.jupyter's pre-save hook (make lab): an output with a plotly figure loses the PNG snapshot JupyterLab's
    plotly extension stored beside it (reopened, the extension shows that image instead of the figure); an image
    of its own stays; the config `make env` installs names the hook."""
    import json

    from toolkit import jupyter
    figure = {"output_type": "display_data", "data": {jupyter.PLOTLY_MIME: {"data": []}, "image/png": "iVBO..."}}
    image = {"output_type": "display_data", "data": {"image/png": "iVBO..."}}
    model = {"type": "notebook", "content": {"cells": [{"cell_type": "code", "outputs": [figure, image]},
                                                       {"cell_type": "markdown", "source": "x"}]}}
    assert jupyter.drop_plotly_snapshots(model, path="x.ipynb") == 1
    assert figure["data"] == {jupyter.PLOTLY_MIME: {"data": []}} and "image/png" in image["data"]
    assert jupyter.drop_plotly_snapshots({"type": "file", "content": "text"}) == 0
    path = jupyter.install(tmp_path)
    hook = "toolkit.jupyter.drop_plotly_snapshots"
    assert json.loads(path.read_text()) == {"ContentsManager": {"pre_save_hook": hook}}
    assert path.parent == tmp_path / "etc" / "jupyter" / "jupyter_server_config.d"
