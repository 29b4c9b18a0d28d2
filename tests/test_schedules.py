"""Schedules and the simulator (no processes): closed forms, memory, torch's orders, bad input."""
from __future__ import annotations

import pytest

from toolkit.pipeline import (Action, Costs, Schedule, closed_form_bubble, dualpipev, fb, from_torch, gpipe,
                              interleaved_1f1b, linear_layout, make_schedule, one_f_one_b, simulate,
                              torch_order_missing, zb_h1)
from toolkit.pipeline.torch_compare import compare_orders

PS = [2, 3, 4, 8]
# torch's orders: torch >= 2.8, its DualPipeV >= 2.9 (toolkit.runtime.compat); skipped, saying why, before that
needs_torch_orders = pytest.mark.skipif(torch_order_missing("dualpipev") is not None,
                                        reason=str(torch_order_missing("dualpipev")))


# -- closed forms ---------------------------------------------------------------------------------
@pytest.mark.parametrize("p", PS)
@pytest.mark.parametrize("costs", [Costs(1, 2, 1), Costs(2, 3, 1), Costs(1.3, 2.1, 0.7)])
@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved"])
def test_1f1b_family_bubble_is_the_closed_form(name, p, costs):
    for m in (2 * p, 3 * p):
        res = simulate(make_schedule(name, p, m), costs)
        assert res.idle == pytest.approx([closed_form_bubble(name, p, costs)] * p, abs=1e-9)
        assert res.bubble_fraction == pytest.approx(res.bubble / res.makespan)


def test_interleaved_bubble_is_1f1b_over_v_for_the_same_model():
    rank_costs = Costs(2, 4, 2)  # one rank's layers; each of v chunks costs 1/v of it
    for p in PS:
        for v in (2, 4):
            res = simulate(interleaved_1f1b(p, 2 * p, v), rank_costs.scaled(1 / v))
            assert res.bubble == pytest.approx((p - 1) * (rank_costs.F + rank_costs.B) / v)


@pytest.mark.parametrize("p", PS)
@pytest.mark.parametrize("costs", [Costs(1, 2, 1), Costs(3, 2, 1), Costs(1, 3, 1), Costs(1.3, 2.1, 0.7), Costs(2, 3, 1)])
def test_zb_h1_bubble_is_the_closed_form(p, costs):
    # (p-1)(F+B-2W) holds while W <= F and W <= B - W (every costs here satisfies that)
    for m in (p, 2 * p + 1):
        assert simulate(zb_h1(p, m), costs).bubble == pytest.approx(closed_form_bubble("zb-h1", p, costs))


@pytest.mark.parametrize("p", PS)
@pytest.mark.parametrize("costs", [Costs(1, 2, 1), Costs(2, 3, 1), Costs(1, 2, 1, FB=2.5), Costs(1.5, 2.5, 1, FB=3),
                                   Costs(2, 3, 1, FB=4)])
def test_dualpipev_bubble_is_the_closed_form(p, costs):
    # (PP/2-1)(F&B+B-3W), PP = 2p, holds when the forward and the input backward cost the same (F = B - W)
    # and W <= F
    for m in (2 * p, 2 * p + 3):
        assert simulate(dualpipev(p, m), costs).bubble == pytest.approx(closed_form_bubble("dualpipev", p, costs))


def test_closed_forms_are_not_exact_outside_their_assumptions():
    costs = Costs(1, 2, 0.5)  # F = 1, B - W = 1.5: DualPipeV's formula assumes F = B - W
    res = simulate(dualpipev(4, 8), costs)
    assert res.bubble == pytest.approx(9.5) and closed_form_bubble("dualpipev", 4, costs) == pytest.approx(10.5)
    costs = Costs(2, 3, 2)  # W > B - W: ZB-H1's deferred W no longer fit its bubbles
    assert simulate(zb_h1(4, 8), costs).bubble == pytest.approx(6) and closed_form_bubble("zb-h1", 4, costs) == 3


def test_overlap_shrinks_the_dualpipev_bubble_and_earlier_ranks_idle_less():
    plain, overlapped = simulate(dualpipev(4, 8), Costs(1, 2, 1)), simulate(dualpipev(4, 8), Costs(1, 2, 1, FB=2.5))
    assert overlapped.makespan < plain.makespan
    assert overlapped.idle == sorted(overlapped.idle)  # rank 0 idles least


