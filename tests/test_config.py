"""The one configuration path (``toolkit.runtime.config``) and the side-by-side timing (``bench.compare``)."""
from __future__ import annotations

import time

import pytest

from toolkit.runtime.bench import compare, measure, summarize
from toolkit.runtime.config import COMMON, Param, common, describe, resolve

PARAMS = {**common("m", "lr"), "mode": Param(str, "what to run", choices=("a", "b")),
          "sizes": Param(list, "message sizes", of=int, ge=1)}
PRESETS = {"smoke": {"m": 2, "lr": 0.1, "mode": "a", "sizes": [1, 2]},
           "default": {"m": 4, "lr": 0.01, "mode": "b", "sizes": [4]}}


def test_resolve_fills_from_the_preset_and_keeps_overrides():
    assert resolve({}, PRESETS, PARAMS) == {**PRESETS["default"], "preset": "default"}
    assert resolve({"preset": "smoke", "m": 3}, PRESETS, PARAMS)["m"] == 3


@pytest.mark.parametrize("cfg, words", [
    ({"preset": "huge"}, ["preset='huge'", "allowed", "smoke"]),
    ({"mm": 3}, ["unknown cfg key 'mm'", "did you mean 'm'", "allowed"]),
    ({"m": 0}, ["m must be >= 1"]),
    ({"m": 2.5}, ["m must be an int"]),
    ({"m": True}, ["m must be an int"]),
    ({"lr": -1}, ["lr must be > 0"]),
    ({"lr": float("nan")}, ["lr must be finite"]),
    ({"mode": "c"}, ["mode='c' is not allowed", "['a', 'b']"]),
    ({"sizes": []}, ["sizes must not be empty"]),
    ({"sizes": [1, 0]}, ["every item of sizes must be >= 1"]),
    ({"sizes": 3}, ["sizes must be a list"]),
])
def test_resolve_rejects_bad_input_naming_the_parameter(cfg, words):
    with pytest.raises(ValueError) as err:
        resolve(cfg, PRESETS, PARAMS)
    for word in words:
        assert word in str(err.value)


def test_a_preset_without_a_value_is_a_lesson_bug():
    with pytest.raises(ValueError, match="gives no value"):
        resolve({"preset": "smoke"}, {"smoke": {"m": 1}}, PARAMS)


def test_common_and_describe():
    assert common("m")["m"] is COMMON["m"]
    with pytest.raises(KeyError):
        common("no_such_knob")
    text = describe(PARAMS, PRESETS)
    assert "micro-batches per step" in text and "smoke" in text.splitlines()[0]


def test_compare_rotates_the_order_and_counts_every_step():
    calls = []
    res = compare({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, warmup=1, steps=2, rounds=3)
    assert calls == ["a", "b"] + ["a", "a", "b", "b"] + ["b", "b", "a", "a"] + ["a", "a", "b", "b"]
    assert set(res) == {"a", "b"} and all(len(r.step_times_s) == 6 and len(r.round_means_s) == 3 for r in res.values())


def test_compare_separates_a_slow_candidate():
    res = compare({"fast": lambda: None, "slow": lambda: time.sleep(0.002)}, warmup=0, steps=2, rounds=3)
    assert res["slow"].mean_s > res["fast"].mean_s


def test_summarize_trims_rounds_and_measure_uses_it():
    r = summarize([1.0, 1.0, 5.0, 5.0, 2.0, 2.0], steps=2, trim=1)
    assert r.round_means_s == [1.0, 5.0, 2.0] and r.mean_s == 2.0
    with pytest.raises(ValueError):
        summarize([1.0], steps=2)
    assert len(measure(lambda: None, warmup=0, steps=2, rounds=2).step_times_s) == 4
