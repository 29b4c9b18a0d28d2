"""Lesson 06 (SDP4Bit): qWD replicas, two-level quantized reduce-scatter, Hadamard, bytes and bad input."""
from __future__ import annotations

import math

import pytest
import torch

from toolkit import launch
from toolkit.comm.sdp4bit import Codec, SDPConfig, check_topology
from toolkit.lessons import l06_sdp4bit
from toolkit.runtime.cluster import cluster


TWO_NODES = cluster("h100-ib400", ranks_per_node=2)  # the emulated nodes hold the lesson's


@pytest.fixture(scope="module")
def run4():  # 2 nodes x 2 ranks: the notebook's smoke run, which the suite's launch cache shares with nbval's
    return launch("l06_sdp4bit", 4, {"preset": "smoke"}, timeout_s=500, progress="none", cluster=TWO_NODES)


@pytest.fixture(scope="module")
def run2():
    """2 nodes x 1 rank, every byte crosses nodes: the run of the notebook's Try item (``world_size = 2``, no
    emulated cluster), which the suite's launch cache shares with tests/test_notebooks.py."""
    return launch("l06_sdp4bit", 2, {"preset": "smoke"}, timeout_s=400, progress="none")


@pytest.fixture(scope="module", params=[2, 4])
def inv(request):
    return request.param, launch("l06_sdp4bit:invariants", request.param, {}, timeout_s=400, progress="none")


def test_replicas_stay_bitwise_identical(run4, run2):
    for res in list(run4) + list(run2):
        for mode, r in res["runs"].items():
            assert r["replicas_identical"], mode


