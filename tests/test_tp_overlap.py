"""TP communication/compute overlap (lesson 01) on real processes at tp = 2 and 4: the ring ops equal the
collectives, every variant equals one process, kept vs re-gathered input (gradients bitwise, memory and
bytes exactly the closed forms); bad input."""
from __future__ import annotations

import pytest

from toolkit import launch
from toolkit.lessons import l01_tp_overlap as l01
from toolkit.parallel import tp_overlap

FAST = {"warmup": 0, "bench_steps": 1, "rounds": 1, "op_steps": 1}


@pytest.fixture(scope="module")
def tp2():
    return launch("l01_tp_overlap", 2, {"preset": "smoke"}, timeout_s=300, progress="none", cluster="h100-ib400")


@pytest.fixture(scope="module")
def tp4():
    return launch("l01_tp_overlap", 4, {"preset": "smoke", "n_head": 4, **FAST}, timeout_s=300, progress="none")


@pytest.fixture(params=["tp2", "tp4"])
def results(request):
    return request.getfixturevalue(request.param)


def test_every_variant_equals_one_process(results):
    for r in results:
        assert set(r["variants"]) == set(l01.VARIANTS)
        for name, v in r["variants"].items():
            assert abs(v["loss"] - v["loss_ref"]) <= 1e-5, name
            assert v["dx_max_diff"] <= 1e-5 and v["grad_max_diff"] <= 1e-5, (name, v)


def test_kept_gathered_input_gives_bitwise_the_same_gradients(results):
    for r in results:
        assert r["grads_bitwise_keep_vs_regather"] == {"bulk": True, "ring": True}


