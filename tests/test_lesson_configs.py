"""Bad input for every lesson, generated from its ``PARAMS`` table: before any process starts, a misspelt
key, a wrong type and a value out of range are a ValueError naming the parameter."""
from __future__ import annotations

import importlib
import pkgutil

import pytest

import toolkit.lessons
from toolkit.runtime.config import Param

LESSONS = sorted(m.name for m in pkgutil.iter_modules(toolkit.lessons.__path__) if m.name[:1] == "l"
                 and m.name[1:3].isdigit())
TABLED = [name for name in LESSONS if hasattr(importlib.import_module(f"toolkit.lessons.{name}"), "PARAMS")]


def _lesson(name: str):
    module = importlib.import_module(f"toolkit.lessons.{name}")
    return module, getattr(module, "WORLD_SIZE", 2)


def _bad_values(param: Param):
    """Values the table says are wrong, each with a word the error must contain."""
    if param.type is list:
        yield "not a list", "must be a list"
        if param.nonempty:
            yield [], "must not be empty"
    elif param.type in (int, float):
        yield "seven", "must be"
        low = param.ge if param.ge is not None else param.gt
        if low is not None:
            yield (int(low) - 1 if param.type is int else low - 1.5), "must be"
    elif param.choices:
        yield "no-such-choice", "not allowed"


@pytest.mark.parametrize("name", TABLED)
def test_every_preset_passes_validate(name):
    module, world = _lesson(name)
    for preset in module.PRESETS:
        module.validate({"preset": preset}, world)


@pytest.mark.parametrize("name", TABLED)
def test_a_misspelt_key_is_named(name):
    module, world = _lesson(name)
    with pytest.raises(ValueError, match="unknown cfg key 'no_such_knob'"):
        module.validate({"preset": "smoke", "no_such_knob": 1}, world)


@pytest.mark.parametrize("name, key", [(n, k) for n in TABLED
                                       for k in importlib.import_module(f"toolkit.lessons.{n}").PARAMS])
def test_a_bad_value_is_named(name, key):
    module, world = _lesson(name)
    param = module.PARAMS[key]
    for value, word in _bad_values(param):
        with pytest.raises(ValueError) as err:
            module.validate({"preset": "smoke", key: value}, world)
        assert key in str(err.value) and word in str(err.value), (value, str(err.value))
