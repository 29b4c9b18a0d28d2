"""Notebook sources, builds and checked outputs.

Lessons are written as percent-format Python (``notebooks/src/NN-name.py``: cells start
with ``# %%``, markdown cells with ``# %% [markdown]``, the papermill parameters cell
with ``# %% tags=["parameters"]``) and built into ``notebooks/NN-name.ipynb``.

    python tools/nb.py build   [NAMES...]   # src/*.py -> *.ipynb (outputs cleared)
    python tools/nb.py refresh [NAMES...]   # execute at the smoke preset and keep only the outputs of
                                            # cells marked "# NBVAL_CHECK_OUTPUT" (what nbval compares)
    python tools/nb.py check                # every .ipynb matches its source (used by the tests)

Names are notebook stems like ``00-foundations``; no names = all.

``execute`` is how the project's tools and tests run a notebook with papermill: it refuses a parameter the
notebook does not declare. papermill itself only logs "Passed unknown parameter" and injects the assignment
anyway, so a misspelt or undeclared knob would look set in the executed notebook while the run ignored it.
``suggestions`` reads the items of a notebook's Try section and the knobs they name (checked by
``tests/test_try_lines.py``; ``tests/test_notebooks.py`` runs one item per lesson).
"""
from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

import nbformat

ROOT = Path(__file__).resolve().parents[1]
NB_DIR = ROOT / "notebooks"
SRC_DIR = NB_DIR / "src"
CELL_RE = re.compile(r"^# %%(?P<md> \[markdown\])?(?: tags=(?P<tags>\[.*\]))?\s*$")
CHECK_MARK = "# NBVAL_CHECK_OUTPUT"


def parse(source: str) -> nbformat.NotebookNode:
    """Percent-format text -> notebook (no outputs)."""
    cells, kind, tags, lines = [], None, [], []

    def flush():
        if kind is None:
            return
        text = "\n".join(lines).strip("\n")
        if kind == "markdown":
            text = "\n".join(l[2:] if l.startswith("# ") else l.lstrip("#") for l in text.splitlines())
            cell = nbformat.v4.new_markdown_cell(text)
        else:
            cell = nbformat.v4.new_code_cell(text)
        if tags:
            cell.metadata["tags"] = tags
        cells.append(cell)

    for line in source.splitlines():
        m = CELL_RE.match(line)
        if m:
            flush()
            kind = "markdown" if m.group("md") else "code"
            tags = json.loads(m.group("tags")) if m.group("tags") else []
            lines = []
        elif kind is not None:
            lines.append(line)
    flush()
    seen: dict[str, int] = {}
    for cell in cells:  # ids from the content, not random: rebuilding the same source gives the same file
        digest = hashlib.sha1(f"{cell.cell_type}:{cell.source}".encode()).hexdigest()[:8]
        seen[digest] = seen.get(digest, 0) + 1
        cell.id = digest if seen[digest] == 1 else f"{digest}-{seen[digest]}"
    nb = nbformat.v4.new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    return nb


def parameters(notebook: str | Path) -> list[str]:
    """The names papermill can set in ``notebook``: its cell tagged ``parameters``, in order."""
    from papermill.inspection import inspect_notebook
    return list(inspect_notebook(str(notebook)))


def check_parameters(notebook: str | Path, params: dict) -> None:
    """ValueError naming every key of ``params`` that ``notebook`` does not declare, and the ones it does."""
    known = parameters(notebook)
    unknown = [name for name in params if name not in known]
    if unknown:
        raise ValueError(f"{Path(notebook).stem} has no parameter {', '.join(map(repr, unknown))}; "
                         f"its parameters: {', '.join(known)}")


