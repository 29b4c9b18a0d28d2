"""What ``launch`` runs on the ranks: a lesson, a ``"module:function"`` of yours, or a function object.

The launching process turns what it was given into a *target* (a small JSON-able dict written into the
launch spec) and checks it before any process starts; every rank turns the target back into the function::

    launch(what, ...)                     target (in spec.json)                      on every rank
    ─────────────────                     ─────────────────────                      ─────────────
    "l00_foundations"               ─►  {"kind": "import", "module":          ─►  import, getattr
    "my_module:my_experiment"             "toolkit.lessons.l00_foundations",
    "pkg.mod" / "pkg.mod:fn"              "function": "run"}
    my_experiment  (def in a module) ─►  the same, from fn.__module__ / __qualname__
    my_experiment  (def in a notebook ─► {"kind": "source", "source": "import torch\\n
                    cell or a script)     N = 4\\ndef helper(...): ...\\ndef my_experiment(ctx, cfg): ...",
                                          "function": "my_experiment"}          ─►  exec in a fresh module

Names are resolved like ``import`` resolves them, from the caller's working directory and ``sys.path``
first (the ranks get both), then inside ``toolkit.lessons`` (so ``"l00_foundations"`` is a lesson).

A function is shipped as source when the ranks could not import it (defined in ``__main__``: a notebook
cell or the script being run, or nested in another function). Shipping works when it is self-contained:
the globals it reads are modules (``import torch`` in another cell), functions or classes importable from
a module, plain constants (numbers, strings, lists/dicts of them), or other functions and classes defined
the same way (shipped with it, recursively). Anything else — a variable it closes over, a tensor or a
model built in the notebook, a lambda — is a ``ValueError`` naming it, before any process starts.
"""
from __future__ import annotations

import ast
import dis
import importlib
import importlib.util
import inspect
import linecache
import os
import pkgutil
import sys
import textwrap
import types
from dataclasses import dataclass, field

LESSON_PACKAGE = "toolkit.lessons"
SOURCE_MODULE = "__toolkit_launch__"  # the module a shipped function is executed in, on every rank


@dataclass
class Target:
    """What every rank runs: ``spec`` goes to the ranks; ``module`` and ``fn`` are the launcher's view."""

    spec: dict
    fn: object
    module: types.ModuleType | None = None
    label: str = ""
    shipped: list[str] = field(default_factory=list)  # names shipped as source with the function


