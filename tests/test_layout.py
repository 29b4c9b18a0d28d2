"""The package's layering, read from the sources (no imports run): techniques and the runtime never import the
lesson programs, and no two toolkit modules import each other (also through others, also inside functions)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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
                found |= {base} | {f"{base}.{a.name}" for a in node.names}
        graph[name] = {m for m in found if m in files and m != name}
    return graph


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
