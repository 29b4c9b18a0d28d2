"""llm-scale-toolkit: the optimizations used to train LLMs across many accelerators, run for real.

``import toolkit`` imports nothing heavy; every name is imported on first use. ``toolkit.doc("name")``
prints an entry (shapes, what runs on every rank, an example) with the object's docstring.
"""
from __future__ import annotations

import importlib

from . import api as _api
from .runtime.launch import LaunchError, LaunchTimeout, RankResults, launch  # light (no torch)

__version__ = "0.1.0"
__doc__ += "\nThe public API (``toolkit.api``):\n" + _api.overview()
__all__ = [e.name for e in _api.ENTRIES] + ["RankResults", "doc", "__version__"]


def doc(name: str) -> None:
    """Print the public API entry of ``name`` (e.g. ``toolkit.doc("PipelineExecutor")``)."""
    print(_api.describe(name))


def __getattr__(name: str):
    entry = _api.BY_NAME.get(name)
    if entry is None:
        try:  # subpackages: toolkit.pipeline, toolkit.comm, ...
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module 'toolkit' has no attribute {name!r}") from None
    value = entry.load()
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
