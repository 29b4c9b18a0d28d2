"""toolkit.runtime.spread: mean ± std over seeds and the paired rule for "beyond the noise"."""
from __future__ import annotations

import math

import pytest

from toolkit.runtime.spread import paired, pm, summary


def test_summary_is_mean_and_sample_std():
    s = summary([1.0, 2.0, 3.0])
    assert s["n"] == 3 and s["mean"] == 2.0 and s["std"] == 1.0
    assert summary([5])["std"] == 0.0
    assert pm(s) == "2.000 ± 1.000"


def test_a_consistent_small_effect_is_beyond_the_noise_even_under_a_large_seed_spread():
    base = [2.0, 2.5, 3.0]  # the seeds differ a lot ...
    other = [2.02, 2.52, 3.03]  # ... the technique adds the same +0.02 to each
    c = paired(base, other)
    assert c["base"]["std"] > 10 * c["diff"]  # the unpaired intervals overlap
    assert c["beyond_noise"] is True and c["verdict"] == "higher"
    assert c["paired"]["values"] == pytest.approx([0.02, 0.02, 0.03])
    assert c["noise"] == pytest.approx(2 * c["paired"]["std"] / math.sqrt(3))


def test_an_inconsistent_effect_is_within_the_noise():
    c = paired([2.0, 2.5, 3.0], [2.05, 2.45, 3.01])
    assert c["beyond_noise"] is False and c["verdict"] == "within noise"
    assert paired([1.0, 1.0], [0.5, 0.6])["verdict"] == "lower"


def test_one_seed_is_not_judged_and_bad_input_is_refused():
    c = paired([1.0], [1.1])
    assert c["beyond_noise"] is None and c["verdict"].startswith("one seed")
    with pytest.raises(ValueError, match="one value per seed"):
        paired([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="finite"):
        summary([1.0, float("nan")])
    with pytest.raises(ValueError, match="non-empty"):
        summary([])
