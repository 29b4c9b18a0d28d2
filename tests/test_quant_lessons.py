"""Lessons 09 (block-wise INT8 vs FP8) and 04 (int8 all-to-all): invariants on real processes, targets, bad input."""
import math

import pytest
import torch
import torch.nn.functional as F

from toolkit import launch
from toolkit import quant as Q
from toolkit.comm import quant_a2a
from toolkit.lessons import l04_int8_a2a as l04
from toolkit.lessons import l09_int8_vs_fp8 as l09


# ---- lesson 09 ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def l09_results():
    # the notebook's smoke run, which the suite's launch cache shares with nbval's
    return launch("l09_int8_vs_fp8", 2, {"preset": "smoke"}, timeout_s=300, progress="none")


def test_l09_ranks_split_the_grid_and_gather_it(l09_results):
    r0, r1 = l09_results
    assert r0["rows"] == r1["rows"] and r0["curves"] == r1["curves"]  # every rank holds the gathered table
    cfg = l09.validate({"preset": "smoke"}, 2)
    assert min(r0["tasks_per_rank"]) > 0 and sum(r0["tasks_per_rank"]) == len(l09._tasks(cfg))
    keys = [(r["kind"], r["data"], r["fmt"], r["block"]) for r in r0["rows"]]
    assert len(keys) == len(set(keys)) == (len(l09.DATASETS) + len(l09.GEMM_CASES)) * 2 * len(cfg["blocks"])
    assert set(r0["curves"]) == {"bf16", "bf16@1", "int8", "fp8_e4m3", "int4"}


def test_l09_targets(l09_results):
    rows = l09_results[0]["rows"]
    q = lambda data, fmt, block: next(r["qsnr_db"] for r in rows if (r["kind"], r["data"], r["fmt"], r["block"])
                                      == ("tensor", data, fmt, block))
    assert q("gaussian", "int8", 128) >= q("gaussian", "fp8_e4m3", 128) + 10  # INT8 ~43.8 vs FP8 ~31.8 dB
    assert q("outlier_channels", "fp8_e4m3", 128) > q("outlier_channels", "int8", 128)
    assert abs(q("gaussian", "fp8_e4m3", 128) - 31.8) < 0.5  # E4M3 theory ~31.5 dB, + a little from block scaling
    kappa = l09_results[0]["kappa"]
    assert abs(kappa["int8_minus_theory_db"]) < 0.5  # INT8 = 52.9 - 20 log10(kappa)
    assert kappa["crossover_kappa"] is not None and 4 < kappa["crossover_kappa"] < math.sqrt(128)
    for c in l09_results[0]["curves"].values():
        assert len(c["losses"]) == l09.validate({"preset": "smoke"}, 2)["steps"]
        assert all(math.isfinite(v) for v in c["losses"])


def test_l09_validate_names_the_parameter():
    with pytest.raises(ValueError, match="preset"):
        l09.validate({"preset": "huge"}, 2)
    with pytest.raises(ValueError, match="fmts"):
        l09.validate({"fmts": ["int3"]}, 2)
    with pytest.raises(ValueError, match="fmts"):
        l09.validate({"fmts": ["int8@1"]}, 2)  # seed offsets only for training runs
    with pytest.raises(ValueError, match="train_fmts"):
        l09.validate({"train_fmts": ["bf16@x"]}, 2)
    with pytest.raises(ValueError, match="blocks"):
        l09.validate({"blocks": [-1]}, 2)
    with pytest.raises(ValueError, match="train_block"):
        l09.validate({"train_block": 33}, 2)
    with pytest.raises(ValueError, match="outliers"):
        l09.validate({"outliers": 0}, 2)


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8_e4m3"])
@pytest.mark.parametrize("block", [32, 128, 0])
def test_fake_quantize_rows_equals_quantize_then_dequantize(fmt, block):
    """The training fast path computes the same bits as the Quantized round trip, row blocks padded."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 300, generator=g) * torch.logspace(-3, 2, 300)
    x[1] = 0.0
    if block:
        pad = torch.nn.functional.pad(x, (0, (-300) % block))
        expected = Q.fake_quantize(pad, fmt, block)[:, :300]
    else:
        expected = Q.fake_quantize(x, fmt, x.numel())
    assert torch.equal(Q.fake_quantize_rows(x, fmt, block), expected)
    assert torch.equal(Q.fake_quantize_rows(x, "none", block), x)
    assert torch.equal(Q.fake_quantize_rows(x, "bf16", block), x.bfloat16().float())


def test_fake_quant_linear_gradients():
    """Format "none" is F.linear exactly (forward and the three GEMMs' gradients); int8 is close to it."""
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(6, 10, 64, generator=g), torch.randn(48, 64, generator=g), torch.randn(48, generator=g)
    grads = {}
    for fmt in ("ref", "none", "int8"):
        xs, ws, bs = (t.clone().requires_grad_(True) for t in (x, w, b))
        y = F.linear(xs, ws, bs) if fmt == "ref" else Q.fake_quant_linear(xs, ws, bs, fmt, 32)
        (y * torch.linspace(-1, 1, 48)).sum().backward()
        grads[fmt] = (y.detach(), xs.grad, ws.grad, bs.grad)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(grads["ref"], grads["none"]))
    assert all(Q.qsnr_db(a, b) > 35 for a, b in zip(grads["ref"], grads["int8"]))


