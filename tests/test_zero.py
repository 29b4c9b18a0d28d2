"""ZeRO stages 0-3 and FSDP2 against torch DDP, on 2 real processes (gloo).

Tolerance: none. With 2 ranks every variant computes the same arithmetic as DDP (the same forward,
grads divided by 2 and then summed, which is exact, and AdamW elementwise), so losses and parameters
must agree bit for bit. Bytes (ledger) and memory (storages) must equal the closed forms exactly.
The closed forms are written out here again, from Ψ and n alone, not imported from the library.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from toolkit import launch
from toolkit.models import GPT, preset
from toolkit.lessons import foundations_parallel as parallel
from toolkit.parallel.zero import ZeroDataParallel, check_stage, default_units

N = 2
STEPS = 3
ODD = {"d_model": 33, "n_head": 3}  # unit sizes not divisible by 2: exercises the padding


def both_models(ctx, cfg):
    """Rank program: lesson 00's data-parallel section on the smoke GPT, then on a GPT with odd sizes (padding),
    ledger reset between; then ZeRO-3 with and without prefetch."""
    smoke = parallel.validate({"preset": "smoke", "dp_steps": STEPS, "dp_timing": []}, ctx.world_size)
    out = {"smoke": parallel.data_parallel(ctx, smoke, preset("smoke"))}
    ctx.ledger.reset()
    odd = {**smoke, "dp_steps": 2, "dp_variants": ["ddp", "zero1", "zero2", "zero3", "fsdp2"]}
    out["odd"] = parallel.data_parallel(ctx, odd, preset("smoke", **ODD))
    ctx.ledger.reset()
    timing = {**smoke, "warmup": 0, "bench_steps": 1, "rounds": 1}
    out["prefetch"] = parallel.zero3_prefetch(ctx, timing, preset("smoke"))
    return out


@pytest.fixture(scope="module")
def results():
    return launch("tests.test_zero:both_models", N, {}, timeout_s=300, progress="none")


def _units(overrides: dict) -> list[list[nn.Parameter]]:
    return [list(u.parameters()) for u in default_units(GPT(preset("smoke", **overrides)))]


def _psi(overrides: dict, pad: bool) -> int:
    """Ψ, with each unit padded to a multiple of N when ``pad``."""
    sizes = [sum(p.numel() for p in ps) for ps in _units(overrides)]
    return sum(-(-k // N) * N if pad else k for k in sizes)


def _psi_fsdp(overrides: dict) -> int:
    """Ψ as FSDP2 pads it: every parameter's dim 0 up to a multiple of N."""
    return sum(-(-p.shape[0] // N) * N * (p.numel() // p.shape[0]) for ps in _units(overrides) for p in ps)


def _expected_bytes(overrides: dict) -> dict[str, dict[str, int]]:
    psi, psi_pad, psi_fsdp = _psi(overrides, False), _psi(overrides, True), _psi_fsdp(overrides)
    embed = -(-sum(p.numel() for p in _units(overrides)[0]) // N) * N  # the embedding unit: no re-gather
    ar = lambda k: 2 * (N - 1) * 4 * k // N  # noqa: E731  all-reduce of k fp32 numbers
    half = lambda k: (N - 1) * 4 * k // N  # noqa: E731  all-gather / reduce-scatter of k fp32 numbers
    return {"ddp": {"all_reduce": ar(psi)}, "zero0": {"all_reduce": ar(psi)},
            "zero1": {"reduce_scatter_tensor": half(psi_pad), "all_gather_into_tensor": half(psi_pad)},
            "zero2": {"reduce_scatter_tensor": half(psi_pad), "all_gather_into_tensor": half(psi_pad)},
            "zero3": {"all_gather_into_tensor": half(2 * psi_pad - embed), "reduce_scatter_tensor": half(psi_pad)},
            "fsdp2": {"all_gather_into_tensor": 2 * half(psi_fsdp), "reduce_scatter_tensor": half(psi_fsdp)},
            "fsdp2_keep": {"all_gather_into_tensor": half(psi_fsdp), "reduce_scatter_tensor": half(psi_fsdp)}}


def _fsdp_optim(overrides: dict, rank: int) -> int:
    """AdamW state bytes under FSDP2: m and v of the unpadded torch.chunk shard of every parameter's dim 0."""
    rows = lambda d: max(0, min(-(-d // N), d - rank * -(-d // N)))  # noqa: E731
    return 8 * sum(rows(p.shape[0]) * (p.numel() // p.shape[0]) for ps in _units(overrides) for p in ps)


def _expected_memory(overrides: dict, rank: int) -> dict[str, dict[str, int]]:
    s, p, f = 4 * _psi(overrides, False), 4 * _psi(overrides, True), 4 * _psi_fsdp(overrides)
    fo = _fsdp_optim(overrides, rank)
    return {"ddp": {"params": s, "grads": s, "optim": 2 * s}, "zero0": {"params": s, "grads": s, "optim": 2 * s},
            "zero1": {"params": p, "grads": p, "optim": 2 * p // N},
            "zero2": {"params": p, "grads": p // N, "optim": 2 * p // N},
            "zero3": {"params": p // N, "grads": p // N, "optim": 2 * p // N},
            "fsdp2": {"params": f // N, "grads": f // N, "optim": fo},  # shards stored padded, state not
            "fsdp2_keep": {"params": f // N, "grads": f // N, "optim": fo}}


@pytest.mark.parametrize("model", ["smoke", "odd"])
def test_losses_and_parameters_bitwise_equal_to_ddp(results, model):
    for r in results:
        res = r[model]
        for v in res["variants"]:
            assert res["loss"][v] == res["loss"]["ddp"], (model, v)
            assert res["max_abs_diff_vs_ddp"][v] == 0.0, (model, v)
    assert results[0][model]["loss"]["ddp"] != results[1][model]["loss"]["ddp"]  # ranks saw different data


@pytest.mark.parametrize("model", ["smoke", "odd"])
def test_bytes_per_step_equal_closed_forms(results, model):
    expected = _expected_bytes(ODD if model == "odd" else {})
    for r in results:
        res = r[model]
        for v in res["variants"]:
            assert res["bytes_per_step_by_op"][v] == expected[v], (model, v)
            assert res["bytes_closed_form"][v] == expected[v], (model, v)  # the library's formulas agree


def test_bytes_ratios_to_ddp(results):
    b = results[0]["smoke"]["bytes_per_step"]
    assert b["zero0"] == b["zero1"] == b["zero2"] == b["ddp"] == b["fsdp2_keep"]  # RS + AG = AR
    assert 2 * b["fsdp2"] == 3 * b["ddp"]  # textbook ZeRO-3: 1.5x
    assert b["ddp"] < b["zero3"] < b["fsdp2"]  # the toolkit skips the embedding's backward all-gather
    calls = results[0]["smoke"]["calls_per_step_by_op"]
    n_units = 2 + preset("smoke").n_layer
    assert calls["zero3"] == {"all_gather_into_tensor": 2 * n_units - 1, "reduce_scatter_tensor": n_units}
    assert calls["fsdp2"] == {"all_gather_into_tensor": 2 * n_units, "reduce_scatter_tensor": n_units}


@pytest.mark.parametrize("model", ["smoke", "odd"])
def test_memory_by_category_equals_closed_forms(results, model):
    for rank, r in enumerate(results):
        expected = _expected_memory(ODD if model == "odd" else {}, rank)
        res = r[model]
        for v in res["variants"]:
            assert res["memory"][v] == expected[v], (model, v, rank)
            assert res["memory_closed_form"][v] == expected[v], (model, v, rank)


def test_peak_memory(results):
    res = results[0]["smoke"]
    peak = {v: res["peak_memory"][v]["total"] for v in res["variants"]}
    assert peak["zero3"] < peak["zero2"] <= peak["zero1"] < peak["ddp"]
    # ZeRO-3 holds its shards plus the unit(s) being used, never the whole model: at least one gathered unit,
    # at most two (the previous unit's buffer can outlive its last use by a moment: gloo's work object holds the
    # all-gather output until its own thread lets go, so the exact overlap varies from run to run)
    sizes = sorted(sum(p.numel() for p in ps) for ps in _units({}))
    held = res["max_memory_by_category"]["zero3"]["param"] // 4 - _psi({}, True) // N
    assert sizes[-1] <= held <= sizes[-1] + sizes[-2] < _psi({}, True)
    # ZeRO-1 holds the full local gradient until the step, ZeRO-2 only its shard
    assert res["max_memory_by_category"]["zero1"]["grad"] == 4 * _psi({}, True)
    assert res["max_memory_by_category"]["zero2"]["grad"] == 4 * _psi({}, True) // N


def test_prefetch_issues_each_gather_one_unit_ahead(results):
    """From the order of events, not from timing: with prefetch, unit i's forward all-gather is issued while
    unit i-1 computes (before unit i's forward starts), and in backward the previous unit's re-gather is
    issued while this unit's backward runs; without prefetch, each gather is issued by the unit that needs it."""
    n_units = 2 + preset("smoke").n_layer
    reads = list(range(1, n_units))  # units whose backward reads their parameters (all but the embedding)
    for r in results:
        res = r["prefetch"]
        assert res["bitwise_equal"]  # the same gathers, only earlier: the same numbers
        trace = [tuple(e) for e in res["trace"]["prefetch"]]
        at = {e: i for i, e in enumerate(trace)}
        for i in range(1, n_units):
            issued = at[("gather", i, "fwd", "prefetch")]
            assert at[("forward", i - 1)] < issued < at[("forward_done", i - 1)] < at[("forward", i)]
        for k, j in zip(reads[::-1], reads[-2::-1]):  # k's backward runs, then j's (reverse order)
            issued = at[("gather", j, "bwd", "prefetch")]
            assert at[("backward", k)] < issued < at[("reduce", k)] < at[("backward", j)]
        demand = [e for e in trace if e[0] == "gather" and e[3] == "demand"]
        assert demand == [("gather", 0, "fwd", "demand"), ("gather", n_units - 1, "bwd", "demand")]
        plain = [tuple(e) for e in res["trace"]["no prefetch"]]
        at = {e: i for i, e in enumerate(plain)}
        assert all(e[3] == "demand" for e in plain if e[0] == "gather")
        for i in range(n_units):
            assert at[("forward", i)] < at[("gather", i, "fwd", "demand")] < at[("forward_done", i)]
        # the ledger saw the same all-gathers (same bytes, same order), the prefetched ones issued async
        order = res["ledger_order"]
        assert [b for _, b in order["prefetch"]] == [b for _, b in order["no prefetch"]]
        assert not any(a for a, _ in order["no prefetch"])
        assert [a for a, _ in order["prefetch"]] == [False] + [True] * (n_units - 1) + [False] + [True] * (n_units - 2)
        kinds = {s["kind"] for s in res["spans"]["prefetch"]}
        assert kinds == {"F", "B", "AG", "wait", "RS"} and {s["rank"] for s in res["spans"]["prefetch"]} == {0, 1}


@pytest.mark.parametrize("stage", [-1, 4, 1.0, "1", True, None])
def test_bad_stage_names_parameter(stage):
    with pytest.raises(ValueError, match="stage"):
        check_stage(stage)
    with pytest.raises(ValueError, match="stage"):  # before any process group is needed
        ZeroDataParallel(GPT(preset("smoke")), stage=stage)


def test_bad_prefetch_names_parameter():
    with pytest.raises(ValueError, match="prefetch"):
        ZeroDataParallel(GPT(preset("smoke")), stage=3, prefetch="yes")


def test_default_units_rejects_root_parameters():
    model = nn.Sequential(nn.Linear(2, 2))
    model.register_parameter("loose", nn.Parameter(torch.zeros(1)))
    with pytest.raises(ValueError, match="units="):
        default_units(model)
    assert [type(u).__name__ for u in default_units(GPT(preset("smoke")))] == ["Embedding", "Block", "Block", "Head"]


@pytest.mark.parametrize("cfg,world_size,name", [
    ({"preset": "huge"}, 2, "preset"), ({"dp_steps": 1}, 2, "dp_steps"), ({"batch": 1.5}, 2, "batch"),
    ({"dp_variants": ["ddp", "zero4"]}, 2, "dp_variants"), ({"dp_variants": []}, 2, "dp_variants"),
    ({"dp_variants": ["ddp"], "dp_timing": ["zero3"]}, 2, "dp_timing"), ({"dp_batch": 4}, 2, "dp_batch"),
    ({}, 1, "world_size")])
def test_demo_config_errors_name_the_parameter(cfg, world_size, name):
    with pytest.raises(ValueError, match=name):
        parallel.validate(cfg, world_size)
    assert parallel.validate({}, 2)["dp_variants"] == ["ddp", "zero0", "zero1", "zero2", "zero3", "fsdp2",
                                                       "fsdp2_keep"]
    assert parallel.validate({"dp_variants": ["zero3", "ddp"], "dp_timing": []}, 2)["dp_variants"] == ["ddp", "zero3"]
