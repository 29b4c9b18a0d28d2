"""Lesson 16 on real processes (dp × pp = 2 × 2 and 2 × 1): the DP all-reduce separated from DualPipeV's
compute, per stage or bucket by bucket, equals the plain one bitwise (dp = 2) and one process within float
tolerance; buckets leave inside the stage's last gradient op; the emulated cluster's DP waits; op counting,
capture audit and the replay model; bad input."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from toolkit import launch
from toolkit.graphs import OpCounter, audit, count_ops, dispatch_cost, replay_model
from toolkit.graphs import cuda_graphs
from toolkit.lessons import l16_cuda_graphs as l16
from toolkit.pipeline import make_schedule
from toolkit.pipeline.dp_separate import DataParallelSeparation, last_grad_ops, make_buckets, written_by
from toolkit.pipeline.executor import split_weight_grads
from toolkit.runtime.cluster import cluster

FAST = {"warmup": 0, "bench_steps": 1, "rounds": 1}


@pytest.fixture(scope="module")
def grid2x2():
    from toolkit.runtime.cluster import cluster
    return launch("l16_cuda_graphs", 4, {"preset": "smoke"}, timeout_s=400, progress="none",
                  cluster=cluster("h100-ib400", ranks_per_node=2))


@pytest.fixture(scope="module")
def dp2():
    return launch("l16_cuda_graphs", 2, {"preset": "smoke", "pp": 1, "dp": 2, "n_layer": 2, **FAST},
                  timeout_s=400, progress="none")


@pytest.fixture(params=["grid2x2", "dp2"])
def results(request):
    return request.getfixturevalue(request.param)


def test_separated_dp_communication_is_bitwise_the_plain_one(results):
    for r in results:
        assert r["dp"] == 2  # bucketed is bitwise the plain one at dp = 2 only (a sum of two has one order)
        assert r["grads_bitwise_plain_vs_separated"] and r["grads_bitwise_plain_vs_bucketed"] and r["losses_equal"]
        assert r["runs"]["plain"]["dp_bytes"] == r["runs"]["separated"]["dp_bytes"] == r["runs"]["bucketed"]["dp_bytes"]
        buckets = r["runs"]["bucketed"]["reduces"]
        assert len(buckets) > len(r["stages"])  # the smoke preset's bucket_bytes cuts every stage
        assert sum(x["bytes"] for x in buckets) == sum(x["bytes"] for x in r["runs"]["plain"]["reduces"])
        for stage in r["stages"]:  # per stage, its buckets in order, at least bucket_bytes but the last
            mine = [x for x in buckets if x["stage"] == stage]
            assert [x["bucket"] for x in mine] == list(range(len(mine)))
            assert all(x["bytes"] >= l16.PRESETS["smoke"]["bucket_bytes"] for x in mine[:-1])


def test_both_equal_one_process_over_all_micro_batches(results):
    losses = [r["runs"]["separated"]["loss"] for r in results if r["runs"]["separated"]["loss"] is not None]
    assert len(losses) == results[0]["dp"]
    assert abs(sum(losses) / len(losses) - results[0]["ref_loss"]) <= 1e-5
    for r in results:
        for name in l16.VARIANTS:
            assert r["runs"][name]["grad_max_diff"] <= 1e-5, (r["rank"], name)


def test_one_all_reduce_per_stage_of_the_stage_gradients(results):
    for r in results:
        reduces = r["runs"]["separated"]["reduces"]
        assert sorted(x["stage"] for x in reduces) == sorted(r["stages"])
        dp = r["dp"]
        assert r["runs"]["separated"]["dp_bytes"] == sum(2 * (dp - 1) * x["bytes"] // dp for x in reduces)
        # the phase-1 chunk (the later stage on this rank) is done first and leaves first
        assert reduces[0]["stage"] == max(r["stages"])


def test_separated_reduces_leave_before_the_last_op_plain_after_it(grid2x2):
    for r in grid2x2:
        for name in l16.VARIANTS:
            t = r["traced"][name]
            ops = [s for s in t["spans"] if s["meta"].get("lane") != "dp"]
            first_issue = min(x["issued"] for x in t["reduces"])
            if name == "plain":
                assert first_issue >= max(s["end"] for s in ops)
            else:
                assert first_issue <= max(s["start"] for s in ops)  # in flight while the schedule still runs
            assert {s["kind"] for s in t["spans"]} >= {"F", "W", "DP all-reduce"}


def test_buckets_leave_inside_the_stages_last_gradient_op(grid2x2):
    for r in grid2x2:
        t = r["traced"]["bucketed"]
        ops = [s for s in t["spans"] if s["meta"].get("lane") != "dp"]
        for stage in r["stages"]:
            last = max((s for s in ops if s["meta"]["stage"] == stage and s["kind"] in ("B", "I", "W")),
                       key=lambda s: s["start"])
            issued = sorted(x["issued"] for x in t["reduces"] if x["stage"] == stage)
            assert last["start"] <= issued[0] < last["end"], (r["rank"], stage)  # the first, before the op ends


def test_op_counts_host_cost_and_audit(grid2x2):
    r0 = grid2x2[0]
    for c in r0["chunks"].values():
        assert c["ops"]["forward"] > 10 and c["ops"]["backward"] > c["ops"]["forward"]
        assert abs(c["tiny_ops"]["forward"] - c["ops"]["forward"]) <= 2  # the op count does not depend on shape
        assert c["tiny_time_s"]["forward_s"] > 0
        for p in ("forward", "backward"):  # views (t, view, transpose, detach, ...) are dispatched, launch nothing
            assert 0 < c["compute_ops"][p] < c["ops"][p]
        assert {"aten.t", "aten.view", "aten.detach"} <= set(c["op_types"]["no_kernel"])
    a = r0["audit"]
    assert a["dense stage: forward + backward"] == {}
    assert "aten.nonzero" in a["MoE block: forward + backward"]
    assert "c10d.allreduce_" in a["DP gradient all-reduce"]
    assert "aten._local_scalar_dense" in a["the loss read on the host (.item())"]


def test_graph_replay_on_the_emulated_cluster_removes_launches_and_separation_the_dp_wait(grid2x2):
    """Virtual time is deterministic: the assertions are about the model, not about this machine's speed."""
    for r in grid2x2:
        runs = r["emulated"]["runs"]
        for dp in ("plain", "separated"):
            eager, graphed = runs[f"eager · {dp}"], runs[f"graphed · {dp}"]
            assert eager["launch_s"] > 4 * graphed["launch_s"] and graphed["step_s"] < eager["step_s"]
        assert runs["eager · separated"]["dp_wait_s"] <= runs["eager · plain"]["dp_wait_s"]
        # a graph saves the host's per-op cost, not the kernels': every one of them still takes the device's
        # fixed time of a kernel (kernels counted by the eager run's host costs, one eager op each)
        hw = cluster("h100-ib400")
        kernels = runs["eager · plain"]["launch_s"] / hw.gpu.efficiency.host_op_s
        assert runs["graphed · plain"]["step_s"] >= kernels * hw.gpu.efficiency.kernel_min_s
        assert "graphed · bucketed" not in runs