def execute(notebook: str | Path, output: str | Path, params: dict | None = None, **kwargs):
    """``papermill.execute_notebook`` after ``check_parameters``: an unknown parameter fails before any cell
    runs. ``kwargs`` go to papermill (``cwd`` defaults to the notebook's folder).

    ``output`` is written once, when the run ends: complete, or up to the cell that failed with its traceback
    (papermill's default rewrites the whole notebook before and after every cell, which took 21 s of the
    course on 2 cores: 0.2 s a write once lesson 03's schedule figures are in it). A run that ends without a
    notebook (the kernel died, a cell timed out) leaves no ``output``, never an older run's. The kernel is
    stopped without its interpreter's teardown once the last cell has run (``shutdown_kernel="immediate"``)."""
    import papermill as pm

    from toolkit.runtime.server_process import KERNEL_SERVER_ENV
    check_parameters(notebook, params or {})
    kwargs.setdefault("cwd", str(Path(notebook).parent))
    kwargs.setdefault("progress_bar", False)
    kwargs.setdefault("request_save_on_cell_execute", False)
    if os.environ.get(KERNEL_SERVER_ENV):  # a batch's kernel server (tools/run_all.py)
        kwargs.setdefault("kernel_manager_class", served_kernel_manager())
    kwargs.setdefault("shutdown_kernel", "immediate")  # killed once its last cell has run: the teardown of an
    # interpreter that imported torch took 0.5 s a notebook, and nothing in a lesson's kernel is left to end
    Path(output).unlink(missing_ok=True)
    return pm.execute_notebook(str(notebook), str(output), parameters=params or {}, **kwargs)



def served_kernel_manager():
    """``ServedKernelManager``: a jupyter_client kernel manager whose kernels the batch's kernel server forks
    (``toolkit.runtime.server_process``), or started afresh where it declines (papermill's ``kernel_manager_class``).

    It overrides jupyter_client's private ``_async_launch_kernel`` (jupyter_client 8): a ``make run`` tool, kept
    here, out of the importable package. Were the hook renamed, kernels would start afresh: slower, not wrong."""
    from jupyter_client.manager import AsyncKernelManager

    from toolkit.runtime.caller_start import request
    from toolkit.runtime.server_process import KERNEL_SERVER_ENV

    class ServedKernelManager(AsyncKernelManager):
        async def _async_launch_kernel(self, kernel_cmd: list[str], **kw) -> None:
            path = os.environ.get(KERNEL_SERVER_ENV)
            served = None
            if path and "-m" in kernel_cmd:
                log = Path(path).parent / f"kernel-{self.kernel_id}.log"
                served = request(path, kernel_cmd, kw.get("env") or dict(os.environ), log,
                                 str(kw.get("cwd") or os.getcwd()))
            if served is None:
                return await super()._async_launch_kernel(kernel_cmd, **kw)
            provisioner = self.provisioner  # its process, as LocalProvisioner.launch_kernel would set it
            provisioner.process, provisioner.pid, provisioner.pgid = served, served.pid, None
            provisioner.cwd = kw.get("cwd", os.getcwd())
            self._reconcile_connection_info(provisioner.connection_info)

    return ServedKernelManager

TRY_HEADING = re.compile(r"^#{2,3}\s+(?:\d+\s*·\s*)?(?:Try\b|Something to try\b)", re.I)
NO_VALUE = ...
"""A knob a suggestion names without a value ("raise `m`")."""


class Suggestion(NamedTuple):
    """One item of a notebook's Try section (``## Try``, ``## Try this``, ``## Something to try``).

    ``knobs``: every span in backticks that looks like a knob, a name (`m`) or an assignment (`m = 8`,
    `zipf_s=0`), as ``{name: value}`` (the first value the text gives it, ``NO_VALUE`` for a bare name).
    ``how``: "explorer" or "code edit" when the text says so (its knobs are then not parameters), else
    "parameters"."""

    text: str
    knobs: dict
    how: str


