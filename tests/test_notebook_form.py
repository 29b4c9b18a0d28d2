"""The notebooks as a learner meets them: parameters papermill can read and show, text that fits the page.

- ``papermill --help-notebook`` lists every parameter of every notebook with a type (no "Unable to parse",
  no "Unknown type"): the parameters cell uses annotations (``world_size: int = 2``) and its help comments
  contain no ``=`` (papermill gives up on a line with two). Every notebook declares what ``run_all -p`` may
  pass to all of them (``world_size``, ``preset``, ``backend``, ``cluster``), and a parameter a notebook does
  not declare is refused before anything runs (``tools/nb.py``'s ``execute``, ``tools/run_all.py``).
- Code blocks (diagrams) and tables in markdown cells fit 100 columns, so they do not wrap in JupyterLab's
  default layout with the file browser open.
"""
from __future__ import annotations

import ast
import importlib.util
import logging
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
IDS = [p.stem for p in NOTEBOOKS]
WIDTH = 100

_spec = importlib.util.spec_from_file_location("nb_tool", ROOT / "tools" / "nb.py")
nb_tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(nb_tool)


def _parameters_cell(nb) -> str:
    cells = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(cells) == 1, "exactly one cell tagged 'parameters'"
    return cells[0].source


def _assigned(source: str) -> list[str]:
    names = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.append(node.target.id)
        elif isinstance(node, ast.Assign):
            names += [t.id for t in node.targets if isinstance(t, ast.Name)]
    return names


def inspect(path: Path, caplog) -> tuple[list[dict], str]:
    """papermill's own inspection (what ``papermill --help-notebook`` prints) and the warnings it logged."""
    from papermill.inspection import inspect_notebook
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="papermill"):
        params = list(inspect_notebook(str(path)).values())
    return params, caplog.text


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=IDS)
def test_papermill_shows_every_parameter_with_a_type(notebook, caplog):
    source = _parameters_cell(nbformat.read(notebook, as_version=4))
    params, warnings = inspect(notebook, caplog)
    assert "Unable to parse" not in warnings, warnings
    untyped = [p["name"] for p in params if p["inferred_type_name"] == "None"]  # --help-notebook: "Unknown type"
    assert not untyped, f"papermill shows 'Unknown type' for {untyped}: annotate them (world_size: int = 2)"
    listed = [p["name"] for p in params]
    assert listed == _assigned(source), f"papermill lists {listed}; the cell assigns {_assigned(source)}"
    for name in ("world_size", "preset", "backend", "cluster"):  # what run_all -p may pass to every notebook
        assert name in listed, f"{notebook.stem}: no {name!r} parameter"


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=IDS)
def test_the_parameters_cell_runs_on_its_own(notebook):
    """papermill runs it first, before any import of the notebook's (an annotation needs its own imports)."""
    exec(compile(_parameters_cell(nbformat.read(notebook, as_version=4)), notebook.name, "exec"), {})


def test_an_unknown_parameter_is_refused_before_any_cell_runs(tmp_path):
    """papermill only logs "Passed unknown parameter" and injects it; tools/nb.py's execute refuses it."""
    with pytest.raises(ValueError, match=r"no parameter 'mm'; its parameters: world_size, preset, backend"):
        nb_tool.execute(NOTEBOOKS[0], tmp_path / "out.ipynb", {"preset": "smoke", "mm": 8})
    assert not (tmp_path / "out.ipynb").exists()


def test_run_all_refuses_an_unknown_parameter_before_running(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "run_all.py"), "--only", "03", "-p", "mm=8",
                          "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "03-dualpipev has no parameter 'mm'; its parameters: world_size, preset, backend, cluster" in out.stderr
    assert "[1/1]" not in out.stdout and not (tmp_path / "out").exists(), "nothing runs, nothing is written"


def test_run_all_reports_where_a_notebooks_time_went(tmp_path):
    sys.path.insert(0, str(ROOT / "tools"))
    from run_all import slowest_cells
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# t")] + [
        nbformat.v4.new_code_cell(src, metadata={"papermill": {"duration": d}})
        for src, d in (("import x", 1.25), ("# why\nresults = launch(...)", 30.0), ("plot()", 2.0))])
    nbformat.write(nb, tmp_path / "run.ipynb")
    assert slowest_cells(tmp_path / "run.ipynb", 2) == [{"cell": 2, "seconds": 30.0, "code": "results = launch(...)"},
                                                        {"cell": 3, "seconds": 2.0, "code": "plot()"}]
    assert slowest_cells(tmp_path / "missing.ipynb") == []


def test_papermill_cli_lists_a_notebook():
    out = subprocess.run([sys.executable, "-m", "papermill", "--help-notebook", str(NOTEBOOKS[0])],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "world_size: int (default" in out.stdout and "Unknown type" not in out.stdout, out.stdout
    assert "Unable to parse" not in out.stdout + out.stderr


def test_the_inspection_check_can_fail(tmp_path, caplog):
    """A comment with '=' (the line is dropped) and a missing annotation are both seen."""
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "world_size = 4  # two nodes (world_size = 2: one)\nsteps = 3", metadata={"tags": ["parameters"]})])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path = tmp_path / "bad.ipynb"
    nbformat.write(nb, path)
    params, warnings = inspect(path, caplog)
    assert "Unable to parse" in warnings
    assert [(p["name"], p["inferred_type_name"]) for p in params] == [("steps", "None")]


def wide_lines(markdown: str, width: int = WIDTH) -> list[str]:
    """Lines of fenced code blocks and tables in a markdown text that are wider than ``width`` columns."""
    bad, fenced = [], False
    for line in markdown.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            continue
        if (fenced or line.lstrip().startswith("|")) and len(line) > width:
            bad.append(line)
    return bad


def test_wide_lines_finds_diagrams_and_tables():
    text = "prose " * 40 + "\n```\n" + "─" * 101 + "\n" + "x" * 100 + "\n```\n| " + "a" * 99 + " |\n"
    assert wide_lines(text) == ["─" * 101, "| " + "a" * 99 + " |"]


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=IDS)
def test_markdown_diagrams_and_tables_fit_100_columns(notebook):
    nb = nbformat.read(notebook, as_version=4)
    bad = [line for c in nb.cells if c.cell_type == "markdown" for line in wide_lines(c.source)]
    assert not bad, f"{len(bad)} lines wider than {WIDTH} columns:\n" + "\n".join(bad)
