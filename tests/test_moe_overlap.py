"""Lesson 02 (MoE all-to-all overlap across micro-batches): the forward-with-forward ("overlapped") and the
forward-under-backward ("fb") schedules compute what the serial one does, bit for bit, on real processes (2 and 4
ranks); the interleaving order; the cost model; bad input. No timing is asserted (benchmarks/bench_moe_overlap.py)."""
from __future__ import annotations

import pytest
import torch

from toolkit import launch
from toolkit.lessons import l02_moe_overlap as l02
from toolkit.moe.overlap import SCHEDULES, Tracer, ratio_sweep, run_interleaved, run_serial, simulate, step
from toolkit.runtime.cluster import cluster


def equality(ctx, cfg) -> dict:
    """The lesson's check step (serial vs overlapped on identical models) at the smoke preset."""
    cfg = l02.validate({"preset": "smoke", **cfg}, ctx.world_size)
    return l02.check(ctx, cfg, l02.micro_batches(ctx, cfg))


@pytest.mark.parametrize("world, m", [(2, 2), (4, 4)])
def test_overlaps_equal_serial(world, m):
    """fb runs each micro-batch's backward in turn, as serial does: bitwise. The forward-with-forward schedule runs
    one backward over all m losses, which sums the micro-batches' parameter gradients in the autograd engine's
    order: bitwise for m = 2 (a + b = b + a), within float rounding beyond (sums of three or more reassociate)."""
    res = launch("tests.test_moe_overlap:equality", world, {"m": m}, timeout_s=300, progress="none")
    for r in res:
        assert r["losses_bitwise"] == {"overlapped": True, "fb": True}, r
        assert r["grads_bitwise"]["fb"] and r["grads_max_abs_diff"]["fb"] == 0.0, r
        assert r["grads_bitwise"]["overlapped"] == (m == 2) and r["grads_max_abs_diff"]["overlapped"] <= 1e-6, r
        assert r["params_without_grad"] == []
        sent = r["a2a_sent_bytes"]
        assert sent["serial"] == sent["overlapped"] == sent["fb"] > 0  # the same traffic
        # 2 layers x m micro-batches x (dispatch + combine) x (forward + backward)
        assert r["a2a_calls"] == {"serial": 8 * m, "overlapped": 8 * m, "fb": 8 * m}
        mem = {s: v["saved_bytes"] for s, v in r["memory"].items()}  # every micro-batch alive vs at most two
        assert mem["overlapped"] > (m - 0.5) * mem["serial"] and mem["fb"] < 2.1 * mem["serial"], mem


@pytest.fixture(scope="module")
def lesson():  # the notebook's run at its defaults (one EP rank per emulated node): nbval's, shared by the cache
    return launch("l02_moe_overlap", 2, {"preset": "smoke"}, timeout_s=300, progress="none",
                  cluster=cluster("h100-ib400", ranks_per_node=1))


def test_lesson_runs_and_traces_both_directions(lesson):
    for r in lesson:
        assert all(r["check"]["losses_bitwise"].values()) and r["check"]["grads_bitwise"]["fb"]
        assert r["check"]["grads_max_abs_diff"]["overlapped"] <= 1e-6  # m = 4: see test_overlaps_equal_serial
        for s in SCHEDULES:
            spans = [x for x in r["spans"] if x["meta"].get("schedule") == s]
            kinds = {(x["kind"], x["meta"].get("dir")) for x in spans}
            for kind in ("attn", "experts", "issue", "wait", "a2a"):
                assert (kind, "F") in kinds and (kind, "B") in kinds, (s, kind, sorted(kinds))
            # every transfer issued is waited on: 32 of each per step (2 layers, 4 micro-batches, 2 ops, F and B)
            assert sum(x["kind"] == "issue" for x in spans) == sum(x["kind"] == "wait" for x in spans) == 32
            assert sum(x["kind"] == "a2a" for x in spans) == 32
        t = r["timing"]
        assert all(len(v) == 2 * 3 for v in t["exposed_a2a_all_s"].values())  # bench_steps x rounds
        assert r["cost_model"]["serial"]["overlap_fraction"] == 0.0
        # the count exchange is traced (forward only, 4 micro-batches x 2 layers) and enters the model as exposed
        assert sum(x["kind"] == "plan" and x["meta"].get("schedule") == "serial" for x in r["spans"]) == 8
        assert r["durations"]["plan"] > 0 and r["durations"]["embed_head_step"] > 0
        for s in SCHEDULES:
            assert r["cost_model"][s]["exposed_plan_s"] == 8 * r["durations"]["plan"]
    assert lesson[0]["sweep"] and lesson[1]["sweep"] is None


class _FakePending:
    def __init__(self, log, name):
        self.log, self.name = log, name
        log.append(f"issue {name}")

    def wait(self):
        self.log.append(f"wait {self.name}")
        return self.name


def _fake_forward(log, mb, layers=2):
    for layer in range(layers):
        log.append(f"attn {mb}{layer}")
        yield _FakePending(log, f"dispatch {mb}{layer}")
        log.append(f"experts {mb}{layer}")
        yield _FakePending(log, f"combine {mb}{layer}")
    return f"loss {mb}"


