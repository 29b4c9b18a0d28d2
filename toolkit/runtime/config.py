"""One way to configure a lesson: a table of knobs, three size presets, one ``resolve``.

Every lesson program declares what it accepts and how big each preset is::

    PARAMS = {**common("model", "n_layer", "m", "micro_batch", "warmup", "steps", "rounds"),
              "keep": Param(int, "micro-batches' activations a rank may hold at once", ge=1)}
    PRESETS = {"smoke": {...}, "default": {...}, "full": {...}}     # a value for every knob (sizes only)

    def validate(cfg: dict, world_size: int) -> dict:
        cfg = resolve(cfg, PRESETS, PARAMS)          # preset, unknown keys, types, ranges
        require_ranks(world_size, 2, "a pipeline")   # then what only this lesson knows
        ...
        return cfg

``resolve`` runs in the notebook process before any rank starts, so a misspelt key, a wrong type or a
value out of range is a ``ValueError`` naming the parameter and what is allowed, not a traceback from
rank 3 a minute later. The same table documents the knobs (``describe``) and drives the bad-input tests
of every lesson (``tests/test_lesson_configs.py``).

One name for one concept across lessons (``COMMON``): ``m`` micro-batches per step, ``micro_batch``
sequences per micro-batch, ``batch`` sequences per rank per step, ``steps`` training steps,
``warmup``/``rounds``/``bench_steps`` the benchmark procedure (``toolkit.runtime.bench``).
"""
from __future__ import annotations

import difflib
import math
from dataclasses import dataclass

DEFAULT_PRESET = "default"
PRESET_NAMES = ("smoke", "default", "full")


@dataclass(frozen=True)
class Param:
    """One knob of a lesson: its type, its allowed values, and what it means.

    For ``type=list`` the checks (``of``, ``choices``, ``ge``/``gt``/``le``) apply to every item.
    """

    type: type
    """``int``, ``float``, ``bool``, ``str`` or ``list`` (ints are accepted where a float is asked)."""
    doc: str
    """What the knob means, in a few words (shown in errors and in ``describe``)."""
    ge: float | None = None
    """Smallest allowed value (inclusive)."""
    gt: float | None = None
    """Values must be greater than this."""
    le: float | None = None
    """Largest allowed value (inclusive)."""
    choices: tuple | None = None
    """The allowed values (or list items)."""
    of: type | None = None
    """Type of a list's items."""
    nullable: bool = False
    """``None`` is allowed as the knob's value, meaning "the lesson picks" (a preset sets it; given as ``None`` in
    a cfg, a knob takes the preset's value, see ``resolve``)."""
    nonempty: bool = True
    """A list must have at least one item."""

    def check(self, name: str, value) -> None:
        """Raise ValueError naming ``name`` unless ``value`` is allowed."""
        if value is None and self.nullable:
            return
        if self.type is list:
            if not isinstance(value, (list, tuple)):
                raise ValueError(f"{name} must be a list ({self.doc}), got {value!r}")
            if self.nonempty and not value:
                raise ValueError(f"{name} must not be empty ({self.doc})")
            for item in value:
                self._check_scalar(name, item, self.of, as_item=True)
            return
        self._check_scalar(name, value, self.type)

    def _check_scalar(self, name: str, value, kind: type | None, as_item: bool = False) -> None:
        what = f"every item of {name}" if as_item else name
        if kind is not None and not _is_a(value, kind):
            raise ValueError(f"{what} must be {_article(kind)} ({self.doc}), got {value!r}")
        if self.choices is not None and value not in self.choices:
            raise ValueError(f"{what}={value!r} is not allowed ({self.doc}); allowed: {list(self.choices)}")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{what} must be finite ({self.doc}), got {value!r}")
            for bound, ok, word in ((self.ge, lambda v, b: v >= b, ">="), (self.gt, lambda v, b: v > b, ">"),
                                    (self.le, lambda v, b: v <= b, "<=")):
                if bound is not None and not ok(value, bound):
                    raise ValueError(f"{what} must be {word} {bound:g} ({self.doc}), got {value!r}")


def _is_a(value, kind: type) -> bool:
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is list:
        return isinstance(value, (list, tuple))
    return isinstance(value, kind)


def _article(kind: type) -> str:
    return {int: "an int", float: "a number", bool: "a bool (True/False)", str: "a string",
            list: "a list"}.get(kind, f"a {kind.__name__}")


