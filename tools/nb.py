"""Notebook sources, builds and checked outputs.

Lessons are written as percent-format Python (``notebooks/src/NN-name.py``: cells start
with ``# %%``, markdown cells with ``# %% [markdown]``, the papermill parameters cell
with ``# %% tags=["parameters"]``) and built into ``notebooks/NN-name.ipynb``.

    python tools/nb.py build   [NAMES...]   # src/*.py -> *.ipynb (outputs cleared)
    python tools/nb.py refresh [NAMES...]   # execute at the smoke preset and keep only the outputs of
                                            # cells marked "# NBVAL_CHECK_OUTPUT" (what nbval compares)
    python tools/nb.py check                # every .ipynb matches its source (used by the tests)

Names are notebook stems like ``00-foundations``; no names = all.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import tempfile
from pathlib import Path

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
    import papermill as pm
    os.environ.update(TOOLKIT_PRESET="smoke", TOOLKIT_PLAIN_PROGRESS="1")
    for name in _names(names):
        target = NB_DIR / f"{name}.ipynb"
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / target.name
            pm.execute_notebook(str(target), str(out), cwd=str(NB_DIR), progress_bar=False)
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
