"""Recompute in the bubble: bitwise gradients, RNG restore, memory, on real processes; bad input."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from toolkit import launch
from toolkit.lessons import l10_recompute_bubbles as l10
from toolkit.pipeline.recompute import RecomputeQueue


@pytest.fixture(scope="module")
def lesson():
    return launch("l10_recompute_bubbles", 2, {"preset": "smoke"}, timeout_s=300, progress="none")


def test_gradients_are_bitwise_those_without_recompute(lesson):
    for r in lesson:
        assert r["bitwise_equal_to_none"] == {"inline": True, "bubble": True}
        for mode in l10.MODES:
            assert r["runs"][mode]["grad_diff"] <= 1e-5


def test_recompute_lowers_the_resident_activations_of_rank_0(lesson):
    runs = lesson[0]["runs"]
    assert runs["bubble"]["checkpointed"] and runs["bubble"]["checkpointed"] == runs["inline"]["checkpointed"]
    assert runs["bubble"]["peak_act_bytes"] < runs["none"]["peak_act_bytes"]
    assert runs["inline"]["peak_act_bytes"] < runs["none"]["peak_act_bytes"]
    assert {s["kind"] for r in lesson for s in r["runs"]["bubble"]["spans"]} >= {"F", "B", "R"}


def test_restoring_the_rng_state_makes_dropout_repeat(lesson):
    assert lesson[0]["dropout"] == {"restored_rng_bitwise_equal": True, "naive_recompute_bitwise_equal": False}


def test_recompute_queue_leaves_the_global_rng_stream_alone():
    torch.manual_seed(0)
    stage = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))
    queue = RecomputeQueue()
    torch.manual_seed(1)
    queue.forward((0, 0, 0), stage, torch.randn(2, 4))
    expected = torch.rand(3)  # what the stream gives next without any recompute
    torch.manual_seed(1)
    queue.forward((0, 0, 0), stage, torch.randn(2, 4))
    x, out = queue.recompute((0, 0, 0))
    assert torch.equal(torch.rand(3), expected) and out.requires_grad and len(queue) == 0


def test_recompute_of_an_unknown_forward_fails_loudly():
    with pytest.raises(RuntimeError, match="was not checkpointed"):
        RecomputeQueue().recompute((0, 3, 0))


def test_bad_input_names_the_parameter():
    with pytest.raises(ValueError, match="m=1 micro-batches is too few"):
        l10.validate({"preset": "smoke", "m": 1}, 2)
    with pytest.raises(ValueError, match="n_layer=3 must be divisible by world_size=2"):
        l10.validate({"preset": "smoke", "n_layer": 3}, 2)
    with pytest.raises(ValueError, match="keep must be >= 1"):
        l10.validate({"preset": "smoke", "keep": 0}, 2)
    with pytest.raises(ValueError, match="preset='huge'"):
        l10.validate({"preset": "huge"}, 2)
