"""Recompute in the bubble: bitwise gradients, RNG restore, memory, on real processes (on an emulated cluster,
a stage per node: its steps against the simulator fed the same op times); bad input."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from toolkit import launch
from toolkit.lessons import l10_recompute_bubbles as l10
from toolkit.pipeline import Action, Costs, interleaved_1f1b, make_schedule, one_f_one_b, simulate, zb_h1
from toolkit.pipeline.recompute import RecomputeQueue
from toolkit.pipeline.schedule import with_recompute
from toolkit.pipeline.simulate import MeasuredCosts
from toolkit.models.catalog import get
from toolkit.runtime.cluster import cluster

STAGE_PER_NODE = cluster("h100-ib400", ranks_per_node=1)


@pytest.fixture(scope="module")
def lesson():
    # the notebook's smoke run, which the suite's launch cache shares with nbval's (these tests read bytes,
    # gradients, spans and the virtual clock, never a wall time)
    return launch("l10_recompute_bubbles", l10.WORLD_SIZE, {"preset": "smoke"},
                  timeout_s=600, progress="none", cluster=STAGE_PER_NODE)


def test_gradients_are_bitwise_those_without_recompute_for_every_policy(lesson):
    names = [n for n in lesson[0]["runs"] if "recompute" in n]
    assert {"1f1b-recompute-bubble-cooldown", "interleaved-recompute-bubble-cooldown",
            "interleaved-recompute-inline-cooldown"} <= set(names)
    for r in lesson:
        assert r["bitwise_equal_to_no_recompute"] == {n: True for n in names}
        for name, run in r["runs"].items():
            assert run["grad_diff"] <= 1e-5, name


def test_recompute_lowers_the_resident_activations_where_the_policy_says(lesson):
    runs = lesson[0]["runs"]
    assert runs["1f1b-recompute-bubble"]["checkpointed"] == runs["1f1b-recompute-inline"]["checkpointed"] != []
    assert runs["1f1b-recompute-bubble"]["peak_act_bytes"] == runs["1f1b-recompute-inline"]["peak_act_bytes"]
    assert runs["1f1b-recompute-bubble"]["peak_act_bytes"] < runs["1f1b"]["peak_act_bytes"]
    # cool-down policy: plain 1F1B reached its peak before the cool-down; interleaved holds less on rank 0
    assert runs["1f1b-recompute-bubble-cooldown"]["peak_act_bytes"] == runs["1f1b"]["peak_act_bytes"]
    assert runs["interleaved-recompute-bubble-cooldown"]["peak_act_bytes"] < runs["interleaved"]["peak_act_bytes"]
    assert {s["kind"] for r in lesson for s in r["runs"]["1f1b-recompute-bubble"]["spans"]} >= {"F", "B", "R"}


def test_emulated_steps_are_the_simulators_fed_the_same_op_times_and_hop(lesson):
    """Matched to llama2-7b, a stage per node: one hop is α + an activation's bytes / β of the network, and every
    schedule whose recomputes are R actions (or none) takes the simulator's time for its own virtual op times and
    that hop, within 5 % (as tests/test_emulator.py checks the plain schedules)."""
    E = lesson[0]["emulated"]
    real = get(E["stands_for"])
    assert E["hop_s"]["matched"] == pytest.approx(STAGE_PER_NODE.inter.seconds(real.seq_len * real.hidden * 2))
    schedules = l10.schedules(l10.WORLD_SIZE, lesson[0])
    for name, schedule in schedules.items():
        if "inline" in name:  # torch's checkpoint recomputes inside the B, with early stop: not an R action
            continue
        ops = [o for r in lesson for o in r["emulated"]["runs"][name]["op_seconds"]]
        step = max(r["emulated"]["runs"][name]["step_s"] for r in lesson)
        predicted = simulate(schedule, MeasuredCosts(ops, comm=E["hop_s"]["matched"])).makespan
        assert step == pytest.approx(predicted, rel=0.05), (name, step, predicted)


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


def test_cooldown_policy_picks_the_cool_down_backwards():
    # 1F1B rank r: the p-r-1 backwards after the one paired with the last forward
    s = with_recompute(one_f_one_b(4, 8), "bubble", "cooldown")
    for r in range(4):
        assert sorted(mb for st, mb, _ in s.checkpointed if st == r) == list(range(8 - (4 - r - 1), 8))
    # interleaved: (v-1)p + 2(p-r-1) cool-down backwards, some of them early warm-up chunks
    s = interleaved_1f1b(4, 8, 2, "bubble", policy="cooldown")
    mine = sorted((st, mb) for st, mb, _ in s.checkpointed if s.stage_rank[st] == 0)
    assert len(mine) == 4 + 6 and (0, 2) in mine and (0, 3) in mine  # chunk 0 of mbs 2, 3: forward in the warm-up
    # every R sits right before its own backward
    for acts in s.ranks:
        for i, a in enumerate(acts):
            if a.op == "R":
                assert acts[i + 1] == Action("B", a.stage, a.mb, a.chunk)


def test_cooldown_in_the_bubble_is_free_in_the_simulator():
    """1F1B: at any latency. Interleaved (half-size chunks, shorter cool-down gaps): partly hidden at a low
    latency, free once a gradient hop takes half a chunk's backward."""
    for base, costs in ((one_f_one_b(4, 8), Costs(1, 2, 1, comm=0.0)), (one_f_one_b(4, 8), Costs(1, 2, 1, comm=0.25)),
                        (interleaved_1f1b(4, 8, 2), Costs(0.5, 1, 0.5, comm=0.5))):
        plain = simulate(base, costs)
        bubble = simulate(with_recompute(base, "bubble", "cooldown"), costs)
        inline = simulate(with_recompute(base, "inline", "cooldown"), costs)
        assert bubble.makespan == pytest.approx(plain.makespan) and inline.makespan > plain.makespan
    base, costs = interleaved_1f1b(4, 8, 2), Costs(0.5, 1, 0.5)
    plain, bubble, inline = (simulate(with_recompute(base, mode, "cooldown"), costs).makespan
                             for mode in ("none", "bubble", "inline"))
    assert plain < bubble < inline
    assert simulate(interleaved_1f1b(4, 8, 2, "bubble", policy="cooldown"), Costs(0.5, 1, 0.5)).peak_mb[0] < \
        simulate(interleaved_1f1b(4, 8, 2), Costs(0.5, 1, 0.5)).peak_mb[0]


