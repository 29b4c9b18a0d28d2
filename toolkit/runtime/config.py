"""The checks every lesson's ``validate(cfg, world_size)`` starts with, so every lesson words them the same way."""
from __future__ import annotations


def resolve_preset(cfg: dict, presets: dict[str, dict], default: str = "default", **fixed) -> dict:
    """``{**presets[name], **fixed, **cfg, "preset": name}`` for ``name = cfg["preset"]``; ValueError if unknown."""
    name = cfg.get("preset", default)
    if name not in presets:
        raise ValueError(f"preset={name!r} is not known; allowed: {sorted(presets)}")
    return {**presets[name], **fixed, **cfg, "preset": name}


def require_positive_ints(cfg: dict, *keys: str) -> None:
    """ValueError naming the first of ``keys`` whose value is not an int >= 1 (bools are not ints here)."""
    for key in keys:
        value = cfg[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{key} must be a positive int, got {value!r}")


def require_ranks(world_size: int, minimum: int, why: str) -> None:
    """ValueError when fewer than ``minimum`` ranks are asked for; ``why`` completes 'needs at least N ranks'."""
    if world_size < minimum:
        raise ValueError(f"world_size={world_size}: {why} needs at least {minimum} ranks")
