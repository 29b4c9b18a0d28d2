"""What every lesson stands on: launch, process groups, comm ledger, memory, timeline, bench.

The rest is imported on first use: ``from toolkit.runtime import launch`` does not import torch. (``launch``
is bound here eagerly: a lazy name would lose to the submodule of the same name.)
"""
from __future__ import annotations

import importlib

from .caller_watch import kill_tree
from .launch import LaunchError, LaunchTimeout, RankResults, launch  # light: torch is imported later

_WHERE = {
    "Context": "context", "init_context": "context", "resolve_backend": "context", "seed_everything": "context",
    "ProcessGrid": "grid", "validate_grid": "grid",
    "LaunchError": "launch", "LaunchTimeout": "launch", "RankResults": "launch", "launch": "launch",
    "kill_tree": "caller_watch",
    "CommLedger": "ledger", "CommRecord": "ledger", "wire_bytes": "ledger",
    "CATEGORIES": "memory", "MemoryTracker": "memory",
    "Span": "timeline", "Timeline": "timeline", "merge": "timeline",
}
__all__ = list(_WHERE)


def __getattr__(name: str):
    if name in _WHERE:
        value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