def knobs(text: str) -> dict:
    """The knob-like spans in backticks of ``text`` (see ``Suggestion.knobs``)."""
    found: dict = {}
    for span in re.findall(r"`([^`]+)`", text):
        try:
            body = ast.parse(span.strip()).body
        except SyntaxError:
            continue
        node = body[0] if len(body) == 1 else None
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Name):
            found.setdefault(node.value.id, NO_VALUE)
        elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                value = ast.literal_eval(node.value)
            except ValueError:
                value = NO_VALUE
            if found.get(node.targets[0].id, NO_VALUE) is NO_VALUE:
                found[node.targets[0].id] = value
    return found


def suggestions(name: str) -> list[Suggestion]:
    """The items of notebook ``name``'s Try section, read from its source (``notebooks/src/name.py``)."""
    items: list[list[str]] = []
    for cell in parse((SRC_DIR / f"{name}.py").read_text()).cells:
        inside = False
        for line in cell.source.splitlines() if cell.cell_type == "markdown" else []:
            if line.startswith("#"):
                inside = bool(TRY_HEADING.match(line))
            elif inside and line.startswith("- "):
                items.append([line[2:]])
            elif inside and line.startswith("  ") and items:
                items[-1].append(line.strip())
    out = []
    for lines in items:
        text = " ".join(lines)
        how = ("explorer" if re.search(r"\bexplorer\b", text) else
               "code edit" if re.search(r"\bcode edit\b", text, re.I) else "parameters")
        out.append(Suggestion(text, knobs(text), how))
    return out


def _names(args: list[str]) -> list[str]:
    return args or sorted(p.stem for p in SRC_DIR.glob("*.py"))


def build(names: list[str]) -> None:
    for name in _names(names):
        nb = parse((SRC_DIR / f"{name}.py").read_text())
        target = NB_DIR / f"{name}.ipynb"
        if target.exists():  # keep the checked outputs of cells whose source did not change
            old = {c.source: c for c in nbformat.read(target, as_version=4).cells if c.cell_type == "code"}
            for cell in nb.cells:
                if cell.cell_type == "code" and CHECK_MARK in cell.source and cell.source in old:
                    cell.outputs = old[cell.source].get("outputs", [])
                    cell.execution_count = old[cell.source].get("execution_count")
        nbformat.write(nb, target)
        print(f"built {target.relative_to(ROOT)}")


def refresh(names: list[str]) -> None:
    os.environ.update(TOOLKIT_PRESET="smoke", TOOLKIT_PLAIN_PROGRESS="1")
    for name in _names(names):
        target = NB_DIR / f"{name}.ipynb"
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / target.name
            execute(target, out)
            executed = nbformat.read(out, as_version=4)
        nb = nbformat.read(target, as_version=4)
        ran = {c.source: c for c in executed.cells if c.cell_type == "code"}
        for cell in nb.cells:
            if cell.cell_type == "code":
                keep = CHECK_MARK in cell.source and cell.source in ran
                cell.outputs = [_strip(o) for o in ran[cell.source].outputs] if keep else []
                cell.execution_count = ran[cell.source].execution_count if keep else None  # nbval skips unrun cells
        nbformat.write(nb, target)
        print(f"refreshed {target.relative_to(ROOT)}")


def _strip(output):
    output.pop("execution_count", None) if output.get("output_type") != "execute_result" else None
    output.get("metadata", {}).clear() if isinstance(output.get("metadata"), dict) else None
    return output


def check() -> int:
    bad = []
    for name in _names([]):
        target = NB_DIR / f"{name}.ipynb"
        want = [c.source for c in parse((SRC_DIR / f"{name}.py").read_text()).cells]
        have = [c.source for c in nbformat.read(target, as_version=4).cells] if target.exists() else None
        if want != have:
            bad.append(name)
    if bad:
        print("out of date with notebooks/src (run: python tools/nb.py build):", ", ".join(bad))
    return 1 if bad else 0


if __name__ == "__main__":
    command, *rest = sys.argv[1:] or ["build"]
    if command == "build":
        build(rest)
    elif command == "refresh":
        refresh(rest)
    elif command == "check":
        sys.exit(check())
    else:
        sys.exit(__doc__)
