"""ECHO hot-expert cloning (lesson 15): the greedy planner (pure, deterministic), the target on Zipf(1.2) routing,
every source's pairs split in the plan's proportions, the break-even cost model, and the runtime on real processes
(2 and 4 ranks): outputs and gradients equal to no cloning, home grad + Σ clone grads = the grad without cloning,
tokens conserved, clone weights bitwise the home's, the plan the same on every rank; the lesson's clone budgets on
the emulated cluster (virtual time, deterministic). No wall or CPU timing is asserted."""
from __future__ import annotations

import random

import pytest
import torch

from toolkit import launch
from toolkit.lessons import l15_echo as l15
from toolkit.lessons.l04_int8_a2a import collect_errors
from toolkit.moe.echo import (assign_slots, check_plan, clone_break_even, expert_counts, fit_cost_model, plan_clones,
                              proportional_split, zipf_routing)
from toolkit.runtime.cluster import cluster


# ---- the planner, without processes ---------------------------------------------------------------------------------
def test_plan_by_hand():
    # rank 0 holds experts 0, 1 (10 + 80 pairs), rank 1 experts 2, 3 (10 + 20): avg 60, expert 1 spills 30
    p = plan_clones([[10, 50, 5, 5], [0, 30, 5, 15]], local=2, spare_slots=1)
    assert p.load_before == [90, 30] and p.avg == 60 and p.spill == [0, 30, 0, 0] and p.capacity == [0, 30]
    assert [(c.expert, c.rank, c.slot, c.tokens) for c in p.clones] == [(1, 1, 2, 30)]
    assert p.load_after == [60, 60] and p.keep == [10, 50, 10, 20]
    assert all(check_plan(p).values())


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_target_zipf_8_experts_4_ranks(top_k, seed):
    R, E = 4, 8
    counts = torch.stack([expert_counts(zipf_routing(512, E, top_k, 1.2, seed=seed * 100 + r), E) for r in range(R)])
    p = plan_clones(counts, E // R, spare_slots=1)
    assert p.ratio(p.load_before) >= 1.8
    assert p.ratio(p.load_after) <= 1.15
    assert all(check_plan(p).values())


def test_plan_invariants_on_random_counts():
    rng = random.Random(0)
    for _ in range(300):
        R, local = rng.choice([2, 3, 4, 8]), rng.choice([1, 2, 3])
        counts = [[rng.choice([0, rng.randint(0, 50), rng.randint(0, 2000)]) for _ in range(R * local)] for _ in range(R)]
        spare, budget, min_tokens = rng.randint(0, 3), rng.choice([None, 0, 1, 3]), rng.choice([1, 10])
        p = plan_clones(counts, local, spare, budget, min_tokens)
        assert all(check_plan(p).values()), (counts, spare, budget)
        assert max(p.load_after) <= max(p.load_before)  # cloning never makes the busiest rank busier
        assert budget is None or len(p.clones) <= budget
        assert all(c.tokens >= min_tokens for c in p.clones)
        assert plan_clones(counts, local, spare, budget, min_tokens).to_dict() == p.to_dict()  # deterministic


def test_assign_slots_conserves_every_pair():
    R, E, K, local, spare = 4, 8, 2, 2, 1
    ids = [zipf_routing(100 + 7 * r, E, K, 1.2, seed=r) for r in range(R)]
    p = plan_clones(torch.stack([expert_counts(i, E) for i in ids]), local, spare)
    per_slot = sum(torch.bincount(assign_slots(i, p, r).reshape(-1), minlength=R * (local + spare)) for r, i in enumerate(ids))
    expected = torch.zeros(R * (local + spare), dtype=torch.long)
    for e, k in enumerate(p.keep):
        expected[(e // local) * (local + spare) + e % local] += k
    for c in p.clones:
        expected[c.rank * (local + spare) + c.slot] += c.tokens
    assert torch.equal(per_slot, expected)
    # a pair goes to its own expert's home or to a clone of that expert
    slot_expert = {r * (local + spare) + j: r * local + j for r in range(R) for j in range(local)}
    slot_expert.update({c.rank * (local + spare) + c.slot: c.expert for c in p.clones})
    for r, i in enumerate(ids):
        slots = assign_slots(i, p, r)
        assert all(slot_expert[s] == e for s, e in zip(slots.reshape(-1).tolist(), i.reshape(-1).tolist()))


def test_proportional_split_exact_totals_and_near_proportions():
    rng = random.Random(1)
    for _ in range(1000):
        S, J = rng.randint(1, 16), rng.randint(1, 5)
        per_source = [rng.choice([0, rng.randint(0, 20), rng.randint(0, 3000)]) for _ in range(S)]
        total = sum(per_source)
        cuts = sorted(rng.randint(0, total) for _ in range(J - 1))
        shares = [b - a for a, b in zip([0] + cuts, cuts + [total])]
        n = proportional_split(per_source, shares)
        assert [sum(row) for row in n] == per_source and [sum(col) for col in zip(*n)] == shares
        assert all(v >= 0 for row in n for v in row)
        if total:  # each source sends each place its share, to within the bound the docstring promises
            assert max(abs(n[s][j] - per_source[s] * shares[j] / total) for s in range(S) for j in range(J)) < 3
    assert proportional_split([10, 30], [20, 20]) == [[5, 5], [15, 15]]  # each source splits half and half
    with pytest.raises(ValueError, match="sum to the pairs 40"):
        proportional_split([10, 30], [20, 10])


def test_every_source_sends_each_clone_its_share():
    R, E, K, local, spare = 4, 8, 2, 2, 1
    ids = [zipf_routing(400, E, K, 1.2, seed=10 + r) for r in range(R)]
    p = plan_clones(torch.stack([expert_counts(i, E) for i in ids]), local, spare)
    assert p.clones
    per_rank = local + spare
    for e in {c.expert for c in p.clones}:
        places = [(e // local) * per_rank + e % local] + [c.rank * per_rank + c.slot for c in p.clones if c.expert == e]
        split = p.split(e)
        for r, i in enumerate(ids):
            slots = assign_slots(i, p, r).reshape(-1)[i.reshape(-1) == e]
            assert [int((slots == s).sum()) for s in places] == split[r]  # this source's row of the split
            assert all(split[r][j] > 0 for j in range(len(places)) if p.counts[r][e] >= 8 * len(places))


def test_clone_break_even_closed_form():
    h100 = cluster("h100-ib400")
    be = clone_break_even(7168, 2048, h100.inter, h100.gpu)
    params = 3 * 7168 * 2048  # a DeepSeek-V3 routed expert: SwiGLU, no biases
    assert be["params"] == params and be["bytes"] == 2 * params == 88_080_384 and be["rows"] == 3 * 2048
    clone_s = 2 * h100.inter.seconds(2 * params)  # out and back, one send each on the network link
    # forward 3 GEMMs of 2·h·h_ff, backward twice that, at the plateau large GEMMs reach on this GPU
    pair_s = 3 * 2 * 3 * 7168 * 2048 / (h100.gpu.bf16_flops * h100.gpu.efficiency.gemm)
    assert be["clone_s"] == pytest.approx(clone_s) and be["pair_s"] == pytest.approx(pair_s)
    assert be["break_even_pairs"] == pytest.approx(clone_s / pair_s)


def test_cost_model_fit_recovers_a_b_and_c():
    A, B, C = 2e-5, 1e-3, 7e-3
    tokens, clones = [1000, 800, 600, 500, 900], [0, 1, 2, 3, 3]
    fit = fit_cost_model(tokens, clones, [A * m + B * c + C for m, c in zip(tokens, clones)])
    assert abs(fit["A"] - A) < 1e-12 and abs(fit["B"] - B) < 1e-10 and abs(fit["C"] - C) < 1e-9
    assert fit["rank"] == 3 and fit["B_se"] < 1e-9 and fit["dof"] == 2 and fit["t95"] == 4.303
    # a fixed cost is not folded into A and B, and a negative B is reported as such
    fit = fit_cost_model(tokens, clones, [A * m - B * c + C for m, c in zip(tokens, clones)])
    assert abs(fit["B"] + B) < 1e-10 and abs(fit["C"] - C) < 1e-9
    # the inputs of lesson 15 fall together: the fit says so
    assert fit_cost_model([2325, 1678, 1151, 1024], [0, 1, 2, 3], [0.0145, 0.0122, 0.0100, 0.0091])["corr"] < -0.9
    with pytest.raises(ValueError, match="at least 3 points"):
        fit_cost_model([1, 2], [0, 1], [1.0, 2.0])


def test_bad_input_without_processes():
    with pytest.raises(ValueError, match="counts must be"):
        plan_clones([[1, 2, 3]], local=2, spare_slots=1)
    with pytest.raises(ValueError, match="counts must be >= 0"):
        plan_clones([[1, -2]], local=2, spare_slots=1)
    with pytest.raises(ValueError, match="spare_slots=-1"):
        plan_clones([[1, 2]], local=2, spare_slots=-1)
    with pytest.raises(ValueError, match="top_k=9 must be <= n_expert=8"):
        zipf_routing(10, 8, 9)
    with pytest.raises(ValueError, match="n_expert=6 must be divisible by world_size=4"):
        l15.validate({"preset": "smoke", "n_expert": 6}, 4)
    with pytest.raises(ValueError, match="top_k=9 must be in 1..n_expert=8"):
        l15.validate({"preset": "smoke", "top_k": 9}, 4)
    with pytest.raises(ValueError, match="budgets=.*at least 2 different"):
        l15.validate({"preset": "smoke", "budgets": [1, 1]}, 4)
    with pytest.raises(ValueError, match="tokens=1 must be >= 2"):
        l15.validate({"preset": "smoke", "tokens": 1}, 4)
    with pytest.raises(ValueError, match="spare_slots must be >= 1"):
        l15.validate({"preset": "smoke", "spare_slots": 0}, 4)


# ---- the runtime, on processes ---------------------------------------------------------------------------------------
def runtime(ctx, cfg) -> dict:
    cfg = l15.validate({"preset": "smoke"}, ctx.world_size)
    out = {"layer": l15.layer_section(ctx, cfg), "zipf": l15.plan_section(ctx, cfg)}
    out["errors"] = bad_inputs(ctx, cfg)
    return out


def bad_inputs(ctx, cfg) -> dict:
    from toolkit.moe import ExpertParallelMoE
    from toolkit.moe.echo import Echo
    bad = ctx.rank == ctx.world_size - 1

    def out_of_range():
        moe, plain, cloned, echo = l15.make_layers(cfg, ctx)
        if bad:
            cloned.router.ids = cloned.router.ids.clone()
            cloned.router.ids[3, 1] = cfg["n_expert"] + 2
        x, _ = l15.layer_tokens(cfg, ctx, moe.router.gate.in_features)
        cloned(x[None])

    def nan_logits():
        moe, plain, cloned, echo = l15.make_layers(cfg, ctx)
        x, _ = l15.layer_tokens(cfg, ctx, moe.router.gate.in_features)
        if bad:
            cloned.router.gate.gate.weight.data[0, 0] = float("nan")
        cloned(x[None])

    def no_spare_slots():
        moe, plain, cloned, echo = l15.make_layers(cfg, ctx)
        Echo(ExpertParallelMoE(moe))

    return collect_errors({"out_of_range": out_of_range, "nan_logits": nan_logits, "no_spare_slots": no_spare_slots})


@pytest.fixture(scope="module", params=[2, 4], ids=["ep2", "ep4"])
def results(request):
    return launch("tests.test_echo:runtime", request.param, {}, timeout_s=300, progress="none")


def test_equal_to_no_cloning(results):
    for r in results:
        L = r["layer"]
        assert L["outputs_close"] and L["grad_x_close"] and L["grad_router_close"] and L["grad_experts_close"], L
        assert L["home_plus_clone_grads_equal_plain"], L
        assert L["clones_bitwise_home"]


def test_tokens_conserved_and_loads_as_planned(results):
    for r in results:
        L = r["layer"]
        assert L["per_expert_pairs"] == L["routed_per_expert"]  # home + clones = what the router chose
        assert L["rank_loads"]["plain"] == L["planned_loads"]["plain"]  # the dispatcher's received pairs per rank
        assert L["rank_loads"]["echo"] == L["planned_loads"]["echo"]
        assert sum(L["rank_loads"]["echo"]) == sum(L["rank_loads"]["plain"])
        assert all(L["invariants"].values())
        assert max(L["rank_loads"]["echo"]) < max(L["rank_loads"]["plain"])


def test_plan_identical_on_every_rank_and_bytes(results):
    plans = [r["layer"]["plan"] for r in results]
    assert all(p == plans[0] for p in plans) and plans[0]["clones"]
    wb = [r["layer"]["weight_bytes"] for r in results]
    assert all(w["ledger"] == w["closed_form"] for w in wb)
    P = results[0]["layer"]["expert_params"]
    n_clones = len(plans[0]["clones"])
    assert sum(w["ledger"] for w in wb) == sum(w["grad_ledger"] for w in wb) == n_clones * P * 4
    assert sum(r["layer"]["clones_here"] for r in results) == sum(r["layer"]["clones_sent"] for r in results) == n_clones


def test_zipf_target_on_processes(results):
    if len(results) != 4:
        pytest.skip("the target is stated for 4 ranks")
    z = results[0]["zipf"]["plan"]
    assert z["ratio_before"] >= 1.8 and z["ratio_after"] <= 1.15


def test_bad_input_same_error_on_every_rank(results):
    errs = [r["errors"] for r in results]
    assert all(e == errs[0] for e in errs)
    assert "expert ids out of range on rank(s)" in errs[0]["out_of_range"]
    assert "router weights hold NaN/Inf" in errs[0]["nan_logits"]
    assert "ECHO needs spare expert slots" in errs[0]["no_spare_slots"]


def test_lesson_runs_at_smoke():
    h100 = cluster("h100-ib400")
    res = launch("l15_echo", 4, {"preset": "smoke"}, timeout_s=300, progress="none", cluster=h100)
    r0 = res[0]
    assert r0["zipf"]["plan"]["ratio_after"] <= 1.15 <= 1.8 <= r0["zipf"]["plan"]["ratio_before"]
    sweep = r0["zipf"]["budget_sweep"]
    assert [s["clones"] for s in sweep][:2] == [0, 1] and sweep[0]["ratio_after"] >= sweep[-1]["ratio_after"]
    rows = r0["timing"]["rows"]
    assert [row["clones"] for row in rows] == [0, 1, 2, 3]
    assert [row["max_rank_tokens"] for row in rows] == sorted((row["max_rank_tokens"] for row in rows), reverse=True)
    hist = r0["learned"]["history"]
    assert len(hist) == 4 and all(l["ratio_after"] <= l["ratio_before"] for h in hist for l in h["layers"])
    assert all(all(inv.values()) for inv in r0["learned"]["invariants"])
    # (c') on the emulated cluster, matched to DeepSeek-V3's experts: virtual times are deterministic
    em = r0["emulated"]
    # the slowest rank's step, gathered: the same points and fit on every rank
    assert all([p["step_s"] for p in r["emulated"]["points"]] == [p["step_s"] for p in em["points"]]
               and r["emulated"]["cost_model"] == em["cost_model"] for r in res)
    assert em["link"] == h100.intra.name and sorted({p["tokens"] for p in em["points"]}) == [128, 256]
    for t in (128, 256):
        clones = [p["clones"] for p in em["points"] if p["tokens"] == t]
        assert clones == sorted(clones) and clones[0] == 0 and clones[-1] >= 2
    fit = em["cost_model"]
    assert fit["rank"] == 3 and fit["dof"] == len(em["points"]) - 3 and fit["A"] > 0 and fit["B"] > 0
    # a pair's emulated cost is at least its expert work at the peak (the break-even's is at the GEMM plateau);
    # a clone's at most both transfers one at a time
    be = em["break_even"][h100.intra.name]
    assert be["pair_s"] * h100.gpu.efficiency.gemm <= fit["A"] and 0 < fit["B"] <= be["clone_s"] * 1.05