def test_with_recompute_bad_input():
    with pytest.raises(ValueError, match="policy='fastest'"):
        with_recompute(one_f_one_b(2, 4), "bubble", "fastest")
    with pytest.raises(ValueError, match="takes no keep"):
        with_recompute(one_f_one_b(2, 4), "bubble", "cooldown", keep=1)
    with pytest.raises(ValueError, match="recompute='later'"):
        with_recompute(one_f_one_b(2, 4), "later")
    with pytest.raises(ValueError, match="F and B actions only"):
        with_recompute(zb_h1(2, 4), "bubble")
    with pytest.raises(ValueError, match="keep must be an int >= 1"):
        with_recompute(one_f_one_b(2, 4), "inline", keep=0)
    assert make_schedule("interleaved-recompute-bubble", 2, 4, policy="cooldown").name == \
        "interleaved-recompute-bubble-cooldown"


def test_bad_input_names_the_parameter():
    with pytest.raises(ValueError, match="m=1 micro-batches is too few"):
        l10.validate({"preset": "smoke", "m": 1}, 2)
    with pytest.raises(ValueError, match="m=6 must be divisible by world_size=4"):
        l10.validate({"preset": "smoke", "m": 6}, 4)
    with pytest.raises(ValueError, match=r"n_layer=6 must be divisible by v \* world_size=4"):
        l10.validate({"preset": "smoke", "n_layer": 6}, 2)
    with pytest.raises(ValueError, match="keep must be >= 1"):
        l10.validate({"preset": "smoke", "keep": 0}, 2)
    with pytest.raises(ValueError, match="preset='huge'"):
        l10.validate({"preset": "huge"}, 2)
