"""Dynamic context parallelism: ring attention equals full attention, the scheduler's invariants on the corpus's
document lengths, the cost model's wiring, real runs at world size 2 and 4, bad input."""
from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest
import torch

from toolkit import launch
from toolkit.context import dcp_sim
from toolkit.context import dynamic_cp as dcp
from toolkit.context import ring_attention as ra
from toolkit.lessons import l12_dynamic_cp as lesson
from toolkit.pipeline.simulate import closed_form_bubble, Costs
from toolkit.runtime.cluster import cluster


# ---- layout and one-process ring attention ------------------------------------------------------------------------
@pytest.mark.parametrize("cp", [1, 2, 4, 8])
def test_layout_partitions_the_packed_tokens(cp):
    lengths = [16 * cp, 2 * cp, 6 * cp]
    layout = ra.CPLayout(lengths, cp)
    held = torch.cat([layout.coords(j)[2] for j in range(cp)])
    assert sorted(held.tolist()) == list(range(sum(lengths)))  # every token on exactly one rank
    assert all(len(layout.coords(j)[2]) == layout.tokens_per_rank for j in range(cp))


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_balanced_layout_equalises_causal_work(cp):
    balanced, contiguous = ra.causal_pairs(64 * cp, cp), ra.causal_pairs(64 * cp, cp, balanced=False)
    assert len(set(balanced)) == 1 and sum(balanced) == sum(contiguous)
    assert contiguous[-1] > 2 * contiguous[0]