def test_communication_latency_lengthens_the_step():
    s = one_f_one_b(4, 8)
    assert simulate(s, Costs(1, 2, 1, comm=0.5)).makespan > simulate(s, Costs(1, 2, 1)).makespan


# -- memory -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("p", PS)
def test_peak_activation_memory(p):
    c = Costs(1, 2, 1)
    assert simulate(one_f_one_b(p, 2 * p), c).peak_mb == [p - r for r in range(p)]
    assert simulate(gpipe(p, 2 * p), c).peak_mb == [2 * p] * p
    assert simulate(zb_h1(p, 2 * p), c).peak_mb == [p] * p
    for v in (2, 3):
        assert simulate(interleaved_1f1b(p, 2 * p, v), c).peak_mb[0] == pytest.approx(p + (p - 1) / v)
    dpv = simulate(dualpipev(p, 2 * p + 2), c)
    assert dpv.peak_chunks == [2 * p + 1] * p  # stage-chunks; half a rank's layers each
    assert dpv.peak_mb == [p + 0.5] * p


# -- structure and torch ----------------------------------------------------------------------------
@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 8])
def test_dualpipev_counts(p):
    m = 2 * p + 1
    s = dualpipev(p, m)
    for r, acts in enumerate(s.ranks):
        parts = [x for a in acts for x in a.parts]
        for stage in (r, 2 * p - 1 - r):
            assert sum(x.op == "F" and x.stage == stage for x in parts) == m
            assert sum(x.op in ("B", "I") and x.stage == stage for x in parts) == m
        assert sum(x.op == "W" for x in parts) == sum(x.op == "I" for x in parts)


@needs_torch_orders
@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 8])
def test_dualpipev_order_is_torchs(p):
    for m in (2 * p, 2 * p + 1, 3 * p + 2):
        assert compare_orders(dualpipev(p, m), "dualpipev")["identical"]


@needs_torch_orders
@pytest.mark.parametrize("p", [2, 3, 4])
def test_gpipe_and_interleaved_orders_are_torchs(p):
    for m in (p, 2 * p, 3 * p):
        assert compare_orders(gpipe(p, m), "gpipe")["identical"]
        assert compare_orders(interleaved_1f1b(p, m), "interleaved")["identical"]


@needs_torch_orders
@pytest.mark.parametrize("p", [2, 3, 4])
def test_torch_1f1b_ir_numbers_the_last_rank_from_1(p):
    # torch 2.13: Schedule1F1B.pipeline_order (display IR) skips F0 on the last rank; all other ranks match
    result = compare_orders(one_f_one_b(p, 2 * p), "1f1b")
    assert result["diffs"] == [(p - 1, 0, f"{p - 1}F0", f"{p - 1}F1")]


@needs_torch_orders
def test_from_torch_returns_a_checked_schedule():
    assert from_torch("dualpipev", 2, 4).to_strings() == dualpipev(2, 4).to_strings()
    with pytest.raises(ValueError, match="torch-1F1B: stage 1 micro-batch 0 chunk 0 has 0 F"):
        from_torch("1f1b", 2, 4)  # torch 2.13's display IR of 1F1B is incomplete (see compare_orders)


def test_unpaired_dualpipev_is_the_same_order_without_fb_actions():
    paired, unpaired = dualpipev(4, 9), dualpipev(4, 9, pair=False)
    assert unpaired.name == "dualpipev-unpaired" and not any(a.op == "FB" for acts in unpaired.ranks for a in acts)
    assert [[x for a in acts for x in a.parts] for acts in paired.ranks] == unpaired.ranks
    # a pair starts when both halves' inputs are there: without an overlap gain that only costs time
    assert simulate(unpaired, Costs(1, 2, 1)).makespan < simulate(paired, Costs(1, 2, 1)).makespan
    assert simulate(paired, Costs(1, 2, 1, FB=2.5)).makespan < simulate(unpaired, Costs(1, 2, 1, FB=2.5)).makespan


@needs_torch_orders
def test_torch_zbv_order_runs_in_the_simulator():
    s = from_torch("zbv", 4, 8).check()
    assert simulate(s, Costs(1, 2, 1)).bubble < simulate(one_f_one_b(4, 8), Costs(1, 2, 1)).bubble


