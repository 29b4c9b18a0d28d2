"""The package's layering, read from the sources (no imports run): every toolkit module imports only its own package
and the floors below it (``FLOORS``), techniques and the runtime never import the lesson programs, and no two
toolkit modules import each other (also through others, also inside functions)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

FLOORS = (
    ("runtime",),                                   # processes, clocks, the emulated cluster, measurement
    ("data", "quant"),                              # batches; quantisers
    ("models",),                                    # the GPT, the model catalog, workload matching
    ("comm", "parallel"),                           # collectives' techniques; DP / TP / ZeRO
    ("moe",),                                       # experts, dispatch, overlap of two micro-batches
    ("pipeline",),                                  # schedules, executor, simulator, vocabulary parallelism
    ("memory", "context", "graphs", "precision", "viz"),  # offload, context parallelism, CUDA graphs, figures
    ("planner", "report", "jupyter"),               # cost models over all of the above; results; the lab hook
    ("compose", "compose_bytes", "planner_check"),  # techniques composed; the planner checked at true shapes
    ("api",),                                       # the public surface: what ``import toolkit`` offers
    ("toolkit",),
    ("lessons",),                                   # the programs the notebooks launch
)
"""Packages of ``toolkit`` (first name after ``toolkit.``; ``toolkit`` is its ``__init__``), lowest first."""


def _imports() -> dict[str, set[str]]:
    """{module: toolkit modules it imports anywhere in its source}; packages are named without ``__init__``."""
    files = {}
    for path in (ROOT / "toolkit").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                # ``from pkg import mod`` imports the module; ``from pkg import name`` imports the package
                found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names}
        graph[name] = {m for m in found if m in files and m != name}
    return graph


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def test_every_module_imports_its_own_package_and_lower_floors_only():
    floor = {pkg: i for i, names in enumerate(FLOORS) for pkg in names}
    graph = _imports()
    undeclared = sorted({_package(m) for m in graph} - set(floor))
    assert not undeclared, f"packages with no floor in FLOORS (declare them): {undeclared}"
    upward = sorted((m, t) for m, ts in graph.items() for t in ts
                    if _package(m) != _package(t) and floor[_package(t)] >= floor[_package(m)])
    assert not upward, f"imports of a package on the same floor or above (FLOORS): {upward}"


def test_only_lessons_import_lessons():
    upward = sorted((m, t) for m, ts in _imports().items() for t in ts
                    if t.startswith("toolkit.lessons") and not m.startswith("toolkit.lessons"))
    assert not upward, f"techniques and the runtime must not import the lesson programs: {upward}"


def test_no_import_cycles_between_modules():
    graph = _imports()
    modules = {m for m in graph if not (ROOT / (m.replace(".", "/") + "/__init__.py")).exists()}  # packages re-export
    cycles = set()
    for a in modules:
        for b in graph[a] & modules:
            stack, seen = [b], {b}
            while stack:
                x = stack.pop()
                if a in graph[x]:
                    cycles.add(tuple(sorted((a, b))))
                    break
                for y in graph[x] & modules - seen:
                    seen.add(y)
                    stack.append(y)
    assert not cycles, f"modules that import each other (directly or through others): {sorted(cycles)}"


def test_benchmarks_import_no_lesson_program():
    """Benchmarks name a lesson as a launch target by string; they do not import one (its constants travel in its
    results, e.g. lesson 12's tolerances)."""
    import ast
    found = []
    for path in sorted((ROOT / "benchmarks").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [f"{node.module}.{a.name}" for a in node.names] if isinstance(node, ast.ImportFrom) and node.module else []
            found += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.startswith("toolkit.lessons")]
    assert not found, found


def test_technique_code_never_knows_it_is_emulated():
    """SimGrid's rule: the simulated program is the real program. Only ``toolkit.runtime`` (the emulated cluster,
    and ``runtime.portable``: verbs that mean the same with and without it) and the lesson programs (they read
    ``ctx.emulator`` to report virtual times) import ``toolkit.runtime.emulator`` or name ``Emulator``,
    ``current_emulator`` or ``emulator.current``."""
    allowed = {"runtime", "lessons"}
    graph = _imports()
    found = [f"{m}: imports toolkit.runtime.emulator" for m, ts in graph.items()
             if "toolkit.runtime.emulator" in ts and _package(m) not in allowed]
    for path in sorted((ROOT / "toolkit").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if len(parts) > 2 and parts[1] in allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Name) and node.id in ("Emulator", "current_emulator")) or (
                    isinstance(node, ast.Attribute) and node.attr == "current" and isinstance(node.value, ast.Name)
                    and node.value.id in ("emulator", "emulation")):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, f"technique code that asks whether it is emulated (use toolkit.runtime.portable): {found}"