# The knobs several lessons share, under one name each.
COMMON: dict[str, Param] = {
    "model": Param(str, "toolkit.models size preset", choices=PRESET_NAMES),
    "n_layer": Param(int, "transformer blocks of the tiny GPT", ge=1),
    "seq_len": Param(int, "tokens per sequence", ge=1),
    "m": Param(int, "micro-batches per step", ge=1),
    "micro_batch": Param(int, "sequences per micro-batch", ge=1),
    "batch": Param(int, "sequences per rank per step", ge=1),
    "steps": Param(int, "training steps", ge=1),
    "lr": Param(float, "learning rate", gt=0),
    "seed": Param(int, "random seed of the data and the weights", ge=0),
    "seeds": Param(int, "independent runs (init and data order) that measure the run-to-run spread", ge=1),
    "warmup": Param(int, "untimed benchmark steps before timing", ge=0),
    "bench_steps": Param(int, "timed steps per benchmark round", ge=1),
    "rounds": Param(int, "benchmark rounds (each runs every candidate in turn)", ge=1),
    "eval_batches": Param(int, "held-out batches for the evaluation loss", ge=1),
    "n_expert": Param(int, "experts per MoE layer (each rank owns n_expert / world_size)", ge=1),
    "top_k": Param(int, "experts each token is routed to", ge=1),
}


def common(*names: str) -> dict[str, Param]:
    """The ``COMMON`` entries named, e.g. ``{**common("m", "steps"), "keep": Param(...)}``."""
    unknown = [n for n in names if n not in COMMON]
    if unknown:
        raise KeyError(f"no common parameter {unknown}; known: {sorted(COMMON)}")
    return {n: COMMON[n] for n in names}


def resolve(cfg: dict, presets: dict[str, dict], params: dict[str, Param]) -> dict:
    """``{**presets[name], **cfg, "preset": name}`` after checking every key and value.

    ``name`` is ``cfg["preset"]`` (default ``"default"``). A knob given as ``None`` takes the preset's value:
    the one way a notebook says "the preset's" (``steps: Optional[int] = None``). Raises ValueError for an
    unknown preset, a key not in ``params`` (naming the allowed ones and the closest match), and any value
    ``Param.check`` rejects. Every preset must give a value for every parameter (a lesson's own bug otherwise).
    """
    if not isinstance(cfg, dict):
        raise ValueError(f"cfg must be a dict, got {type(cfg).__name__}")
    name = cfg.get("preset", DEFAULT_PRESET)
    if name not in presets:
        raise ValueError(f"preset={name!r} is not known; allowed: {sorted(presets)}")
    unknown = [k for k in cfg if k != "preset" and k not in params]
    if unknown:
        hints = [f"{k!r} (did you mean {close[0]!r}?)" if (close := difflib.get_close_matches(k, params, 1)) else repr(k)
                 for k in unknown]
        raise ValueError(f"unknown cfg key{'s' if len(unknown) > 1 else ''} {', '.join(hints)}; "
                         f"allowed: {sorted(params)}")
    out = {**presets[name], **{k: v for k, v in cfg.items() if v is not None}, "preset": name}
    missing = [k for k in params if k not in out]
    if missing:
        raise ValueError(f"preset {name!r} gives no value for {missing} (a bug in the lesson's PRESETS)")
    for key, param in params.items():
        param.check(key, out[key])
    return out


def describe(params: dict[str, Param], presets: dict[str, dict] | None = None) -> str:
    """The knobs as a text table: name, type, allowed, meaning and each preset's value."""
    names = list(presets or {})
    rows = [["name", "type", "allowed", "meaning", *names]]
    for key, p in params.items():
        allowed = (str(list(p.choices)) if p.choices else
                   " ".join(f"{w}{b:g}" for w, b in ((">=", p.ge), (">", p.gt), ("<=", p.le)) if b is not None))
        kind = p.type.__name__ + (f"[{p.of.__name__}]" if p.of else "")
        rows.append([key, kind, allowed, p.doc, *(repr(presets[n].get(key)) for n in names)])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def require_ranks(world_size: int, minimum: int, why: str) -> None:
    """ValueError when fewer than ``minimum`` ranks are asked for; ``why`` completes 'needs at least N ranks'."""
    if world_size < minimum:
        raise ValueError(f"world_size={world_size}: {why} needs at least {minimum} ranks")


def require_divisible(name: str, value: int, by: int, by_name: str, why: str = "") -> None:
    """ValueError unless ``by`` divides ``value``: "n_layer=6 must be divisible by world_size=4 (why)"."""
    if value % by:
        raise ValueError(f"{name}={value} must be divisible by {by_name}={by}" + (f" ({why})" if why else ""))