def test_ring_attention_on_one_rank_equals_full_attention():
    torch.manual_seed(0)
    lengths = [5, 12, 3, 8]
    q, k, v = (torch.randn(2, sum(lengths), 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    ref = ra.packed_causal_attention(q, k, v, lengths)
    out = ra.ring_attention(q, k, v, ra.CPLayout(lengths, 1))
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    g = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_ring_bytes_closed_form():
    assert ra.ring_bytes(100, 64, 1, 4) == {"forward": 0, "backward": 0}
    block = 2 * 100 * 64 * 4
    assert ra.ring_bytes(100, 64, 4, 4) == {"forward": 3 * block, "backward": 3 * block + 4 * block}


@pytest.mark.parametrize("lengths, cp, match", [([6], 2, "multiple of 2\\*cp = 4"), ([8], 3, "cp=3"),
                                                ([], 2, "must not be empty")])
def test_layout_bad_input(lengths, cp, match):
    with pytest.raises(ValueError, match=match):
        ra.CPLayout(lengths, cp)


# ---- the scheduler --------------------------------------------------------------------------------------------------
def _corpus_batch(n: int, world: int, cap: int, static_cp: int, scale: int, seed: int) -> list[int]:
    return [dcp.pad_length(x, 2 * world) for x in dcp_sim.corpus_lengths(n, static_cp * cap, seed, scale)]


def test_cp_size_is_the_smallest_power_of_two_under_the_cap():
    assert [dcp.cp_size_for(n, 100) for n in (1, 100, 101, 200, 201, 400, 401)] == [1, 1, 2, 2, 4, 4, 8]
    assert dcp.cp_size_for(50, 100, min_cp=2) == 2
    with pytest.raises(ValueError, match="longer than the CP cap max_cp\\*cap = 400"):
        dcp.cp_size_for(401, 100, max_cp=4)


CASES = [(32, 4, 128, 2, 128), (32, 4, 256, 2, 64), (64, 4, 256, 2, 64), (64, 8, 512, 4, 16), (256, 8, 8192, 8, 1)]


@pytest.mark.parametrize("n, world, cap, static_cp, scale", CASES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dynamic_plan_invariants_and_balance_target(n, world, cap, static_cp, scale, seed):
    lengths = _corpus_batch(n, world, cap, static_cp, scale, seed)
    need = [dcp.cp_size_for(x, cap) for x in lengths]
    for kwargs in ({}, {"refill": False, "max_imbalance": None}):  # the toolkit's scheduler, Megatron's rules
        plan = dcp.schedule_dynamic(lengths, world, cap, **kwargs)
        plan.check()  # each sample once, aligned power-of-two groups, tokens per rank <= cap
        sizes = plan.cp_sizes()
        assert all(sizes[s] >= need[s] and ra.is_power_of_two(sizes[s]) for s in range(n))
        for i in range(len(plan.micro_batches)):  # no rank idles in a dynamic micro-batch
            assert all(t > 0 for t in plan.tokens(i))
    assert max(dcp.schedule_dynamic(lengths, world, cap).balance()) <= 1.1  # the target
    static = dcp.schedule_static(lengths, world, static_cp, cap)
    static.check()
    assert set(static.cp_sizes().values()) == {static_cp}


def test_static_packs_in_data_order_within_cp_times_cap():
    lengths = [60, 50, 30, 90, 10, 10, 100, 40]
    plan = dcp.schedule_static(lengths, 4, 2, 64)  # packs of <= 128 tokens, 2 replicas
    packs = [g.samples for mb in plan.micro_batches for g in mb.groups]
    assert [s for p in packs for s in p] == list(range(8))
    assert packs == [[0, 1], [2, 3], [4, 5, 6], [7]]
    assert [g.start for g in plan.micro_batches[0].groups] == [0, 2]


def test_the_docstring_example():
    lengths = [620, 300, 100, 440, 420, 80, 60]
    static = dcp.schedule_static(lengths, 4, 2, 512)
    assert [g.samples for g in static.micro_batches[0].groups] == [[0, 1, 2], [3, 4, 5, 6]]
    assert static.work(0) == [242200, 242200, 190000, 190000]
    plan = dcp.schedule_dynamic(lengths, 4, 512)
    assert [(g.size, g.start, g.samples) for g in plan.micro_batches[0].groups] == [(2, 0, [0]), (1, 2, [3]),
                                                                                   (1, 3, [4, 5])]
    assert plan.work(0) == [192200, 192200, 193600, 182800]


def test_megatron_rules_first_micro_batch():
    # 4 ranks, cap 100: the two 200s need cp 2 and open both halves; the rest waits for later micro-batches
    plan = dcp.schedule_dynamic([200, 40, 200, 80, 60], 4, 100, refill=False, max_imbalance=None)
    first = plan.micro_batches[0].groups
    assert [(g.size, g.start, g.samples) for g in first] == [(2, 0, [0]), (2, 2, [2])]
    plan.check()


def test_empty_ranks_double_the_smallest_group():
    plan = dcp.schedule_dynamic([64, 48], 4, 64, refill=False, max_imbalance=None)
    (mb,) = plan.micro_batches
    assert [(g.size, g.start) for g in mb.groups] == [(2, 0), (2, 2)]  # two cp-1 sequences, four ranks


def test_merge_spreads_a_lone_long_sequence():
    lengths = [64, 8, 8, 8]  # 64 alone on a rank would be 64x the work of the others
    plan = dcp.schedule_dynamic(lengths, 4, 64)
    assert max(plan.balance()) <= 1.1
    megatron = dcp.schedule_dynamic(lengths, 4, 64, refill=False, max_imbalance=None)
    assert max(megatron.balance()) > 1.1
    assert sum(r["forward"] for r in plan.ring_bytes(1, 1, 1)) > sum(r["forward"] for r in megatron.ring_bytes(1, 1, 1))


@pytest.mark.parametrize("call, match", [
    (lambda: dcp.schedule_dynamic([10, 900], 4, 200), "sample 1 has 900 tokens, longer than the CP cap"),
    (lambda: dcp.schedule_dynamic([10, 20], 6, 200), "n_ranks \\(DP\\*CP\\)=6 must be a power of two"),
    (lambda: dcp.schedule_dynamic([10, 20], 4, 200, min_cp=3), "min_cp=3 must be a power of two"),
    (lambda: dcp.schedule_dynamic([10, 0], 4, 200), "sample 1 has length 0"),
    (lambda: dcp.schedule_static([10, 20], 4, 3, 200), "cp=3 must be a power of two"),
    (lambda: dcp.schedule_static([10, 500], 4, 2, 200), "longer than the CP cap cp\\*cap = 2\\*200 = 400")])
def test_scheduler_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_plan_check_catches_a_lost_sample():
    plan = dcp.schedule_dynamic([64, 48, 32], 2, 64)
    plan.micro_batches[0].groups[0].samples.pop()
    with pytest.raises(AssertionError, match="exactly once"):
        plan.check()


# ---- the cost model -------------------------------------------------------------------------------------------------
def test_equal_micro_batches_give_the_1f1b_closed_form():
    plan = dcp.schedule_static([128] * 16, 2, 2, 64)  # 16 equal micro-batches of one cp-2 group
    shape, hw = dcp_sim.LLAMA_13B, dcp_sim.CLUSTER
    sim = dcp_sim.step_time(plan, shape, hw, pp=4)
    t = dcp_sim.group_times(64, 128 ** 2 / 2, 2, shape.n_layer // 4, shape, hw)
    ideal = 16 * (t["F"] + t["B"]) + closed_form_bubble("1f1b", 4, Costs(t["F"], t["B"], t["B"] / 2))
    assert sim["m"] == 16 and sim["step_s"] == pytest.approx(ideal)


def test_the_cost_model_reads_the_cluster_and_the_efficiency():
    """GEMMs and attention at the efficiencies of the GPU's peak, a ring hop at α + bytes/β of the link the CP
    group spans: hand-computed from the same figures."""
    shape, hw, eff = dcp_sim.LLAMA_13B, dcp_sim.CLUSTER, dcp_sim.Efficiency()
    assert hw.intra is dcp_sim.RING_HOP and hw.gpu == cluster("h100-ib400").gpu
    tokens, cp, d, dkv = 1024, 1, shape.d_model, shape.d_kv
    t = dcp_sim.group_times(tokens, tokens ** 2 / 2, cp, 1, shape, hw, recompute=False)
    linear = 2 * tokens * (2 * d * d + 2 * d * dkv + 3 * d * shape.d_ff) / (hw.gpu.bf16_flops * eff.gemm)
    attention = 2 * d * tokens ** 2 / 2 / (hw.gpu.bf16_flops * eff.attention)
    assert t["F"] == pytest.approx(linear + attention) and t["exposed_comm"] == 0  # cp = 1: no ring
    slow_attention = dcp_sim.group_times(tokens, tokens ** 2 / 2, cp, 1, shape, hw, False, replace(eff, attention=0.225))
    assert slow_attention["F"] == pytest.approx(linear + 2 * attention)
    # a ring of c ranks: c - 1 hops, each exposed but for 1/c of the attention (here far too short to hide one)
    kv_bytes, tiny = 2 * tokens * dkv * shape.elem_bytes, 2 * d / (hw.gpu.bf16_flops * eff.attention)
    for c, link in ((2, hw.intra), (16, hw.inter)):  # 16 ranks span two nodes of 8
        ring = dcp_sim.group_times(tokens, 1.0, c, 1, shape, hw, recompute=False)
        assert ring["F"] == pytest.approx(linear + tiny + (c - 1) * (link.seconds(kv_bytes) - tiny / c))
    with pytest.raises(ValueError, match="Efficiency gemm=0"):
        dcp_sim.Efficiency(gemm=0)


def test_short_sequences_cost_static_cp_exposed_ring_time():
    lengths = [random.Random(s).randint(100, 2000) for s in range(400)] + [60000]  # one long one forces static CP 8
    out = dcp_sim.compare(lengths, dcp_sim.Setup(gbs=len(lengths)))
    assert out["static_cp"] == 8
    runs = out["runs"]
    assert runs["dynamic"]["exposed_comm_s"] < runs["static"]["exposed_comm_s"]
    assert runs["dynamic"]["speedup_vs_static"] > 1
    assert math.isclose(runs["static"]["speedup_vs_static"], 1.0)
    with pytest.raises(ValueError, match="fewer than the pp=8 stages"):
        dcp_sim.compare(lengths[:20], dcp_sim.Setup(gbs=20))


# ---- real processes -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=[4, 2], ids=["world4", "world2"])
def run(request):
    return request.param, launch("l12_dynamic_cp", request.param, {"preset": "smoke"}, timeout_s=600,
                                 progress="none")


def test_every_sample_scheduled_once_and_routed(run):
    world, results = run
    r0 = results[0]
    plans = lesson.plans_of(r0)
    for name, plan in plans.items():
        plan.check()
        assert all(r["plans"][name] == r0["plans"][name] for r in results)  # the same plan on every rank
        for r in results:  # what the all_to_all delivered is what the plan gives the rank
            assert r["tokens_per_mb"][name] == [plan.tokens(i)[r["rank"]] for i in range(len(plan.micro_batches))]
    assert max(plans["dynamic"].balance()) <= 1.1
    assert set(plans) == set(r0["bench"]) == {"static", "dynamic-megatron", "dynamic"}  # every plan is timed


def test_plans_come_from_the_resolved_cfg_the_run_returns(run):
    world, results = run
    r0 = results[0]
    cfg = r0["cfg"]
    assert cfg == lesson.validate({"preset": "smoke"}, world)
    assert all(r["cfg"] == cfg for r in results)
    plans = lesson.plans_of(r0)
    megatron = dcp.schedule_dynamic(r0["padded"], world, cfg["cap"], cfg["min_cp"], refill=False, max_imbalance=None)
    assert plans["dynamic-megatron"].to_json() == megatron.to_json()
    assert plans["dynamic"].to_json() == dcp.schedule_dynamic(r0["padded"], world, cfg["cap"], cfg["min_cp"]).to_json()


def test_per_token_loss_and_grads_equal_the_unpacked_reference(run):
    _, results = run
    for r in results:
        ref = r["checked"]["reference"]["loss_per_token"]
        for name in ("static", "dynamic-megatron", "dynamic"):
            got = r["checked"][name]
            assert abs(got["loss_per_token"] - ref) <= lesson.LOSS_RTOL * ref, (name, got, ref)
            assert got["max_grad_diff"] <= lesson.GRAD_ATOL, (name, got)


def test_ring_bytes_equal_the_closed_form_and_attention_equals_full(run):
    world, results = run
    for r in results:
        for name, by_dir in r["ring_bytes"].items():
            for direction, b in by_dir.items():
                assert b["ledger"] == b["closed_form"], (r["rank"], name, direction, b)
        sc = r["selfcheck"]
        assert sc["cp"] == world and max(sc["max_abs_diff"].values()) <= 1e-5
        assert sc["sent_bytes"] == sc["closed_form"]
    assert any(b["ledger"] > 0 for r in results for b in r["ring_bytes"]["static"].values())


# ---- bad input, before any process starts ------------------------------------------------------------------------
@pytest.mark.parametrize("cfg, world, match", [
    ({"static_cp": 3}, 4, "static_cp=3 must be a power of two"),
    ({"static_cp": 8}, 4, "static_cp=8 must divide world_size=4"),
    ({"min_cp": 3}, 4, "min_cp=3 must be a power of two"),
    ({}, 3, "world_size=3 must be a power of two"),
    ({}, 1, "world_size=1"),
    ({"cap": 100}, 4, "cap=100 must be a multiple of 2\\*world_size=8"),
    ({"lengths": [8, 300, 16, 8]}, 4, "lengths\\[1\\]=300: longer than the CP cap static_cp\\*cap = 2\\*128 = 256"),
    ({"lengths": [8, 16, 24]}, 4, "multiple of world_size=4")])
def test_validate_rejects_bad_input(cfg, world, match):
    with pytest.raises(ValueError, match=match):
        lesson.validate({"preset": "smoke", **cfg}, world)


def test_launch_rejects_before_starting():
    with pytest.raises(ValueError, match="static_cp=3"):
        launch("l12_dynamic_cp", 4, {"preset": "smoke", "static_cp": 3}, progress="none")
