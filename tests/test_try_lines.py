"""Every Try suggestion of every notebook is doable as written.

A notebook's Try section (``## Try``, ``## Try this``, ``## Something to try``) is a list of suggestions,
read by ``tools/nb.py``'s ``suggestions``. In each one, a span in backticks that looks like a knob (a name,
`m`, or an assignment, `m = 8`) must be

- a parameter of the notebook: papermill lists it, its value has the parameter's type, and the notebook uses
  it after the parameters cell (a parameter no cell reads would look set and change nothing), or
- a control of an explorer, when the suggestion says "explorer", or
- part of a code edit, when the suggestion says "code edit".

A file path or a ``toolkit.`` name a suggestion points to must exist. Every lesson has a suggestion with a
parameter and a value: ``tests/test_notebooks.py`` runs one per lesson at the smoke preset.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "notebooks" / "src"
NAMES = sorted(p.stem for p in SRC.glob("*.py"))
LESSONS = [n for n in NAMES if re.match(r"\d", n)]

_spec = importlib.util.spec_from_file_location("nb_tool", ROOT / "tools" / "nb.py")
nb_tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(nb_tool)

TYPES = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,), "list": (list,), "dict": (dict,)}


@functools.cache
def parameters(name: str) -> dict[str, str]:
    """``{name: type}`` of the notebook's parameters, as papermill infers them (``Optional[int]``, ``str``)."""
    from papermill.inspection import inspect_notebook
    return {p["name"]: p["inferred_type_name"] for p in inspect_notebook(str(ROOT / "notebooks" / f"{name}.ipynb"))
            .values()}


def fits(value, type_name: str) -> bool:
    """Whether a literal from a Try line is a value papermill can give a parameter of this annotated type."""
    optional = re.fullmatch(r"Optional\[(\w+)\]", type_name)
    if value is None:
        return bool(optional)
    kinds = TYPES.get(optional.group(1) if optional else type_name, (object,))
    return isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)


def code_after_parameters(name: str) -> str:
    cells = nb_tool.parse((SRC / f"{name}.py").read_text()).cells
    at = next(i for i, c in enumerate(cells) if "parameters" in c.metadata.get("tags", []))
    return "\n".join(c.source for c in cells[at + 1:] if c.cell_type == "code")


@functools.cache
def explorer_controls() -> set[str]:
    """Names written as dict keys (``"name":``) in the explorers' code: toolkit/viz and the notebooks' cells that
    call an explorer."""
    texts = [p.read_text() for p in (ROOT / "toolkit" / "viz").glob("*.py")]
    texts += [c.source for n in NAMES for c in nb_tool.parse((SRC / f"{n}.py").read_text()).cells
              if c.cell_type == "code" and "explore" in c.source]
    return {m for t in texts for m in re.findall(r'"(\w+)":', t)}


@pytest.mark.parametrize("name", NAMES)
def test_every_notebook_has_a_try_section_of_items(name):
    source = (SRC / f"{name}.py").read_text()
    assert nb_tool.suggestions(name), f"{name}: no items under a '## Try' heading"
    assert not re.search(r"\*\*Try:?\*\*", source), f"{name}: a **Try:** paragraph; write it as '## Try this' items"


@pytest.mark.parametrize("name", NAMES)
def test_every_knob_is_a_parameter_an_explorer_control_or_a_code_edit(name):
    params, controls, bad = parameters(name), explorer_controls(), []
    for s in nb_tool.suggestions(name):
        for knob, value in s.knobs.items():
            if s.how == "parameters" and knob not in params:
                bad.append(f"`{knob}` is not a parameter (it has {', '.join(params)}) and the item says neither "
                           f"'explorer' nor 'code edit': {s.text!r}")
            elif s.how == "parameters" and value is not nb_tool.NO_VALUE and not fits(value, params[knob]):
                bad.append(f"`{knob} = {value!r}` does not fit its parameter's type {params[knob]}: {s.text!r}")
            elif s.how == "explorer" and knob not in controls:
                bad.append(f"`{knob}` is not a control of any explorer: {s.text!r}")
    assert not bad, f"{name}:\n" + "\n".join(bad)


@pytest.mark.parametrize("name", NAMES)
def test_every_parameter_reaches_the_code(name):
    code = code_after_parameters(name)
    dead = [p for p in parameters(name) if not re.search(rf"\b{p}\b", code)]
    assert not dead, f"{name}: no cell after the parameters cell reads {dead}"


@pytest.mark.parametrize("name", NAMES)
def test_paths_and_toolkit_names_a_suggestion_points_to_exist(name):
    bad = []
    for s in nb_tool.suggestions(name):
        for span in re.findall(r"`([^`]+)`", s.text):
            if re.fullmatch(r"[\w./-]+\.(?:py|sh|md)", span) and not (ROOT / span).exists():
                bad.append(f"no file {span}")
            for dotted in re.findall(r"\btoolkit(?:\.\w+)+", span):
                if not resolves(dotted):
                    bad.append(f"{dotted} does not resolve")
    assert not bad, f"{name}: " + "; ".join(bad)


def resolves(dotted: str) -> bool:
    """``toolkit.moe.echo.plan_clones``: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


@pytest.mark.parametrize("name", LESSONS)
def test_every_lesson_suggests_a_parameter_with_a_value(name):
    """What tests/test_notebooks.py can run: at least one item that sets a parameter to a value."""
    params = parameters(name)
    runnable = [s for s in nb_tool.suggestions(name) if s.how == "parameters"
                and any(k in params and v is not nb_tool.NO_VALUE for k, v in s.knobs.items())]
    assert runnable, f"{name}: no Try item sets a parameter to a value"


# ---- the parser itself ----------------------------------------------------------------------------------------

def test_suggestions_are_read_and_classified(tmp_path, monkeypatch):
    source = ("# %% [markdown]\n# ## Try this\n#\n# - `m = 8` and `keep`: the peak falls; see `toolkit.pipeline`.\n"
              "# - In the explorer, the `overlap` control at 0.5.\n# - A code edit: `hi = i >> 16` in\n"
              "#   `toolkit/memory/param_reuse.py`, `split(x)`.\n# - Run `python benchmarks/bench_kernels.py`.\n"
              "#\n# ## Sources\n#\n# - `not_a_suggestion = 1`\n")
    monkeypatch.setattr(nb_tool, "SRC_DIR", tmp_path)
    (tmp_path / "selftest.py").write_text(source)
    found = nb_tool.suggestions("selftest")
    assert [(s.how, s.knobs) for s in found] == [
        ("parameters", {"m": 8, "keep": nb_tool.NO_VALUE}), ("explorer", {"overlap": nb_tool.NO_VALUE}),
        ("code edit", {"hi": nb_tool.NO_VALUE}), ("parameters", {})]
    assert found[2].text.endswith("`toolkit/memory/param_reuse.py`, `split(x)`.")


def test_type_fit_and_name_resolution_can_fail():
    assert fits(0, "float") and fits(None, "Optional[int]") and fits([1], "Optional[list]")
    assert not fits("8", "int") and not fits(None, "int") and not fits(True, "int") and not fits(1.5, "int")
    assert resolves("toolkit.moe.echo.plan_clones") and not resolves("toolkit.moe.echo.no_such_name")
