"""What the course's JupyterLab runs besides the kernels: a pre-save hook that keeps explorers alive in a saved
notebook.

JupyterLab's plotly extension (``jupyterlab-plotly``) draws a figure from plotly's mimetype and then stores a PNG
snapshot of it beside the figure in the notebook (``image/png``). When the notebook is opened again, its renderer
shows that snapshot *instead of* the figure when there is one: every figure of a saved lesson came back as a static
image and the precomputed explorers (plotly sliders and dropdowns) no longer responded. Trust plays no part: the
plotly renderer is a safe one, and the notebooks ``make run`` writes (papermill, no browser) carry no snapshot.

``drop_plotly_snapshots`` is a ``ContentsManager.pre_save_hook``: before a notebook is written it removes
``image/png`` from every output that also holds a plotly figure, so the figure is drawn from its data when the
notebook is opened again. ``make lab`` passes it; ``make env`` installs it for every ``jupyter lab`` of the
virtual environment (``python -m toolkit.jupyter install``: a JSON file in
``<sys.prefix>/etc/jupyter/jupyter_server_config.d/``). Importing this module imports nothing heavy.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

PLOTLY_MIME = "application/vnd.plotly.v1+json"
HOOK = "toolkit.jupyter.drop_plotly_snapshots"
CONFIG = {"ContentsManager": {"pre_save_hook": HOOK}}


def drop_plotly_snapshots(model: dict, **kwargs) -> int:
    """Remove the ``image/png`` snapshot from every output of a notebook ``model`` (a contents model, or a notebook
    dict) that holds a plotly figure; returns how many were removed. Other outputs and other files are left as
    they are."""
    content = model.get("content") if model.get("type") == "notebook" else model if "cells" in model else None
    removed = 0
    for cell in (content or {}).get("cells", []):
        for output in cell.get("outputs", []) or []:
            data = output.get("data") or {}
            if PLOTLY_MIME in data and data.pop("image/png", None) is not None:
                removed += 1
    return removed


def install(prefix: str | Path = sys.prefix) -> Path:
    """Write the server config that runs ``drop_plotly_snapshots`` on every save, for this environment's
    ``jupyter lab``; returns its path."""
    path = Path(prefix) / "etc" / "jupyter" / "jupyter_server_config.d" / "llm-scale-toolkit.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(CONFIG, indent=1) + "\n")
    return path


if __name__ == "__main__":
    if sys.argv[1:] != ["install"]:
        sys.exit("usage: python -m toolkit.jupyter install")
    print(f"wrote {install()}")