def test_memory_delta_of_keeping_is_the_gathered_tensor_minus_own_tokens(results):
    for r in results:
        tp, M, D = r["tp"], r["tokens"], r["model"]["d_model"]
        expected = r["n_layer"] * 2 * (M - M // tp) * D * 4  # qkv and fc1 inputs, float32
        assert r["kept_bytes_closed_form"] == expected
        for mode in ("bulk", "ring"):
            v = r["variants"]
            assert v[f"{mode}+keep"]["saved_act_bytes"] - v[mode]["saved_act_bytes"] == expected


def test_bytes_on_the_wire_are_the_closed_form_and_keeping_saves_two_all_gathers_per_layer(results):
    for r in results:
        for name, v in r["variants"].items():
            assert v["sent_bytes"] == r["bytes_closed_form"]["keep" if v["keep_gathered"] else "regather"], name
        calls = {n: v["calls"] for n, v in r["variants"].items()}
        L = r["n_layer"]
        assert calls["bulk"]["forward"] == {"all_gather_into_tensor": 2 * L, "reduce_scatter_tensor": 2 * L}
        assert calls["bulk"]["backward"] == {"all_gather_into_tensor": 4 * L, "reduce_scatter_tensor": 2 * L}
        assert calls["bulk+keep"]["backward"] == {"all_gather_into_tensor": 2 * L, "reduce_scatter_tensor": 2 * L}
        hops = 4 * L * (r["tp"] - 1)  # four ring ops per layer and pass, tp-1 messages each way
        assert calls["ring"]["forward"] == {"irecv": hops, "isend": hops}
        assert calls["ring+keep"]["backward"] == {"irecv": hops, "isend": hops}
        assert calls["ring"]["backward"] == {"all_gather_into_tensor": 2 * L, "irecv": hops, "isend": hops}


def test_ring_ops_equal_the_collectives(tp2, tp4):
    for results in (tp2, tp4):
        for r in results:
            inv = r["ops"]["invariants"]
            assert inv["ag_gathered_bitwise"] and inv["ag_allclose"] and inv["rs_allclose"], inv
            assert inv["ag_max_diff"] <= 1e-5 and inv["rs_max_diff"] <= 1e-5
            assert inv["tiled_ag_gathered_bitwise"] and inv["tiled_ag_allclose"] and inv["tiled_rs_allclose"], inv
            assert inv["tiled_ag_max_diff"] <= 1e-5 and inv["tiled_rs_max_diff"] <= 1e-5
    # with four ranks the ring adds the four partials in another order than gloo's reduce-scatter
    assert not all(r["ops"]["invariants"]["rs_bitwise"] for r in tp4)


def tiled_stack(ctx, cfg: dict) -> dict:
    """Launch target: a two-layer sequence-parallel stack with tiled rings (tiles=2) against the untiled one,
    forward and backward: the largest differences of the loss, the input gradient and the parameter gradients."""
    import copy

    import torch

    from toolkit.data import batches
    from toolkit.models import GPT, preset

    group = ctx.make_grid(tp=ctx.world_size).group("tp")
    torch.manual_seed(0)
    model = GPT(preset("smoke", n_layer=2, n_head=4))
    idx, tgt = next(batches(4, model.cfg.seq_len, 1, seed=0))
    with torch.no_grad():
        x = model.embed(idx)  # [B, T, D]
    x_r, t_r = tp_overlap.shard_tokens(x, group), tp_overlap.shard_tokens(tgt[..., None], group)[:, 0]
    runs = {}
    for tiles in (1, 2):
        stack = tp_overlap.SequenceParallelStack.from_model(copy.deepcopy(model), group, "ring",
                                                            keep_gathered=tiles == 2)
        stack.configure(tiles=tiles)
        xi = x_r.clone().requires_grad_()
        loss = stack(xi, t_r, x.shape[0] * x.shape[1])
        loss.backward()
        runs[tiles] = loss.detach(), xi.grad, dict(stack.named_parameters())
    diff = lambda a, b: (a - b).abs().max().item()  # noqa: E731
    (l1, dx1, p1), (l2, dx2, p2) = runs[1], runs[2]
    return {"loss": diff(l1, l2), "dx": diff(dx1, dx2), "grads": max(diff(p1[n].grad, p2[n].grad) for n in p1)}


@pytest.mark.parametrize("world", [2, 4])
def test_tiled_rings_train_like_the_untiled_ones(world):
    for r in launch("tests.test_tp_overlap:tiled_stack", world, {}, timeout_s=300, progress="none"):
        assert max(r.values()) <= 1e-5, r  # the same sums, tile by tile: allclose (GEMM blocking may differ)


def test_the_matched_run_has_the_real_workloads_ratio_and_the_ring_hides_the_all_gather(tp2):
    from toolkit.models import catalog, matched
    from toolkit.runtime import collectives, efficiency
    from toolkit.runtime.cluster import cluster
    from toolkit.runtime.efficiency import kernel_seconds
    h100 = cluster("h100-ib400")
    for r in tp2:
        e = r["emulated"]
        real = catalog.get(e["stands_for"])
        # the real fc1 (gate and up fused: 2 x ffn wide) at tp = 2 against its all-gather, by the cost model
        op = matched.tp_mlp_op(real.seq_len, real.hidden, real.ffn, 2, gated=real.gated)
        assert op["gemm_flops"] == 2 * real.seq_len * real.hidden * 2 * real.ffn / 2  # formula written here
        g = h100.gpu
        gemm = kernel_seconds(efficiency.gemm(real.seq_len, 2 * real.ffn // 2, real.hidden), g.bf16_flops,
                              g.hbm_bytes_per_s, g.sms, g.efficiency)
        comm = collectives.seconds(h100, "all_gather", [0, 1], 2, op["wire_bytes"])[0]
        # the emulated run times the toy's GEMM as that one (its shape grown by the cube root of the FLOP factor)
        assert e["matched"]["AG+GEMM"]["ratio"] == pytest.approx(gemm / comm, rel=0.3)
        ag = e["matched"]["AG+GEMM"]
        # deterministic (virtual time): the ring hides part of the all-gather the bulk op exposes, less than its
        # ceiling: its two half GEMMs reach less of the GPU than the whole one, and they lose SMs to the transfer
        ceiling = tp_overlap.overlap_ceiling(2, ag["mean_s"]["gemm"], ag["mean_s"]["comm"])
        assert ag["overlap"]["bulk"] < ag["overlap"]["ring"] < ceiling
        assert [p["factor"] for p in e["sweep"]] == [0.25, 1.0, 4.0]
        assert {s["kind"] for s in e["spans"]["ring+keep"]} >= {"gemm", "wait", "comm"}
        assert all(s["vstart"] is not None for s in e["spans"]["ring+keep"])
        assert set(e["step_s"]) == set(l01.VARIANTS)


def test_traced_step_has_gemm_wait_and_flight_spans_on_every_rank(tp2):
    for r in tp2:
        for name in l01.VARIANTS:
            kinds = {(s["kind"], s["meta"]["lane"]) for s in r["spans"][name]}
            assert {("gemm", "compute"), ("wait", "compute"), ("comm", "comm"), ("step", "step")} <= kinds, name
            e = r["exposure"][name]
            assert 0 < e["gemm_s"] < e["step_s"] and 0 < e["exposed_comm_s"] < e["step_s"]
        ring_ops = {s["meta"]["op"] for s in r["spans"]["ring"] if s["kind"] == "gemm"}
        assert ring_ops == {"AG+GEMM", "GEMM+RS"}
        for op in ("AG+GEMM", "GEMM+RS"):
            assert set(r["ops"][op]["mean_s"]) == {"comm", "gemm", "bulk", "ring", "tiled ring", "ring comm"}


def test_overlap_fraction_and_ceiling():
    assert tp_overlap.overlap_fraction(2.0, 3.0, 3.0) == 1.0  # the whole comm hidden
    assert tp_overlap.overlap_fraction(2.0, 3.0, 5.0) == 0.0  # none
    assert tp_overlap.overlap_fraction(2.0, 3.0, 6.0) == -0.5  # worse than bulk
    assert tp_overlap.overlap_ceiling(2, 1.0, 1.0) == 0.5  # the own chunk's half of the GEMM


def test_closed_forms():
    assert tp_overlap.bytes_per_layer(8, 4, 2, keep_gathered=False) == {"forward": 4 * 64, "backward": 6 * 64}
    assert tp_overlap.bytes_per_layer(8, 4, 4, keep_gathered=True) == {"forward": 4 * 96, "backward": 4 * 96}
    assert tp_overlap.kept_bytes_per_layer(8, 4, 4) == 2 * 6 * 4 * 4
    # the ring leaves the last chunk's GEMM uncovered, the tiled ring the last tile's; never more than all
    assert tp_overlap.overlap_ceiling(2, 1.0, 1.0) == 0.5 and tp_overlap.overlap_ceiling(4, 2.0, 3.0) == 0.5
    assert tp_overlap.overlap_ceiling(2, 1.0, 1.0, tiles=4) == 0.875
    assert tp_overlap.overlap_ceiling(2, 10.0, 1.0) == 1.0
    with pytest.raises(ValueError, match="tiles must be an int >= 1"):
        tp_overlap.overlap_ceiling(2, 1.0, 1.0, tiles=0)
    with pytest.raises(ValueError, match="tp must be a positive int"):
        tp_overlap.overlap_ceiling(0, 1.0, 1.0)


def test_bad_input_names_the_parameter():
    with pytest.raises(ValueError, match="n_head=2 is not divisible by tp=4"):
        l01.validate({"preset": "smoke"}, 4)
    with pytest.raises(ValueError, match="tokens must be divisible by tp=3"):
        l01.validate({"preset": "smoke", "n_head": 3, "d_model": 48, "micro_batch": 1}, 3)
    with pytest.raises(ValueError, match="n_head/d_model"):
        l01.validate({"preset": "smoke", "n_head": 3}, 1)  # 32 not divisible by 3
    with pytest.raises(ValueError, match="n_layer must be >= 1"):
        l01.validate({"preset": "smoke", "n_layer": 0}, 2)
    with pytest.raises(ValueError, match="tiles=3 must divide the 64 tokens per rank"):
        l01.validate({"preset": "smoke", "tiles": 3}, 2)
    with pytest.raises(ValueError, match="tiles=0 must be a positive int dividing the 8 rows"):
        tp_overlap.tile_rows(8, 0)
    with pytest.raises(ValueError, match="mode='fused' is not allowed"):
        tp_overlap._check_mode("fused")


def test_the_real_mlp_at_its_true_shapes_spends_more_of_its_step_communicating_at_higher_tp():
    """Lesson 01's section 4c: Llama-2-13B's MLP forward on 4096 tokens, one rank of tp = 2 and tp = 8 on the fake
    process group (nothing computed): the GEMMs shrink 4x from tp 2 to 8, the collectives do not, so their share
    of the bulk step grows; on NVLink the GEMMs are long enough for a ring to hide all of it at both sizes."""
    from toolkit.lessons import l01_tp_overlap as lesson
    two, eight = lesson.true_shapes("llama2-13b", 4096)
    assert two["GEMMs (ms)"] / eight["GEMMs (ms)"] == pytest.approx(4, rel=0.1)
    assert two["communication share (bulk)"] < 0.2 < eight["communication share (bulk)"]
    assert two["ring ceiling"] == eight["ring ceiling"] == 1.0
    slow = lesson.true_shapes("llama2-13b", 4096, tps=(8,), cluster="pcie-100gbe")[0]
    assert slow["ring ceiling"] < 1.0 < slow["all-gather + reduce-scatter (ms)"] / eight["all-gather + reduce-scatter (ms)"]