def test_bytes_from_the_ledger_match_the_formulas(run4):
    res = run4[0]
    n, L, A, W = res["runs"]["baseline"]["padded_numel"], res["local"], res["nodes"], res["world_size"]
    S = n // W
    base, sdp = res["runs"]["baseline"], res["runs"]["sdp4bit"]
    assert base["grads_bytes_by_link"] == {"intra-node": (L - 1) * 2 * n // L,
                                           "inter-node": (A - 1) * 2 * (n // L) // A}
    assert base["weights_bytes_per_step"] == (W - 1) * 2 * n // W
    assert sdp["grads_bytes_by_link"] == {"intra-node": (L - 1) * Codec(8, 128).row_bytes(A * S),
                                          "inter-node": (A - 1) * Codec(4, 128).row_bytes(S)}
    assert sdp["weights_bytes_per_step"] == (W - 1) * Codec(4, 2048).row_bytes(S)


def test_byte_targets(run4, run2):
    for res in (run4[0], run2[0]):
        base, sdp = res["runs"]["baseline"], res["runs"]["sdp4bit"]
        assert sdp["weights_bytes_per_step"] <= 0.26 * base["weights_bytes_per_step"]
        inter = sdp["grads_bytes_by_link"]["inter-node"] / base["grads_bytes_by_link"]["inter-node"]
        assert inter <= 0.35
    base, sdp = run2[0]["runs"]["baseline"], run2[0]["runs"]["sdp4bit"]
    assert sdp["grads_bytes_per_step"] <= 0.35 * base["grads_bytes_per_step"]  # all traffic is inter-node here


def test_loss_stays_close_and_snr_is_measured(run4):
    runs = run4[0]["runs"]
    base = runs["baseline"]["eval_loss"]
    for mode in ("sdp4bit", "sdp4bit_no_hadamard"):
        assert math.isfinite(runs[mode]["eval_loss"]) and abs(runs[mode]["eval_loss"] - base) / base < 0.05
    assert min(runs["sdp4bit"]["grad_snr_db"]) > 10 and min(runs["baseline"]["grad_snr_db"]) > 40
    assert min(runs["direct4"]["weight_snr_db"]) < min(runs["sdp4bit"]["weight_snr_db"]) - 20
    snr = run4[0]["snr"]["synthetic t(2)"]
    assert snr["TLq-HS"] > snr["TLq"] + 2  # Hadamard smoothing pays off on heavy tails


def test_every_seed_trains_every_mode_paired_with_the_baseline(run4):
    res = run4[0]
    assert [s["seed"] for s in res["seeds"]] == [0, 1, 2] and list(res["runs"]) == list(l06_sdp4bit.MODES)
    assert all(s["replicas_identical"][m] for r in run4 for s in r["seeds"] for m in res["runs"])
    assert res["seeds"][0]["eval_loss"] == {m: r["eval_loss"] for m, r in res["runs"].items()}
    base = [s["eval_loss"]["baseline"] for s in res["seeds"]]
    assert base[0] != base[1]  # another init and data order
    for mode, sp in res["spread"].items():
        assert sp["paired"]["values"] == [s["eval_loss"][mode] - s["eval_loss"]["baseline"] for s in res["seeds"]]
        assert sp["verdict"] in ("within noise", "higher", "lower")


def test_modes_without_the_baseline_get_it_first():  # every mode is judged against it (one seed: test_spread.py)
    assert l06_sdp4bit.validate({"preset": "smoke", "modes": ["sdp4bit"]}, 2)["modes"] == ["baseline", "sdp4bit"]


def test_emulated_step_by_phase_timed_as_the_real_model(run4, run2):
    res = run4[0]
    E, hw = res["emulated"], TWO_NODES
    for scale in ("toy", "matched"):
        for mode in ("baseline", "sdp4bit"):
            m = E[scale][mode]
            assert m["step_s"] == pytest.approx(m["compute_s"] + m["grads_s"] + m["optimizer_s"] + m["weights_s"])
            assert 0 < m["wire_s"] < m["grads_s"] + m["weights_s"]
        base, sdp = E[scale]["baseline"], E[scale]["sdp4bit"]
        # the same model, the same FLOPs; its time differs only by the launches the host can still hide behind the
        # previous phase's kernels (the phases are read off one clock; nothing lines host and stream up between them)
        assert base["compute_flops"] == sdp["compute_flops"]
        assert abs(base["compute_s"] - sdp["compute_s"]) < 5 * hw.gpu.efficiency.host_op_s
    # the 4-bit gradients and weights put fewer bytes on the wire and take less time there
    assert 0 < E["matched"]["sdp4bit"]["wire_s"] < E["matched"]["baseline"]["wire_s"]
    for check in E["check"].values():  # the cost model's traffic at this run's size is the emulated run's
        assert check["cost_model_s"] == pytest.approx(check["emulated_s"])
    ops = dict(E["codec_ops"]["sdp4bit"])  # quantize, dequantize, Hadamard: one Triton kernel each, as on a GPU
    assert {"quantize_int (Triton kernel)", "dequantize (Triton kernel)", "hadamard32 (Triton kernel)"} <= set(ops)
    assert "aten.bitwise_xor" not in ops  # the reference's hash is not what a GPU runs
    X = E["extrapolation"]
    for row in X["rows"]:
        assert row["speedup_free_codec"] > row["speedup"] > 0
    by = {(r["micro_batch"], r["grad_bytes"]): r["speedup"] for r in X["rows"]}
    assert by[1, 4] > by[1, 2] and by[1, 4] > by[4, 4]  # fp32 gradients, less compute: more to save
    need = X["inter_needed"]["g4"]
    assert need["measured"] < need["free"]  # a codec that costs time needs a slower network to pay off as much
    assert run2[0]["emulated"] is None  # no cluster


def test_hadamard_is_inverted_once_after_the_sums(inv):
    world, res = inv
    for r in res:
        assert r["hadamard_squared_is_32I"]
        assert r["off_rs_hadamard_max_rel_err"] < 1e-6  # rotate, (un)quantized sums, inverse once == plain
        assert r["tlq_hadamard_snr_db"] > r["tlq_snr_db"] + 2


def test_quantization_off_equals_plain_collectives(inv):
    world, res = inv
    for r in res:
        if world == 2:  # a + b is exact either way round: bitwise
            assert r["off_rs_bitwise"]
        assert r["off_rs_max_rel_err"] < 1e-6  # 4 ranks: (g0+g1)+(g2+g3) vs the ring's order
        assert r["off_ag_max_ulps"] <= 1.0  # W + (M - W) vs M: one rounding of the larger operand


def test_qwd_replicas_identical_and_error_does_not_accumulate(inv):
    _, res = inv
    for r in res:
        assert all(r["qwd_replicas_identical"])
        assert max(r["qwd_max_abs_err"]) < 1e-3  # bounded by one quantization step, every step


def test_nan_gradient_is_refused_on_every_rank(inv):
    _, res = inv
    assert all(r["nan_error"] and "NaN/Inf" in r["nan_error"] for r in res)


def test_bad_input_is_a_value_error():
    with pytest.raises(ValueError, match="world_size"):
        l06_sdp4bit.validate({"preset": "smoke"}, 1)
    with pytest.raises(ValueError, match="nodes=2 must divide world_size=3"):
        l06_sdp4bit.validate({"preset": "smoke"}, 3)
    with pytest.raises(ValueError, match="nodes"):
        l06_sdp4bit.validate({"preset": "smoke", "nodes": 0}, 4)
    with pytest.raises(ValueError, match="modes"):
        l06_sdp4bit.validate({"preset": "smoke", "modes": ["int2"]}, 2)
    with pytest.raises(ValueError, match="unknown cfg key 'mode'"):
        l06_sdp4bit.validate({"preset": "smoke", "mode": ["sdp4bit"]}, 2)
    with pytest.raises(ValueError, match="preset"):
        l06_sdp4bit.validate({"preset": "tiny"}, 2)
    with pytest.raises(ValueError, match="steps"):
        l06_sdp4bit.validate({"preset": "smoke", "steps": 0}, 2)
    with pytest.raises(ValueError, match="weights"):
        SDPConfig(weights="int2").validate(2)
    with pytest.raises(ValueError, match="weight_group"):
        SDPConfig(weight_group=100).validate(2)
    with pytest.raises(ValueError, match="inter_bits"):
        SDPConfig(inter_bits=2).validate(2)
    assert check_topology(4, 2) == 2 and check_topology(2, 2) == 1
    with pytest.raises(ValueError, match="multiple of block"):
        Codec(4, 128).encode(torch.zeros(2, 100))
    with pytest.raises(ValueError, match="NaN"):
        Codec(4, 128).encode(torch.full((1, 128), float("inf")))


def test_codec_round_trip():
    x = torch.randn(3, 256)
    for codec in (Codec(None), Codec(8, 128), Codec(4, 128, True)):
        buf = codec.encode(x, seed=1)
        assert buf.dtype == torch.uint8 and buf.shape == (3, codec.row_bytes(256))
        y = codec.decode(buf, 256)
        assert y.shape == x.shape
        if codec.bits is None:
            assert torch.equal(x, y)
        else:
            step = x.view(3, -1, codec.block).abs().amax(-1) / (2 ** (codec.bits - 1) - 1)
            assert bool(((x - y).view(3, -1, codec.block).abs() <= step[..., None] * 1.0001).all())