def test_matched_dp_waits_on_the_emulated_cluster(grid2x2):
    """Matched to a real model's layers, plain DP waits for its reduces after the last op; separated, the
    phase-1 chunk's reduce hides behind the phase-0 chunk (and, at a step's calibrated kernel rates on this grid,
    the phase-0 chunk's too); bucket by bucket never waits longer than separated."""
    for r in grid2x2:
        runs = r["emulated"]["matched"]["runs"]
        assert runs["bucketed"]["dp_wait_s"] <= runs["separated"]["dp_wait_s"] < runs["plain"]["dp_wait_s"]
        first = str(min(r["stages"]))  # the phase-0 chunk: done last
        assert runs["separated"]["dp_wait_by_stage"][str(max(r["stages"]))] == 0  # hidden behind the other chunk
        assert runs["bucketed"]["dp_wait_by_stage"][first] <= runs["separated"]["dp_wait_by_stage"][first]
        assert runs["bucketed"]["reduces"] > runs["separated"]["reduces"] == len(r["stages"])


def test_last_grad_ops_from_the_schedule():
    s = make_schedule("dualpipev", 2, 4)
    last = last_grad_ops(s, 0)
    flat = [p for a in s.ranks[0] for p in a.parts]
    assert set(last) == {0, 3}
    for stage, i in last.items():
        assert flat[i].stage == stage and flat[i].op in ("B", "I", "W")
        assert not any(p.stage == stage and p.op in ("B", "I", "W") for p in flat[i + 1:])
    assert last[3] < last[0] == len(flat) - 1