def lessons() -> list[str]:
    """The lesson programs in ``LESSON_PACKAGE`` (names ``lNN_...``), found by the package's module path: the
    runtime imports no lesson, nor the lessons package, to list them."""
    spec = importlib.util.find_spec(LESSON_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return []
    return sorted(m.name for m in pkgutil.iter_modules(spec.submodule_search_locations)
                  if m.name[:1] == "l" and m.name[1:3].isdigit())


def resolve(what) -> Target:
    """A lesson name, ``"module[:function]"`` string or a function object -> a checked ``Target``.

    Raises ValueError when the ranks could not run it: no such lesson or module (listing the lessons that
    exist), no such function, a module that fails to import, a lambda, a function that does not take
    ``(ctx, cfg)``, or a notebook function that closes over something that cannot be shipped.
    """
    if isinstance(what, str):
        target = _resolve_name(what)
    elif callable(what):
        target = _resolve_function(what)
    else:
        raise ValueError(f"lesson must be a lesson name, a 'module:function' string or a function, "
                         f"got {type(what).__name__}")
    check_signature(target.fn, target.label)
    return target


def check_signature(fn, label: str) -> None:
    """ValueError unless ``fn`` can be called as ``fn(ctx, cfg)``."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # builtins and the like: the rank's traceback will tell
    try:
        sig.bind(object(), {})
    except TypeError as exc:
        raise ValueError(f"{label} must take (ctx, cfg) — it is called as fn(ctx, cfg) on every rank; its "
                         f"signature is {fn.__name__}{sig} ({exc})") from None


# ---- "module:function" -------------------------------------------------------------------------------------
def _resolve_name(ref: str) -> Target:
    module_name, _, fn_name = ref.partition(":")
    fn_name = fn_name or "run"
    if not module_name or not all(part.isidentifier() for part in module_name.split(".")) or \
            not fn_name.isidentifier():
        raise ValueError(f"lesson {ref!r} is not a lesson name or 'module:function'; lessons: {lessons()}")
    module = None
    cwd = os.getcwd()
    sys.path.insert(0, cwd)  # the caller's working directory first (the ranks run in it)
    try:
        for candidate in (module_name, f"{LESSON_PACKAGE}.{module_name}"):
            module = _import(candidate, ref)
            if module is not None:
                module_name = candidate
                break
    finally:
        sys.path.remove(cwd)
    if module is None:
        raise ValueError(f"lesson {ref!r}: no module {module_name!r} on the caller's sys.path (working directory "
                         f"first) nor in {LESSON_PACKAGE}; lessons that exist: {lessons()}")
    fn = getattr(module, fn_name, None)
    if fn is None or not callable(fn):
        raise ValueError(f"lesson {ref!r}: module {module_name} has no function {fn_name!r}")
    label = module_name.removeprefix(f"{LESSON_PACKAGE}.") + ("" if fn_name == "run" else f":{fn_name}")
    return Target({"kind": "import", "module": module_name, "function": fn_name}, fn, module, label)


def _import(name: str, ref: str) -> types.ModuleType | None:
    """The module ``name``, or None if it does not exist; ValueError if it exists but fails to import."""
    if name in sys.modules:
        return sys.modules[name]
    try:
        if importlib.util.find_spec(name) is None:
            return None
    except ModuleNotFoundError:  # a parent package is missing
        return None
    except (ImportError, ValueError) as exc:
        raise ValueError(f"lesson {ref!r}: cannot look up module {name!r}: {exc}") from exc
    try:
        return importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001 - any error while importing the user's module
        raise ValueError(f"lesson {ref!r}: module {name!r} failed to import: {type(exc).__name__}: {exc}") from exc


# ---- function objects ---------------------------------------------------------------------------------------
def _resolve_function(fn) -> Target:
    if isinstance(fn, types.MethodType) or not isinstance(fn, types.FunctionType):
        raise ValueError(f"lesson must be a plain function defined with def, got {type(fn).__name__} {fn!r}")
    if fn.__name__ == "<lambda>":
        raise ValueError("lesson is a lambda: the ranks cannot import or rebuild it; define it with "
                         "def name(ctx, cfg): ... (in a module or a notebook cell)")
    label = f"function {fn.__qualname__}"
    module = sys.modules.get(fn.__module__)
    importable = (fn.__module__ != "__main__" and module is not None and getattr(module, "__spec__", None) is not None
                  and _reachable(module, fn))
    if importable:  # the ranks import it by name (they get the caller's sys.path)
        spec = {"kind": "import", "module": fn.__module__, "function": fn.__qualname__}
        return Target(spec, fn, module, f"{fn.__module__}:{fn.__qualname__}")
    source, shipped = ship(fn)
    spec = {"kind": "source", "source": source, "function": fn.__name__, "origin": fn.__module__}
    return Target(spec, fn, None, label, shipped)


def _reachable(module: types.ModuleType, fn) -> bool:
    obj = module
    for part in fn.__qualname__.split("."):
        obj = getattr(obj, part, None)
    return obj is fn


def ship(fn) -> tuple[str, list[str]]:
    """Source that defines ``fn`` and everything it reads from its globals (see the module docstring).

    Returns (source, names of the functions and classes shipped with it). Raises ValueError naming what
    cannot be shipped.
    """
    scope = fn.__globals__
    lines: dict[str, str] = {}  # name -> the statement that defines it (imports and constants first)
    defs: list[tuple[str, str]] = []  # (name, source) in dependency order
    seen: set[int] = set()
    owner = fn.__qualname__

    def visit(obj, name: str) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, types.FunctionType) and obj.__name__ == "<lambda>":
            raise ValueError(f"{owner} uses {name!r}, a lambda: the ranks cannot rebuild it from source; "
                             "define it with def")
        if isinstance(obj, types.FunctionType) and obj.__code__.co_freevars:
            raise ValueError(f"{_what(obj, owner)} closes over {list(obj.__code__.co_freevars)} (variables of the "
                             "function it is defined in): the ranks cannot rebuild them. Define it at the top level "
                             "of the cell and pass values through cfg")
        source = _source_of(obj, owner)
        for dep in sorted(_global_names(obj, source)):
            if dep == name or dep not in scope:
                continue  # builtins, and names the function defines itself
            value = scope[dep]
            statement = _as_statement(dep, value)
            if statement is not None:
                lines[dep] = statement
            elif isinstance(value, (types.FunctionType, type)) and value.__module__ == scope.get("__name__"):
                visit(value, dep)
            else:
                raise ValueError(
                    f"{_what(obj, owner)} uses {dep!r}, a {type(value).__name__} defined in the notebook or script "
                    "that cannot be sent to the ranks. Build it inside the function, pass it through cfg (JSON), "
                    "or move it to a module the ranks can import")
        defs.append((name, source))

    visit(fn, fn.__name__)
    body = "\n".join(lines.values()) + "\n\n" + "\n\n".join(src for _, src in defs)
    compile(body, f"<shipped {fn.__qualname__}>", "exec")  # a syntax problem shows here, not on the ranks
    return body, [n for n, _ in defs[:-1]]


def _what(obj, owner: str) -> str:
    kind = "class" if isinstance(obj, type) else "function"
    name = getattr(obj, "__qualname__", repr(obj))
    return f"{kind} {name}" + ("" if name == owner else f" (used by {owner})")


def _source_of(obj, owner: str) -> str:
    """The dedented source of a function or class, also for classes defined in a notebook cell."""
    try:
        source = inspect.getsource(obj)
    except (OSError, TypeError):
        source = _class_source_from_cells(obj) if isinstance(obj, type) else None
        if source is None:
            raise ValueError(f"{_what(obj, owner)}: its source is not available (defined in an interactive "
                             "prompt?); define it in a notebook cell, a script or a module") from None
    source = textwrap.dedent(source)
    if source.lstrip().startswith("@"):
        raise ValueError(f"{_what(obj, owner)} is decorated; the ranks would re-run the decorator. "
                         "Put it in a module the ranks can import")
    return source


def _class_source_from_cells(cls: type) -> str | None:
    """Python < 3.13 cannot find a notebook class's source: look for it in the cell its methods came from."""
    files = {f.__code__.co_filename for f in _functions_of(cls)}
    for filename in files:
        text = "".join(linecache.getlines(filename))
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name == cls.__name__:
                return ast.get_source_segment(text, node, padded=False)
    return None


def _functions_of(obj) -> list[types.FunctionType]:
    if isinstance(obj, types.FunctionType):
        return [obj]
    out = []
    for value in vars(obj).values():
        value = getattr(value, "__func__", value)  # staticmethod / classmethod
        if isinstance(value, property):
            out += [f for f in (value.fget, value.fset, value.fdel) if isinstance(f, types.FunctionType)]
        elif isinstance(value, types.FunctionType) and value.__module__ == obj.__module__:
            out.append(value)
    return out


def _global_names(obj, source: str) -> set[str]:
    """Global names ``obj`` reads: in its code (nested functions and comprehensions included) and in what the
    ``def``/``class`` statement evaluates when the ranks execute it (annotations, defaults, bases)."""
    names: set[str] = set()

    def code_names(code: types.CodeType) -> None:
        for ins in dis.get_instructions(code):
            if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME", "STORE_GLOBAL"):
                names.add(ins.argval)
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                code_names(const)

    def loads(nodes) -> None:
        for node in nodes:
            if node is not None:
                names.update(n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load))

    def signature_nodes(fdef) -> list:
        a = fdef.args
        return [x.annotation for x in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg) if x is not None] \
            + list(a.defaults) + list(a.kw_defaults) + [fdef.returns]

    for f in _functions_of(obj):
        code_names(f.__code__)
    top = ast.parse(source).body[0]
    if isinstance(top, (ast.FunctionDef, ast.AsyncFunctionDef)):
        loads(signature_nodes(top))
    elif isinstance(top, ast.ClassDef):
        loads([*top.bases, *top.keywords])
        for stmt in top.body:
            loads(signature_nodes(stmt) if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) else [stmt])
    return names