def test_action_notation():
    assert str(Action("F", 3, 1)) == "3F1" and str(Action("B", 0, 2, chunk=1)) == "0B2.1"
    assert str(fb(Action("F", 0, 3), Action("B", 3, 1))) == "(0F3;3B1)FB"
    assert Action("I", 1, 2).key == Action("B", 1, 2).key == ("bwd", 1, 2, 0)
    with pytest.raises(ValueError, match="FB needs"):
        fb(Action("B", 0, 0), Action("F", 1, 0))


# -- recompute -------------------------------------------------------------------------------------
@pytest.mark.parametrize("p,keep", [(2, 1), (4, 1), (4, 2), (4, 3)])
def test_recompute_caps_memory_and_the_bubble_hides_it(p, keep):
    c = Costs(1, 2, 1, comm=0.25)
    none, inline, bubble = (simulate(one_f_one_b(p, 2 * p, mode, keep), c) for mode in ("none", "inline", "bubble"))
    assert max(inline.peak_chunks) <= keep and max(bubble.peak_chunks) <= keep
    assert none.makespan < bubble.makespan < inline.makespan
    s = one_f_one_b(p, 2 * p, "bubble", keep)
    for acts in s.ranks:  # every R sits right before its backward
        for i, a in enumerate(acts):
            if a.op == "R":
                assert acts[i + 1] == Action("B", a.stage, a.mb)


def test_recompute_nothing_when_the_cap_is_not_binding():
    assert not one_f_one_b(2, 4, "bubble", keep=2).checkpointed


# -- bad input --------------------------------------------------------------------------------------
def test_bad_input_names_the_parameter():
    with pytest.raises(ValueError, match="schedule='zb-h2'"):
        make_schedule("zb-h2", 2, 4)
    with pytest.raises(ValueError, match="schedule '1f1b' takes no option v; its options: none"):
        make_schedule("1f1b", 4, 8, v=2)
    with pytest.raises(ValueError, match="takes no option keep; its options: \\['v'\\]"):
        make_schedule("interleaved", 4, 8, keep=2)
    assert make_schedule("interleaved", 4, 8, v=4).meta["v"] == 4
    with pytest.raises(ValueError, match="pair must be True or False"):
        dualpipev(2, 4, pair="no")
    with pytest.raises(ValueError, match="m must be an int >= 4.*DualPipeV"):
        dualpipev(2, 3)
    with pytest.raises(ValueError, match="m must be an int >= 4.*1F1B"):
        one_f_one_b(4, 3)
    with pytest.raises(ValueError, match="m=6 must be a multiple of p=4"):
        interleaved_1f1b(4, 6)
    with pytest.raises(ValueError, match="p must be"):
        gpipe(0, 4)
    with pytest.raises(ValueError, match="recompute="):
        one_f_one_b(2, 4, "sometimes")
    for bad in ({"F": 0}, {"B": -1}, {"W": 0}, {"FB": 0.0}, {"R": -2}):
        with pytest.raises(ValueError, match=f"cost {next(iter(bad))} must be > 0"):
            Costs(**bad)
    with pytest.raises(ValueError, match="cost W=2 must be < B=2"):
        Costs(F=1, B=2, W=2)
    with pytest.raises(ValueError, match="cost comm"):
        Costs(comm=-1)


def test_inconsistent_schedules_are_caught():
    with pytest.raises(ValueError, match="has 1 F and 0 backward"):
        Schedule("broken", [[Action("F", 0, 0)]], linear_layout(1), 1).check()
    with pytest.raises(ValueError, match="lives on rank 1"):
        Schedule("misplaced", [[Action("F", 1, 0)], []], linear_layout(2), 1).check()
    backwards_first = Schedule("deadlock", [[Action("B", 0, 0), Action("F", 0, 0)]], linear_layout(1), 1)
    with pytest.raises(ValueError, match="deadlock"):
        simulate(backwards_first, Costs())


@pytest.mark.parametrize("name", ["1f1b", "interleaved", "zb-h1", "dualpipev"])
def test_every_send_has_one_receive_on_the_peer(name):
    s = make_schedule(name, 4, 8)
    sends = [(a.stage + (1 if a.op == "SEND_F" else -1), a.mb, a.op[-1]) for r in range(4)
             for a in s.with_comms(r) if a.op.startswith("SEND")]
    recvs = [(a.stage, a.mb, a.op[-1]) for r in range(4) for a in s.with_comms(r) if a.op.startswith("RECV")]
    assert sorted(sends) == sorted(recvs) and len(set(recvs)) == len(recvs)
    for r in range(4):  # a receive is posted before the action that consumes it
        order = [str(a) for a in s.with_comms(r)]
        for a in s.ranks[r]:
            for part in a.parts:
                for msg in s.recvs(part):
                    assert order.index(str(msg)) < order.index(str(a))