def test_buckets_and_what_each_gradient_op_writes():
    block = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    params = list(block.parameters())  # 0.w 0.b ln.w ln.b 2.w 2.b
    assert make_buckets(params, None) == [params[::-1]]
    buckets = make_buckets(params, 64)  # 2.b (8 B) + 2.w (64 B) | ln.b + ln.w (64 B) | 0.b + 0.w
    assert [[id(p) for p in b] for b in buckets] == [[id(p) for p in params[::-1][i:i + 2]] for i in (0, 2, 4)]
    assert make_buckets(params, 10 ** 9) == [params[::-1]]
    split_weight_grads(block)
    linears = {id(p) for i in (0, 2) for p in block[i].parameters()}
    assert written_by("W", block) == linears and written_by("B", block) == {id(p) for p in params}
    assert written_by("I", block) == {id(p) for p in block[1].parameters()}


def test_op_counter_and_audit_on_small_functions():
    lin = nn.Linear(4, 3)
    x = torch.randn(2, 4, requires_grad=True)
    ops = count_ops(lambda: lin(x).sum())
    assert ops["forward"].get("aten.addmm") == 1 and ops["backward"].get("aten.mm", 0) >= 1
    with OpCounter() as c:
        torch.ones(3).add_(1)
    assert c.total == 2 and c.compute == 2
    with OpCounter() as c:
        y = torch.ones(3, 2).view(6, 1).t().expand(2, 6).detach()
        torch.empty(3)
        y.sum()
    assert c.total == 7 and c.compute == 2 and c.no_kernel == {"aten.t", "aten.view", "aten.expand", "aten.detach",
                                                               "aten.empty"}
    assert "aten.addmm" not in ops["no_kernel"] and "aten.t" in ops["no_kernel"]
    assert audit(lambda: lin(x)) == {}
    assert set(audit(lambda: torch.tensor([0, 1, 2]).nonzero())) == {"aten.nonzero"}
    assert set(audit(lambda: torch.ones(1).item())) == {"aten._local_scalar_dense"}


def test_dispatch_cost_synchronizes_only_on_cuda(monkeypatch):
    calls = []
    monkeypatch.setattr(cuda_graphs.torch.cuda, "synchronize", lambda *a: calls.append(a))
    lin = nn.Linear(4, 3)
    x = torch.randn(2, 4)
    t = dispatch_cost(lambda: lin(x).sum(), repeats=2)
    assert calls == [] and t["forward_s"] > 0 and t["backward_s"] > 0
    dispatch_cost(lambda: lin(x).sum(), repeats=2, device=torch.device("cuda", 0))
    assert len(calls) == 3 * (2 + 3)  # before, between and after the two passes, warm-up calls included


def test_replay_model():
    launch_bound = replay_model(n_ops=100, t_op=10e-6, t_device=100e-6, t_replay=10e-6)
    assert launch_bound["eager_s"] == pytest.approx(1e-3) and launch_bound["speedup"] == pytest.approx(10.0)
    assert replay_model(100, 10e-6, 5e-3, 10e-6)["speedup"] == 1.0  # compute-bound: nothing to gain


def test_bad_input_names_the_parameter():
    with pytest.raises(ValueError, match=r"dp=2 × pp=2 = 4 must equal world_size=2"):
        l16.validate({"preset": "smoke"}, 2)
    with pytest.raises(ValueError, match="m=2 micro-batches is too few"):
        l16.validate({"preset": "smoke", "m": 2}, 4)
    with pytest.raises(ValueError, match="n_layer=6 must be divisible by the 4 pipeline stages of dualpipev on pp=2"):
        l16.validate({"preset": "smoke", "n_layer": 6}, 4)
    with pytest.raises(ValueError, match="dp must be >= 1"):
        l16.validate({"preset": "smoke", "dp": 0}, 4)
    with pytest.raises(ValueError, match="bucket_bytes must be >= 1"):
        l16.validate({"preset": "smoke", "bucket_bytes": 0}, 4)
    with pytest.raises(ValueError, match="bucket_bytes=0 must be None"):
        DataParallelSeparation(bucket_bytes=0)
    with pytest.raises(ValueError, match="bucket_bytes needs separate=True"):
        DataParallelSeparation(separate=False, bucket_bytes=1024)
