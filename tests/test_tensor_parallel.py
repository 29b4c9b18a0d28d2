"""Megatron-style tensor parallelism on 2 real processes (gloo), against one process and parallelize_module.

Tolerance: fp32, |diff| <= 1e-5 against the single process (the row-parallel layers sum two partial
products, a different order of additions than one matmul; measured ~2e-7 at smoke) and <= 1e-6
against torch's parallelize_module (the same local GEMMs and the same two-way sum; measured 0).
Bytes are exact: two all-reduces of B·T·D fp32 per block and per pass.
"""
from __future__ import annotations

import pytest
import torch.distributed as dist

from toolkit import launch
from toolkit.models import GPT, GPTConfig, preset
from toolkit.lessons import foundations_parallel as parallel
from toolkit.parallel.tensor import check_tp, qkv_rows, tensor_parallel_attention, tensor_parallel_mlp
from toolkit.parallel.zero import ZeroDataParallel

N = 2
SINGLE_TOL, TORCH_TOL = 1e-5, 1e-6


def demo_and_errors(ctx, cfg):
    """Rank program: the TP demo, then the ValueErrors the constructors raise inside a real tp group."""
    cfg = parallel.validate({"preset": "smoke"}, ctx.world_size)
    out = {"demo": parallel.tensor_parallel(ctx, cfg, preset("smoke")), "errors": {}}
    group = dist.group.WORLD
    cases = {"n_head": lambda: tensor_parallel_attention(GPT(GPTConfig(d_model=33, n_head=3)).blocks[0].attn, group),
             "d_ff": lambda: tensor_parallel_mlp(GPT(GPTConfig(d_model=32, n_head=2, d_ff=33)).blocks[0].mlp, group),
             "stage": lambda: ZeroDataParallel(GPT(GPTConfig()), stage=5, group=group)}
    for name, make in cases.items():
        try:
            make()
            out["errors"][name] = None
        except ValueError as e:
            out["errors"][name] = str(e)
    return out


@pytest.fixture(scope="module")
def results():
    return launch("tests.test_tensor_parallel:demo_and_errors", N, {}, timeout_s=300, progress="none")


def test_block_equals_single_process(results):
    for r in results:
        d = r["demo"]["max_abs_diff"]
        assert max(d["toolkit_vs_single"].values()) <= SINGLE_TOL, d
        assert max(d["torch_vs_single"].values()) <= SINGLE_TOL, d
        assert max(d["toolkit_vs_torch"].values()) <= TORCH_TOL, d


def test_whole_model_loss_equals_single_process(results):
    for r in results:
        m = r["demo"]["model"]
        assert abs(m["loss_tp"] - m["loss_single"]) <= SINGLE_TOL
        per_block = r["demo"]["bytes"]["forward"]["all_reduce"]
        assert m["bytes_forward"] == m["bytes_forward_closed_form"] == m["n_layer"] * per_block


def test_bytes_per_pass_equal_closed_form(results):
    cfg = preset("smoke")
    act = 4 * cfg.seq_len * cfg.d_model * 4  # B·T·D·4 bytes, B = 4 (the demo's default)
    for r in results:
        d = r["demo"]
        assert d["shape"] == [4, cfg.seq_len, cfg.d_model]
        for p in ("forward", "backward"):
            assert d["calls"][p] == {"all_reduce": 2}
            assert d["payload"][p] == {"all_reduce": 2 * act}
            sent = 2 * (2 * (N - 1) * act // N)  # two all-reduces, each 2(n-1)/n of its buffer
            assert d["bytes"][p] == {"all_reduce": sent} and d["bytes_closed_form"][p] == sent
            assert d["torch_comm_counts"][p] == {"all_reduce": 2}  # parallelize_module: the same two per pass


def test_parameters_split(results):
    cfg = preset("smoke")
    replicated = 4 * cfg.d_model + 2 * cfg.d_model  # two LayerNorms, the two row-parallel biases
    numel = results[0]["demo"]["param_numel"]
    assert numel["tp"] == (numel["single"] - replicated) // N + replicated


def test_bad_sizes_name_the_parameter(results):
    for r in results:
        errors = r["errors"]
        assert errors["n_head"] is not None and "n_head=3" in errors["n_head"]
        assert errors["d_ff"] is not None and "33" in errors["d_ff"] and "tp=2" in errors["d_ff"]
        assert errors["stage"] is not None and "stage=5" in errors["stage"]


@pytest.mark.parametrize("tp,sizes,name", [(2, {"n_head": 3}, "n_head"), (4, {"d_ff": 6}, "d_ff"),
                                           (0, {}, "tp"), (2.0, {}, "tp")])
def test_check_tp(tp, sizes, name):
    with pytest.raises(ValueError, match=name):
        check_tp(tp, **sizes)


@pytest.mark.parametrize("cfg,world_size,name", [({"model": "smoke"}, 3, "n_head"), ({"batch": 0}, 2, "batch"),
                                                  ({"preset": "x"}, 2, "preset")])
def test_demo_config_errors_name_the_parameter(cfg, world_size, name):
    with pytest.raises(ValueError, match=name):
        parallel.validate(cfg, world_size)


def test_qkv_rows_cover_every_head_once():
    d_model, n_head, tp = 8, 4, 2
    rows = [qkv_rows(d_model, n_head, tp, r).tolist() for r in range(tp)]
    assert sorted(rows[0] + rows[1]) == list(range(3 * d_model))
    assert rows[0][:4] == [0, 1, 2, 3] and rows[0][4:8] == [8, 9, 10, 11]  # q of heads 0-1, then k of heads 0-1
