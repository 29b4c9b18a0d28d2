"""Lesson 02 (MoE all-to-all overlap across two micro-batches): the overlapped schedule computes what the serial one
does, bit for bit, on real processes (2 and 4 ranks); the interleaving order; the cost model; bad input.
No timing is asserted (timings are in benchmarks/bench_moe_overlap.py)."""
from __future__ import annotations

import pytest
import torch

from toolkit import launch
from toolkit.lessons import l02_moe_overlap as l02
from toolkit.moe.overlap import SCHEDULES, Tracer, ratio_sweep, run_interleaved, run_serial, simulate, step


def equality(ctx, cfg) -> dict:
    """The lesson's check step (serial vs overlapped on identical models) at the smoke preset."""
    cfg = l02.validate({"preset": "smoke", **cfg}, ctx.world_size)
    return l02.check(ctx, cfg, l02.micro_batches(ctx, cfg))


@pytest.mark.parametrize("world", [2, 4])
def test_overlapped_equals_serial_bitwise(world):
    res = launch("tests.test_moe_overlap:equality", world, {}, timeout_s=300, progress="none")
    for r in res:
        assert r["losses_bitwise"] and r["grads_bitwise"] and r["grads_max_abs_diff"] == 0.0, r
        assert r["params_without_grad"] == []
        assert r["a2a_sent_bytes"]["serial"] == r["a2a_sent_bytes"]["overlapped"] > 0  # the same traffic
        # 2 layers x 2 micro-batches x (dispatch + combine) x (forward + backward)
        assert r["a2a_calls"] == {"serial": 16, "overlapped": 16}
        mem = r["memory"]  # both micro-batches' activations alive at once
        assert mem["overlapped"]["saved_bytes"] > 1.5 * mem["serial"]["saved_bytes"], mem


@pytest.fixture(scope="module")
def lesson():
    return launch("l02_moe_overlap", 2, {"preset": "smoke"}, timeout_s=300, progress="none")


def test_lesson_runs_and_traces_both_directions(lesson):
    for r in lesson:
        assert r["check"]["losses_bitwise"] and r["check"]["grads_bitwise"]
        for s in SCHEDULES:
            spans = [x for x in r["spans"] if x["meta"].get("schedule") == s]
            kinds = {(x["kind"], x["meta"].get("dir")) for x in spans}
            for kind in ("attn", "experts", "issue", "wait", "a2a"):
                assert (kind, "F") in kinds and (kind, "B") in kinds, (s, kind, sorted(kinds))
            # every transfer issued is waited on: 16 of each per step
            assert sum(x["kind"] == "issue" for x in spans) == sum(x["kind"] == "wait" for x in spans) == 16
            assert sum(x["kind"] == "a2a" for x in spans) == 16
        t = r["timing"]
        assert all(len(v) == 2 * 3 for v in t["exposed_a2a_all_s"].values())  # bench_steps x rounds
        assert r["cost_model"]["serial"]["overlap_fraction"] == 0.0
        # the count exchange is traced (forward only, 2 micro-batches x 2 layers) and enters the model as exposed
        assert sum(x["kind"] == "plan" and x["meta"].get("schedule") == "serial" for x in r["spans"]) == 4
        assert r["durations"]["plan"] > 0 and r["durations"]["embed_head_step"] > 0
        for s in SCHEDULES:
            assert r["cost_model"][s]["exposed_plan_s"] == 4 * r["durations"]["plan"]
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
    rows = ratio_sweep([0.1, 1.0, 4.0])
    assert all(r["overlapped_s"] <= r["serial_s"] for r in rows)
    best = max(rows, key=lambda r: r["speedup"])
    assert best["ratio"] == 1.0  # of these three: overlap pays most when communication is about as long as compute
    assert rows[0]["overlap_fraction"] > rows[2]["overlap_fraction"]


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