def test_interleaving_order():
    log = []
    assert run_interleaved([_fake_forward(log, "A"), _fake_forward(log, "B")]) == ["loss A", "loss B"]
    assert log[:14] == ["attn A0", "issue dispatch A0", "attn B0", "issue dispatch B0",
                        "wait dispatch A0", "experts A0", "issue combine A0",  # experts A while B dispatches
                        "wait dispatch B0", "experts B0", "issue combine B0",  # experts B while A combines
                        "wait combine A0", "attn A1", "issue dispatch A1",  # next attention of A while B combines
                        "wait combine B0"]
    log.clear()
    run_serial([_fake_forward(log, "A", 1)])
    assert log == ["attn A0", "issue dispatch A0", "wait dispatch A0", "experts A0", "issue combine A0",
                   "wait combine A0"]


def test_cost_model_by_hand():
    # serial: per micro-batch 4 s forward + 4 s backward, everything exposed
    s = simulate(1, 1, 1, 1, layers=1, m=2, schedule="serial", backward=1.0)
    assert s == {"step_s": 16.0, "compute_s": 8.0, "exposed_comm_s": 8.0, "exposed_plan_s": 0.0, "comm_s": 8,
                 "overlap_fraction": 0.0}
    # overlapped: forward ends at 5 (B's combine), backward at 10; exposed are the last forward transfer (B's
    # combine, nothing left to compute under it) and the first backward one (A's combine gradient)
    o = simulate(1, 1, 1, 1, layers=1, m=2, schedule="overlapped", backward=1.0)
    assert o == {"step_s": 10.0, "compute_s": 8.0, "exposed_comm_s": 2.0, "exposed_plan_s": 0.0, "comm_s": 8,
                 "overlap_fraction": 0.75}
    # a blocking count exchange of 0.5 s before each dispatch: serial 8.5 s per micro-batch, all exposed
    s = simulate(1, 1, 1, 1, layers=1, m=2, schedule="serial", backward=1.0, plan=0.5)
    assert s == {"step_s": 17.0, "compute_s": 8.0, "exposed_comm_s": 9.0, "exposed_plan_s": 1.0, "comm_s": 9.0,
                 "overlap_fraction": 0.0}
    # overlapped: attn A 0-1, plan A 1-1.5, dispatch A 1.5-2.5 under attn B 1.5-2.5, plan B 2.5-3, dispatch B 3-4
    # under experts A 3-4, combine A 4-5 under experts B 4-5, combine B 5-6 exposed; the backward 6-11 as before
    o = simulate(1, 1, 1, 1, layers=1, m=2, schedule="overlapped", backward=1.0, plan=0.5)
    assert o["step_s"] == 11.0 and o["exposed_comm_s"] == 3.0 and o["exposed_plan_s"] == 1.0
    assert abs(o["overlap_fraction"] - 2 / 3) < 1e-12
    # fb, one layer: F(A) alone 0-4 (its two transfers exposed); then F(B) with B(A), relative to 4: attn B 0-1,
    # dispatch B 1-2 on the link; B(A) opens with its combine gradient, queued behind it 2-3; experts B 2-3 (B's
    # input arrived at 2); combine B 3-4 on the link under experts-backward A 3-4 (A's gradient arrived at 3);
    # dispatch gradient A 4-5, exposed, the forward having nothing left; attn-backward A 5-6. Then B(B) alone 10-14
    f = simulate(1, 1, 1, 1, layers=1, m=2, schedule="fb", backward=1.0)
    assert f == {"step_s": 14.0, "compute_s": 8.0, "exposed_comm_s": 6.0, "exposed_plan_s": 0.0, "comm_s": 8.0,
                 "overlap_fraction": 0.25}
    rows = ratio_sweep([0.1, 1.0, 4.0])
    assert all(r["overlapped_s"] <= r["serial_s"] and r["fb_s"] <= r["serial_s"] for r in rows)
    best = max(rows, key=lambda r: r["speedup_overlapped"])
    assert best["ratio"] == 1.0  # of these three: overlap pays most when communication is about as long as compute
    assert rows[0]["overlap_fraction_overlapped"] > rows[2]["overlap_fraction_overlapped"]


def test_bad_input_names_the_parameter():
    with pytest.raises(ValueError, match="n_expert=6 must be divisible by world_size=4"):
        l02.validate({"preset": "smoke", "n_expert": 6}, 4)
    with pytest.raises(ValueError, match="top_k=5 must be in 1..n_expert=4"):
        l02.validate({"preset": "smoke", "top_k": 5}, 2)
    with pytest.raises(ValueError, match="seq_len=33 must be <= 32"):
        l02.validate({"preset": "smoke", "seq_len": 33}, 2)
    with pytest.raises(ValueError, match="schedule='fwd-bwd' is not allowed"):
        step(torch.nn.Module(), [], "fwd-bwd", Tracer())
    with pytest.raises(ValueError, match="dispatch=-1"):
        simulate(1, 1, -1, 1)
    with pytest.raises(ValueError, match="plan=-1"):
        simulate(1, 1, 1, 1, plan=-1)