_CONSTANTS = (type(None), bool, int, float, complex, str, bytes)


def _as_statement(name: str, value) -> str | None:
    """``import x as name`` / ``from m import q as name`` / ``name = <literal>``, or None if it is not one."""
    if isinstance(value, types.ModuleType):
        return f"import {value.__name__} as {name}" if "." in value.__name__ or value.__name__ != name \
            else f"import {name}"
    module = getattr(value, "__module__", None)
    qualname = getattr(value, "__qualname__", None)
    if module and qualname and module not in ("__main__", "builtins") and "<" not in qualname and \
            "." not in qualname and sys.modules.get(module) is not None and \
            getattr(sys.modules[module], qualname, None) is value:
        return f"from {module} import {qualname}" + ("" if qualname == name else f" as {name}")
    if _is_literal(value):
        text = repr(value)
        try:
            if ast.literal_eval(text) == value:
                return f"{name} = {text}"
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            pass
    return None


def _is_literal(value, depth: int = 0) -> bool:
    if depth > 20:
        return False
    if isinstance(value, _CONSTANTS):
        return True
    if isinstance(value, (list, tuple, set, frozenset)):
        return len(value) <= 10_000 and all(_is_literal(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return len(value) <= 10_000 and all(_is_literal(k, depth + 1) and _is_literal(v, depth + 1)
                                            for k, v in value.items())
    return False


# ---- on the rank ------------------------------------------------------------------------------------------
def load(spec: dict):
    """The function a target names (on a rank): import it, or execute its shipped source."""
    if spec["kind"] == "import":
        obj = importlib.import_module(spec["module"])
        for part in spec["function"].split("."):
            obj = getattr(obj, part)
        return obj
    if spec["kind"] == "source":
        filename = f"<launched from {spec.get('origin', '__main__')}: {spec['function']}>"
        source = spec["source"]
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)  # tracebacks show lines
        module = types.ModuleType(SOURCE_MODULE)
        module.__file__ = filename
        sys.modules[SOURCE_MODULE] = module  # dataclasses and pickling look classes up by module
        exec(compile(source, filename, "exec"), module.__dict__)  # noqa: S102 - the caller's own code
        return module.__dict__[spec["function"]]
    raise ValueError(f"unknown target kind {spec['kind']!r}")
