"""Source listings in a lesson: the lines of a function that carry the idea, and where the whole of it is.

::

    print(listing(dualpipev, start="# 1", end="ranks.append"))

    def dualpipev(p: int, m: int, pair: bool = True) -> Schedule:
        \"\"\"DualPipeV (DeepSeek's ``dualpipev.py``): 2p stages in a V, the eight steps per rank r. ...\"\"\"
        ...                                                   the lines before ``start``
            acts += [f(s0) for _ in range(2 * (p - r - 1))]   # 1
            ...
            ranks.append(acts)
        ...                                                   the lines after ``end``
    # the whole of it: toolkit/pipeline/schedule.py:374-453

A docstring longer than two lines is cut to its first line; a listing longer than ``LIMIT`` lines is refused,
naming its length, so a lesson chooses what it shows (``tests/test_notebooks.py`` checks what every lesson
prints).
"""
from __future__ import annotations

import ast
import inspect
import textwrap
from pathlib import Path

LIMIT = 40
"""The most lines a lesson prints of one listing (one cell's printed source)."""
DOC_LINES = 2
"""A docstring longer than this is cut to its first line."""

_ROOT = Path(__file__).resolve().parents[2]  # the repository: paths are shown relative to it


def listing(obj, start: str | None = None, end: str | None = None, limit: int = LIMIT) -> str:
    """The source of ``obj`` (a function, method or class) to print in a lesson: its ``def`` or ``class`` line, its
    docstring (the first line of one longer than ``DOC_LINES``), then its body from the first line containing
    ``start`` to the first line at or after it containing ``end`` (from the top and to the bottom when not given),
    ``...`` where lines are left out and, when any were, a last line naming the file and lines of the whole.

    Raises ``ValueError`` when ``start`` or ``end`` is not in the source, or when the listing would be longer than
    ``limit`` lines (choose a narrower ``start``/``end``)."""
    obj = inspect.unwrap(obj)  # a decorated function's own source and file (``torch.no_grad()`` wraps it)
    lines, first = inspect.getsourcelines(obj)
    source = textwrap.dedent("".join(lines)).splitlines()
    tree = ast.parse("\n".join(source)).body[0]
    head_end = tree.body[0].lineno - 1  # the def/class line(s), decorators included
    body = tree.body
    out = source[:head_end]
    whole = True  # nothing left out so far
    if ast.get_docstring(tree) is not None:
        doc = source[body[0].lineno - 1:body[0].end_lineno]
        if len(doc) > DOC_LINES:
            doc, whole = [doc[0] + ('' if doc[0].rstrip().endswith('"""') else ' ..."""')], False
        out += doc
        body = body[1:]
    if body:
        rest = source[body[0].lineno - 1:]
        lo, hi = 0, len(rest) - 1
        if start is not None:
            lo = _find(rest, start, 0, "start", obj)
        if end is not None:
            hi = _find(rest, end, lo, "end", obj)
        after = any(line.strip() for line in rest[hi + 1:])
        if lo > 0:
            out.append(_indent_of(rest[lo]) + "...")
        out += rest[lo:hi + 1]
        if after:
            out.append(_indent_of(rest[hi]) + "...")
        whole = whole and lo == 0 and not after
    if not whole:
        path = Path(inspect.getsourcefile(obj)).resolve()
        where = path.relative_to(_ROOT) if path.is_relative_to(_ROOT) else path
        out.append(f"# the whole of it: {where}:{first}-{first + len(lines) - 1}")
    if len(out) > limit:
        raise ValueError(f"the listing of {getattr(obj, '__qualname__', obj)!r} is {len(out)} lines, more than "
                         f"limit={limit}: give start= and end= around the lines that matter")
    return "\n".join(out)


def _indent_of(line: str) -> str:
    return line[:len(line) - len(line.lstrip())]


def _find(lines: list[str], text: str, after: int, name: str, obj) -> int:
    for i in range(after, len(lines)):
        if text in lines[i]:
            return i
    raise ValueError(f"{name}={text!r} is not in the source of {getattr(obj, '__qualname__', obj)!r}")
