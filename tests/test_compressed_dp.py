"""The cost model of compressed data-parallel traffic (``toolkit.comm.compressed_dp``) against closed forms written
here, and the workload-matched factors of a data-parallel step (``toolkit.models.matched.dp_phase_scales``). Single process:
the lessons' tests (test_edgc, test_sdp4bit) check its traffic against their emulated runs."""
from __future__ import annotations

import math

import pytest

from toolkit.comm import compressed_dp as cost
from toolkit.comm.edgc import step_elements
from toolkit.models.catalog import Workload, get, train_seconds
from toolkit.models.matched import dp_phase_scales
from toolkit.runtime.cluster import cluster

HW = cluster("h100-ib400")


def test_a_gpus_matrices_hold_its_share_of_the_model():
    w = Workload("llama2-13b")
    for tp, pp in ((1, 1), (4, 2), (8, 1)):
        shapes, vectors = cost.gpu_matrices(w, tp, pp)
        held = sum(n * m for n, m in shapes) + vectors
        assert abs(held / (w.params / (tp * pp)) - 1) < 0.01
    shapes, _ = cost.gpu_matrices(w, 4, 2)
    assert (w.hidden // 4, w.hidden) in shapes and (w.hidden, w.model.ffn // 4) in shapes  # column / row parallel


def test_b_every_scheme_sends_its_closed_form():
    w, lay = Workload("llama2-7b"), cost.Layout(64, 4, 2, 4096)  # dp 8 across nodes: L = 2 per node, A = 4 nodes
    n, dp = w.params / 8, 8
    assert lay.dp == 8 and lay.per_node(HW) == 2 and lay.dp_link(HW) is HW.inter
    calls = lambda scheme, **kw: [(c.op, c.bytes, c.n, c.stride) for c in cost.dp_calls(scheme, w, lay, HW, **kw)]
    assert calls("allreduce") == [("all_reduce", 2 * 7 / 8 * n * 2, 8, 4)]
    assert calls("allreduce", g=4) == [("all_reduce", 2 * 7 / 8 * n * 4, 8, 4)]
    assert calls("sharded") == [("reduce_scatter", n / 2 * 2, 2, 4), ("reduce_scatter", 3 / 4 * n / 2 * 2, 4, 8),
                                ("all_gather", 7 / 8 * n * 2, 8, 4)]
    assert calls("sdp4bit") == [("reduce_scatter", n / 2 * (1 + 4 / 128), 2, 4),
                                ("reduce_scatter", 3 / 4 * n / 2 * (0.5 + 4 / 128), 4, 8),
                                ("all_gather", 7 / 8 * n * (0.5 + 4 / 2048), 8, 4)]
    shapes, vectors = cost.gpu_matrices(w, 4, 2)
    unc, p, q = step_elements(shapes, 8)
    assert calls("powersgd", rank=8) == [("all_reduce", 2 * 7 / 8 * e * 2, 8, 4) for e in (unc + vectors, p, q)]
    one_node = cost.Layout(8, 1, 1, 4096)
    assert one_node.dp_link(HW) is HW.intra  # eight ranks of one node
    inside = cost.traffic_s(cost.dp_calls("allreduce", w, one_node, HW), HW)
    across = cost.traffic_s(cost.dp_calls("allreduce", w, cost.Layout(64, 8, 1, 4096), HW), HW)  # dp 8 over 8 nodes
    assert 0 < inside < across  # NVLink against one NIC per rank


def test_c_step_adds_its_terms():
    w, lay = Workload("llama2-7b"), cost.Layout(32, 8, 1, 2048)
    got = cost.step("sdp4bit", w, lay, HW, codec=1e-11, optimizer=2e-12)
    n = w.params / 8
    # compute: the catalog's kernels for half a sequence of 4096 on tp 8 (the one model of compute time)
    assert got["compute_s"] == train_seconds(w.model, HW.gpu, 0.5, 4096, 8, 1)["total"]
    assert got["codec_s"] == pytest.approx(1e-11 * n) and got["optimizer_s"] == pytest.approx(2e-12 * n)
    assert got["traffic_s"] == cost.traffic_s(cost.dp_calls("sdp4bit", w, lay, HW), HW)
    assert got["step_s"] == pytest.approx(got["compute_s"] + got["traffic_s"] + got["codec_s"] + got["optimizer_s"])
    assert cost.step("sdp4bit", w, lay, HW, 0.0, compute=1.0)["compute_s"] == 1.0


def test_d_the_bandwidth_that_gives_a_speedup_gives_it():
    w, lay = Workload("gpt-18b"), cost.Layout(128, 8, 1, 2048)

    def ratio(on):
        return (cost.step("sharded", w, lay, on, 0.0, g=4)["step_s"]
                / cost.step("sdp4bit", w, lay, on, 0.0)["step_s"])

    bw = cost.inter_bandwidth_for(3.0, ratio, HW)
    assert bw is not None and ratio(cost.with_inter(HW, bw)) == pytest.approx(3.0, rel=1e-6)
    assert ratio(cost.with_inter(HW, bw / 2)) > 3.0 > ratio(cost.with_inter(HW, bw * 2))
    assert cost.inter_bandwidth_for(100.0, ratio, HW) is None  # more than the bytes shrink by: never


def test_e_workload_matched_factors_of_a_data_parallel_step():
    real = get("llama2-13b")
    got = dp_phase_scales(toy_params=40_000, toy_step_flops=5e7, toy_tokens=256, toy_hidden=32, real=real)
    assert got["compute"]["flops"] * 5e7 == pytest.approx(6 * real.params() * real.seq_len)
    assert got["compute"]["bytes"] == pytest.approx(real.seq_len * real.hidden / (256 * 32))
    assert got["gradient"] == {"flops": real.params() / 40_000, "bytes": real.params() / 40_000}


@pytest.mark.parametrize("call, match", [
    (lambda: cost.Layout(12, 8, 1, 1).check(HW), "tp·pp = 8 must divide gpus=12"),
    (lambda: cost.Layout(32, 16, 1, 1).check(HW), "tp=16 exceeds the 8 GPUs of one node"),
    (lambda: cost.Layout(32, 4, 1, 0).check(HW), "tokens=0 is not allowed"),
    (lambda: cost.step("allreduce", Workload(), cost.Layout(8, 1, 1, 1), HW, -1.0), "codec"),
    (lambda: cost.step("allreduce", Workload(), cost.Layout(8, 1, 1, 1), HW, 0.0, optimizer=math.inf),
     "optimizer"),
    (lambda: cost.dp_calls("int2", Workload(), cost.Layout(8, 1, 1, 1), HW), "scheme='int2'"),
    (lambda: cost.dp_calls("powersgd", Workload(), cost.Layout(8, 1, 1, 1), HW), "needs the rank"),
])
def test_bad_input_names_what_is_wrong(call, match):
    with pytest.raises(ValueError, match=match):
        call()
