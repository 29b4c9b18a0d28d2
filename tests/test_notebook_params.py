"""A notebook never overrides its lesson's preset: a parameter of the notebook's parameters cell that names a knob
of the lesson's presets defaults to None ("the preset's value"), so ``preset = "full"`` runs the full preset."""
from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

SOURCES = sorted((Path(__file__).resolve().parents[1] / "notebooks" / "src").glob("[0-9]*.py"))
LAUNCH = re.compile(r"""launch\("(l\d\d\w*)\"""")


def _parameters(path: Path) -> dict[str, ast.AST]:
    """The parameters cell's assignments: name -> default expression."""
    text = path.read_text()
    start = text.index('# %% tags=["parameters"]')
    cell = text[start:text.index("# %%", start + 5)]
    out = {}
    for node in ast.parse(cell).body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = node.value
        elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            out[node.targets[0].id] = node.value
    return out


def _knobs(module) -> set[str]:
    presets = getattr(module, "PRESETS", {})
    return set().union(*(set(p) for p in presets.values())) if presets else set()


@pytest.mark.parametrize("path", [p for p in SOURCES if LAUNCH.search(p.read_text())], ids=lambda p: p.stem)
def test_no_notebook_parameter_shadows_a_preset_knob(path):
    module = importlib.import_module(f"toolkit.lessons.{LAUNCH.search(path.read_text()).group(1)}")
    shadowing = {name: ast.unparse(value) for name, value in _parameters(path).items()
                 if name in _knobs(module) and not (isinstance(value, ast.Constant) and value.value is None)}
    assert not shadowing, (f"{path.name}: parameters that override the preset's {sorted(shadowing)} "
                           f"(defaults {shadowing}); default them to None: the preset's value")
