"""What every lesson stands on: launch, process groups, comm ledger, memory, timeline, bench."""
from .context import Context, init_context, resolve_backend, seed_everything
from .grid import ProcessGrid, validate_grid
from .launch import LaunchError, LaunchTimeout, RankResults, kill_tree, launch
from .ledger import CommLedger, CommRecord, wire_bytes
from .memory import CATEGORIES, MemoryTracker
from .timeline import Span, Timeline, merge

__all__ = ["Context", "init_context", "resolve_backend", "seed_everything", "ProcessGrid", "validate_grid",
           "LaunchError", "LaunchTimeout", "RankResults", "kill_tree", "launch", "CommLedger", "CommRecord",
           "wire_bytes", "Span", "Timeline", "merge", "CATEGORIES", "MemoryTracker"]