def test_quantize_gemms_replaces_block_linears_only():
    from toolkit.models import GPT, preset
    model = GPT(preset("smoke"))
    n_params = sum(p.numel() for p in model.parameters())
    assert Q.quantize_gemms(model, "int8", 32) == 4 * model.cfg.n_layer  # qkv, proj, fc1, fc2 per block
    assert isinstance(model.head.out, torch.nn.Linear)  # the output head stays in high precision
    assert sum(p.numel() for p in model.parameters()) == n_params  # wrappers share the parameters
    with pytest.raises(ValueError, match="fmt"):
        Q.FakeQuantLinear(torch.nn.Linear(4, 4), "int2")


# ---- lesson 04 ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def l04_results():
    # the notebook's smoke run, which the suite's launch cache shares with nbval's
    return launch("l04_int8_a2a", 2, {"preset": "smoke"}, timeout_s=300, progress="none")


def test_l04_invariants_on_two_ranks(l04_results):
    for res in l04_results:
        inv = res["invariants"]
        assert inv["int8_payload_bitwise"] and inv["off_equals_plain_bitwise"]
        assert inv["int8_error_within_half_step"] and inv["zero_tokens_ok"] and inv["empty_rank_backward_ok"]
        assert inv["ep_matches_local_moe_max_abs"] < 1e-5


def test_l04_int8_bytes_target_from_the_ledger(l04_results):
    sent = {m: sum(r["wire"]["sent_bytes"][m] for r in l04_results) for m in ("none", "bf16", "int8", "int4")}
    assert sent["int8"] <= 0.52 * sent["bf16"]
    assert sent["int8"] * 128 == sent["bf16"] * 132 // 2  # H + 4H/128 bytes vs 2H per token, exactly
    assert sent["int4"] * 128 == sent["bf16"] * 68 // 2 and sent["none"] == 2 * sent["bf16"]
    for r in l04_results:  # training dispatch is quantized, the combine is not
        c = r["curves"]
        assert c["int8"]["sent_bytes_per_step"]["dispatch"] < 0.6 * c["bf16"]["sent_bytes_per_step"]["dispatch"]
        assert all(math.isfinite(v) for v in c["int8"]["losses"])


def test_l04_snr(l04_results):
    snr = {(row["data"], row["mode"]): row["snr_db"] for row in l04_results[0]["wire"]["rows"]}
    assert snr[("gaussian", "none")] == math.inf
    assert abs(snr[("gaussian", "int8")] - 43.8) < 1.0 and abs(snr[("gaussian", "int4")] - 18.6) < 1.0
    assert snr[("outlier_channels", "int8")] < snr[("gaussian", "int8")]


def test_l04_invariants_on_four_ranks():
    """Uneven splits, one expert per rank."""
    res = launch("l04_int8_a2a:invariants", 4, {"preset": "smoke"}, timeout_s=300, progress="none")
    for inv in res:
        assert all(v for k, v in inv.items() if isinstance(v, bool)), inv
        assert inv["ep_matches_local_moe_max_abs"] < 1e-5


def test_l04_bad_input_on_one_rank_raises_on_every_rank():
    res = launch("l04_int8_a2a:bad_inputs", 2, {"preset": "smoke"}, timeout_s=300, progress="none")
    assert res[0] == res[1]  # the same error on both ranks, and no hang
    msg = res[0]
    assert "ranks disagree on the all-to-all mode (rank 0: 'int8', rank 1: 'int4')" in msg["ranks_disagree_on_bits"]
    assert "block (rank 0: 128, rank 1: 64)" in msg["ranks_disagree_on_block"]
    assert "rank(s) [1] passed NaN/Inf" in msg["nan_on_one_rank"]
    assert "rank(s) [1] passed an unsupported dtype" in msg["unsupported_dtype"]
    assert "rank(s) [1] passed an unknown mode" in msg["unknown_mode"]
    assert "must be even and divide the hidden size 128" in msg["block_does_not_divide_hidden"]


def test_l04_validate_names_the_parameter():
    with pytest.raises(ValueError, match="world_size"):
        l04.validate({"preset": "smoke"}, 1)
    with pytest.raises(ValueError, match="n_expert"):
        l04.validate({"preset": "smoke"}, 3)
    with pytest.raises(ValueError, match="block=96 must divide the hidden size"):
        l04.validate({"preset": "smoke", "block": 96}, 2)
    with pytest.raises(ValueError, match="train_modes"):
        l04.validate({"preset": "smoke", "train_modes": ["fp4"]}, 2)
    with pytest.raises(ValueError, match="wire_modes"):
        l04.validate({"preset": "smoke", "wire_modes": ["int8@1"]}, 2)
    assert l04.validate({"preset": "default", "train_modes": None}, 4)["train_modes"] == ["bf16", "bf16@1", "int8", "int4"]
    with pytest.raises(ValueError, match="top_k"):
        l04.validate({"preset": "smoke", "top_k": 9}, 2)


def test_encode_decode_round_trip_without_processes():
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(1))
    for mode, row in (("int8", 256 + 8), ("int4", 128 + 8), ("bf16", 256), ("none", 256)):
        wire = quant_a2a.encode(x, mode)
        assert wire.shape == (5, row) and wire.element_size() * row == quant_a2a.wire_bytes_per_token(mode, 256)
        assert quant_a2a.decode(wire, mode, 256, torch.float32).shape == x.shape
    assert torch.equal(quant_a2a.decode(quant_a2a.encode(x, "none"), "none", 256, torch.float32), x)
    assert quant_a2a.wire_bytes_per_token("int8", 7168) / quant_a2a.wire_bytes_per_token("bf16", 7168) < 0.52