def test_figures_build_from_simulated_and_measured_spans():
    from toolkit.viz.pipeline import explorer, memory_steps, schedule_gantt
    sim = simulate(dualpipev(2, 4), Costs(1, 2, 1, FB=2.5))
    fig = schedule_gantt(sim, title="t")
    assert {t.name for t in fig.data} == {"F", "B", "I", "W", "F&B"}
    assert len(memory_steps(sim).data) == 2
    measured = [{"rank": 0, "kind": "F", "start": 5.0, "end": 5.5, "meta": {"mb": 0}},
                {"rank": 1, "kind": "B", "start": 5.5, "end": 6.0, "meta": {"mb": 0}}]
    assert min(schedule_gantt(measured).data[0].base) == 0.0  # rebased to the step's first action
    box = explorer("1f1b", p=2, m=4).widget()
    box.children[1].children[1].value = 8  # m below p: the explorer reports instead of raising
    assert box.children[1].children[0].value == "1f1b"


def test_measured_costs_that_contradict_a_backward_are_noted_never_fatal():
    """On a loaded machine a measured W can come out as long as its whole B: the costs say so and still
    simulate (W taken as ``W_CAP`` of B), as lesson 03 does with its measured chunk costs."""
    from toolkit.pipeline.simulate import MeasuredCosts
    rows = [{"op": "F", "stage": s, "seconds": 1.0e-3} for s in range(8)]
    rows += [{"op": "B", "stage": s, "seconds": 1.58e-3} for s in range(8)]
    rows += [{"op": "W", "stage": s, "seconds": 1.68e-3 if s == 3 else 0.7e-3} for s in range(8)]
    noisy = MeasuredCosts(rows)
    assert noisy.noisy() == ["stage 3: W 1.680 ms >= B 1.580 ms"]
    assert noisy.seconds("I", 3) == pytest.approx(0.05 * 1.58e-3)
    assert simulate(dualpipev(4, 8), noisy).makespan > 0
    worse = MeasuredCosts([r if r["op"] != "W" else {**r, "seconds": 1.7e-3} for r in rows])
    c = worse.mean()
    assert c.W == pytest.approx(MeasuredCosts.W_CAP * c.B) and len(worse.noisy()) == 9
    assert MeasuredCosts([r for r in rows if r["stage"] != 3]).noisy() == []


def test_a_new_schedule_is_added_by_its_definition_alone():
    """Register a toy schedule with what it needs; make_schedule, the simulator, the planner and compose accept it
    and hold a layout to its own rule, with nothing else edited."""
    from toolkit import planner
    from toolkit.compose import ComposeConfig
    from toolkit.pipeline import SCHEDULES, Needs, check_layout, register
    from toolkit.pipeline import schedule as registry
    register("toy-1f1b", lambda p, m: one_f_one_b(p, m), Needs(min_m=3, why="the toy wants three rounds"))
    try:
        assert simulate(make_schedule("toy-1f1b", 2, 6), Costs()).makespan > 0
        with pytest.raises(ValueError, match="too few: toy-1f1b needs m >= 3 × pp = 6 .the toy wants three rounds"):
            check_layout("toy-1f1b", 2, 5)
        rows = planner.choose(planner.Workload("llama2-7b", global_batch=64), "a100-ib200", 16,
                              schedules=("toy-1f1b",))
        piped = [r for r in rows if r["pp"] > 1]
        assert piped and all(r["schedule"] == "toy-1f1b" and r["m"] >= 3 * r["pp"] for r in piped)
        base = ComposeConfig(schedule="toy-1f1b", pp=2, dp=2, n_layer=4, m=6)
        assert base.validate(4).n_stages == 2
        with pytest.raises(ValueError, match="toy-1f1b needs m >= 3 × pp"):
            base.replace(m=4).validate(4)
    finally:
        del SCHEDULES["toy-1f1b"], registry.NEEDS["toy-1f1b"]
