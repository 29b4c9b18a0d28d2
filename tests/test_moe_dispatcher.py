"""toolkit.moe: the expert-parallel dispatcher equals a single-process MoE, on real processes (2 and 4 ranks).

Tolerance: outputs and gradients of the fp32 expert-parallel layer (codec "none") within 1e-6 absolute and
1e-5 relative of the local MoE holding every expert (the same pairs, summed in the same slot order; only
the batch composition of each expert's GEMM differs). Quantized codecs are compared by SNR.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from toolkit import launch
from toolkit.lessons.l04_int8_a2a import collect_errors
from toolkit.models.gpt import GPT, preset
from toolkit.moe import (Codec, ExpertParallelMoE, TokenDispatcher, all_to_all, dispatch_layout, route,
                         run_experts)
from toolkit.quant import qsnr_db

H, E, K = 64, 8, 2


def _moe(seed: int = 0, n_expert: int = E, top_k: int = K):
    torch.manual_seed(seed)
    return GPT(preset("smoke", d_model=H, n_head=2, n_layer=1, n_expert=n_expert, top_k=top_k)).blocks[0].mlp


def _tokens(rank: int, n: int | None = None) -> torch.Tensor:
    return torch.randn(n if n is not None else 9 + 4 * rank, H, generator=torch.Generator().manual_seed(100 + rank))


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def _compare(ctx, layer_kwargs: dict, n_tokens: int | None = None, async_check: bool = False) -> dict:
    """The EP layer against the local MoE on this rank's tokens: output, grad of x, router and expert grads."""
    moe = _moe()
    ref = copy.deepcopy(moe)
    x = _tokens(ctx.rank, n_tokens)
    upstream = torch.randn(x.shape, generator=torch.Generator().manual_seed(7 + ctx.rank))
    xr = x.clone().requires_grad_(True)
    yr = ref(xr[None])[0]
    (yr * upstream).sum().backward()
    ep = ExpertParallelMoE(moe, **layer_kwargs)
    xe = x.clone().requires_grad_(True)
    ye = ep(xe[None])[0]
    (ye * upstream).sum().backward()
    # expert grads: the reference sees only this rank's tokens, so sum it over ranks
    ref_expert = torch.cat([p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel())
                            for p in ref.experts.parameters()])
    dist.all_reduce(ref_expert)
    lo = ctx.rank * ep.local
    mine = torch.cat([p.grad.reshape(-1) for p in ep.experts.parameters()])
    per_expert = ref_expert.numel() // E
    out = {"out": _close(ye, yr), "out_rel": float((ye - yr).norm() / yr.norm()),
           "grad_x_rel": float((xe.grad - xr.grad).norm() / xr.grad.norm()), "grad_x": _close(xe.grad, xr.grad),
           "grad_router": _close(ep.router.gate.weight.grad, ref.router.gate.weight.grad),
           "grad_experts": _close(mine, ref_expert[lo * per_expert:(lo + ep.local) * per_expert])}
    plan = ep.last_plan
    routed = torch.bincount(ref.router(x)[1].reshape(-1), minlength=E)
    dist.all_reduce(routed)
    out["tokens_per_expert_is_global_bincount"] = torch.equal(plan.tokens_per_expert, routed)
    received = torch.tensor(sum(plan.recv_counts))
    dist.all_reduce(received)
    out["pairs_conserved"] = int(received) == int(routed.sum())
    return out


def equivalence(ctx, cfg) -> dict:
    res = {}
    for name, kw in {"plain": {}, "dedup": {"dedup": True},
                     "bf16_combine": {"combine_codec": "bf16"}}.items():
        res[name] = _compare(ctx, kw)
    res["receive_order"] = receive_order(ctx)
    res["async_equals_sync"] = async_equals_sync(ctx)
    res["capacity_drop"] = capacity_drop(ctx)
    res["codecs"] = codec_snr(ctx)
    res["empty_rank"] = empty_rank(ctx)
    res["gradcheck"] = gradcheck(ctx)
    res["whole_gpt"] = whole_gpt(ctx)
    res["clone_slot"] = clone_slot(ctx)
    return res


def clone_slot(ctx, cfg=None) -> dict:
    """The placement hook and a spare slot: the last rank hosts a copy of expert 0 and every other token routed to
    expert 0 goes there. Outputs equal the layer without the clone; home grad + clone grad = the grad without it."""
    x = _tokens(ctx.rank)
    up = torch.randn(x.shape, generator=torch.Generator().manual_seed(9 + ctx.rank))
    plain = ExpertParallelMoE(_moe())
    y0 = plain(x[None])[0]
    (y0 * up).sum().backward()
    layer = ExpertParallelMoE(_moe(), spare_slots=1)
    clone = copy.deepcopy(_moe().experts[0])
    R, S = ctx.world_size, layer.slots_per_rank
    if ctx.rank == R - 1:
        layer.set_slot(layer.local, clone)

    def place(ids):
        slots = layer.home_slots(ids)
        token = torch.arange(ids.shape[0])[:, None].expand_as(ids)
        return torch.where((ids == 0) & (token % 2 == 1), (R - 1) * S + layer.local, slots)
    layer.place = place
    y1 = layer(x[None])[0]
    (y1 * up).sum().backward()
    grads = lambda m: torch.cat([p.grad.reshape(-1) for p in m.parameters()])
    clone_grad = grads(clone) if ctx.rank == R - 1 else torch.zeros_like(grads(plain.experts[0]))
    dist.all_reduce(clone_grad)  # the clone's gradient goes back to the home rank of expert 0 (rank 0)
    out = {"outputs_close": _close(y1, y0),
           "clone_received": sum(layer.last_plan.recv_counts[layer.local:]) if ctx.rank == R - 1 else None}
    if ctx.rank == 0:
        out["home_plus_clone_grad"] = _close(grads(layer.experts[0]) + clone_grad, grads(plain.experts[0]))
    return out


def whole_gpt(ctx, cfg=None) -> dict:
    """The tiny MoE GPT with every MoE layer made expert parallel (``expert_parallel``): the same loss and the same
    gradients as the model itself on this rank's batch (expert gradients summed over the ranks)."""
    from toolkit.data import batches
    from toolkit.moe import expert_parallel
    torch.manual_seed(0)
    model = GPT(preset("smoke", d_model=H, n_head=2, n_layer=2, n_expert=E, top_k=K))
    ref = copy.deepcopy(model)
    replicated, experts = expert_parallel(model, codec="none")
    x, y = next(iter(batches(2, 16, 1, seed=3, rank=ctx.rank, world=ctx.world_size)))
    loss, ref_loss = model(x, y), ref(x, y)
    loss.backward()
    ref_loss.backward()
    names = {id(p): n for n, p in model.named_parameters()}
    ref_params = dict(ref.named_parameters())
    grads_ok = all(_close(p.grad, ref_params[names[id(p)]].grad) for p in replicated)
    for n, p in ref.named_parameters():  # the reference saw only this rank's tokens: sum its expert grads
        if ".experts." in n:
            p.grad = torch.zeros_like(p) if p.grad is None else p.grad
            dist.all_reduce(p.grad)
    local = E // ctx.world_size
    for p in experts:  # local expert j of rank r is expert r*local + j
        head, j, rest = names[id(p)].split(".experts.")[0], *names[id(p)].split(".experts.")[1].split(".", 1)
        grads_ok &= _close(p.grad, ref_params[f"{head}.experts.{ctx.rank * local + int(j)}.{rest}"].grad)
    return {"loss_close": abs(loss.item() - ref_loss.item()) < 1e-6, "grads_close": grads_ok,
            "expert_params": sum(p.numel() for p in experts)}


def gradcheck(ctx) -> dict:
    """torch.autograd.gradcheck (float64) of dispatch -> a nonlinear expert per slot -> weighted combine, with
    respect to the tokens and the gate weights, through both all-to-alls (same shapes on every rank, so every
    rank makes the same number of calls)."""
    T, E_, K_ = 4, 2 * ctx.world_size, 2
    g = torch.Generator().manual_seed(1 + ctx.rank)
    ids = torch.stack([torch.randperm(E_, generator=g)[:K_] for _ in range(T)])
    x = torch.randn(T, 3, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.rand(T, K_, generator=g, dtype=torch.float64, requires_grad=True)
    torch.manual_seed(5)  # the same expert weights on every rank
    experts = [torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Tanh()).double() for _ in range(E_)]
    out = {}
    for dedup in (False, True):
        disp = TokenDispatcher(E_, K_, dedup=dedup)
        mine = experts[ctx.rank * disp.local:(ctx.rank + 1) * disp.local]

        def fn(x, w):
            plan = disp.plan(ids, w, x)
            return disp.combine(run_experts(mine, disp.dispatch(x, plan), plan.recv_counts), plan)
        out["dedup" if dedup else "plain"] = torch.autograd.gradcheck(fn, (x, w), eps=1e-6, atol=1e-7)
    return out


def receive_order(ctx) -> dict:
    """Rows carry (source rank, token, slot) in their values: the expert input is slot-major, then source
    rank, then token order, with and without dedup; twice the same."""
    R = ctx.world_size
    out = {}
    for dedup in (False, True):
        disp = TokenDispatcher(E, K, dedup=dedup)
        T = 5 + ctx.rank
        ids = torch.stack([torch.arange(T) % E, (torch.arange(T) * 3 + 1 + ctx.rank) % E], 1)
        ids[:, 1] = torch.where(ids[:, 1] == ids[:, 0], (ids[:, 1] + 1) % E, ids[:, 1])
        x = torch.zeros(T, 4)
        x[:, 0], x[:, 1] = ctx.rank, torch.arange(T).float()
        plan = disp.plan(ids, torch.full((T, K), 0.5))
        got = [disp.dispatch(x, plan) for _ in range(2)]
        expected = []
        for slot in range(ctx.rank * disp.local, (ctx.rank + 1) * disp.local):
            for src in range(R):
                Ts = 5 + src
                ids_s = torch.stack([torch.arange(Ts) % E, (torch.arange(Ts) * 3 + 1 + src) % E], 1)
                ids_s[:, 1] = torch.where(ids_s[:, 1] == ids_s[:, 0], (ids_s[:, 1] + 1) % E, ids_s[:, 1])
                expected += [(src, t) for t in range(Ts) if slot in ids_s[t].tolist()]
        rows = [tuple(int(v) for v in r[:2]) for r in got[0]]
        out["dedup" if dedup else "plain"] = rows == expected and torch.equal(got[0], got[1])
    return out


def async_equals_sync(ctx) -> dict:
    """Two micro-batches in flight at once (dispatch A, dispatch B, wait A, ...; one backward through both) give the
    sync outputs and input gradients bitwise, and the same expert gradients (summed in another order)."""
    ep = ExpertParallelMoE(_moe())
    xs = [_tokens(ctx.rank), _tokens(ctx.rank + 10, 6)]
    ups = [torch.randn(x.shape, generator=torch.Generator().manual_seed(50 + i)) for i, x in enumerate(xs)]

    def grads(inputs):
        return [x.grad for x in inputs], torch.cat([p.grad.reshape(-1) for p in ep.experts.parameters()])
    sync_in = [x.clone().requires_grad_(True) for x in xs]
    sync_out = []
    for x, u in zip(sync_in, ups):
        sync_out.append(ep(x[None])[0])
        (sync_out[-1] * u).sum().backward()
    sync_gx, sync_ge = grads(sync_in)
    ep.zero_grad(set_to_none=True)
    d = ep.dispatcher
    ins = [x.clone().requires_grad_(True) for x in xs]
    routes = [ep.router(x) for x in ins]
    plans = [d.plan(ep.place(ids), w, x) for x, (w, ids) in zip(ins, routes)]
    pend = [d.dispatch(x, p, async_op=True) for x, p in zip(ins, plans)]  # both in flight
    outs = [run_experts(ep.slots, pd.wait(), p.recv_counts) for pd, p in zip(pend, plans)]
    back = [d.combine(o, p, async_op=True) for o, p in zip(outs, plans)]
    ys = [b.wait() for b in back]
    sum((y * u).sum() for y, u in zip(ys, ups)).backward()
    gx, ge = grads(ins)
    return {"outputs_bitwise": all(torch.equal(a, b) for a, b in zip(sync_out, ys)),
            "grad_x_bitwise": all(torch.equal(a, b) for a, b in zip(sync_gx, gx)),
            "grad_experts_close": _close(sync_ge, ge)}


def capacity_drop(ctx) -> dict:
    """overflow='drop': the dropped count is reported, the kept pairs are exact, dropped pairs add nothing."""
    T, cap = 12, 2
    ids = torch.stack([torch.zeros(T, dtype=torch.long), torch.arange(T) % (E - 1) + 1], 1)  # expert 0 is hot
    w = torch.full((T, K), 0.5)
    x = _tokens(ctx.rank, T)
    disp = TokenDispatcher(E, K, capacity=cap, overflow="drop")
    plan = disp.plan(ids, w, x)
    identity = [torch.nn.Identity()] * disp.local
    y = disp.combine(run_experts(identity, disp.dispatch(x, plan), plan.recv_counts), plan)
    kept_first = plan.keep[:, 0]
    expected = x * (0.5 * kept_first[:, None] + 0.5 * plan.keep[:, 1][:, None])
    return {"dropped_slot0": int(plan.dropped[0]), "expected_dropped_slot0": ctx.world_size * (T - cap),
            "exact": torch.equal(y, expected), "first_tokens_kept": bool(kept_first[:cap].all() and not kept_first[cap:].any())}


def codec_snr(ctx) -> dict:
    """Identity experts, weights summing to 1: the round trip is exact for "none" (and dyadic weights);
    quantized codecs keep the SNR of one quantization."""
    T = 16
    x = _tokens(ctx.rank, T)
    g = torch.Generator().manual_seed(3 + ctx.rank)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.full((T, K), 1.0 / K)
    out = {}
    for mode in ("none", "bf16", "int8", "fp8", "int4"):
        for dedup in (False, True):
            disp = TokenDispatcher(E, K, codec=Codec(mode, 32), dedup=dedup)
            plan = disp.plan(ids, w, x)
            y = disp.combine(run_experts([torch.nn.Identity()] * disp.local, disp.dispatch(x, plan),
                                         plan.recv_counts), plan)
            out[f"{mode}/{'dedup' if dedup else 'plain'}"] = qsnr_db(x, y)
    return out


def empty_rank(ctx) -> bool:
    """Every token to rank 0's experts: the other ranks receive nothing and still run the backward."""
    moe = _moe()
    ep = ExpertParallelMoE(moe)
    ep.place = lambda ids: torch.stack([torch.zeros_like(ids[:, 0]), torch.ones_like(ids[:, 0])], 1)
    x = _tokens(ctx.rank).requires_grad_(True)
    ep(x[None]).sum().backward()
    return bool(torch.isfinite(x.grad).all()) and (ctx.rank == 0 or sum(ep.last_plan.recv_counts) == 0)


def bad_inputs(ctx, cfg) -> dict:
    """Each scenario is wrong on one rank only; every rank raises the same ValueError (no hang)."""
    bad = ctx.rank == ctx.world_size - 1
    T = 6
    ids = torch.stack([torch.arange(T) % E, (torch.arange(T) + 1) % E], 1)
    w = torch.full((T, K), 0.5)
    x = _tokens(ctx.rank, T)
    nan_x = x.clone()
    nan_x[2, 5] = float("nan")

    def out_of_range():
        bad_ids = ids.clone()
        if bad:
            bad_ids[3, 1] = E + 1
        TokenDispatcher(E, K).plan(bad_ids, w)

    def nan_logits():
        moe = _moe()
        if bad:
            moe.router.gate.weight.data[0, 0] = float("nan")
        ExpertParallelMoE(moe)(x[None])

    scenarios = {
        "out_of_range": out_of_range,
        "nan_router_logits": nan_logits,
        "nan_tokens_int8": lambda: TokenDispatcher(E, K, codec="int8", block=32).plan(ids, w, nan_x if bad else x),
        "capacity_too_small": lambda: TokenDispatcher(E, K, capacity=1).plan(
            torch.zeros_like(ids) + torch.tensor([0, 1]) if bad else ids, w),
        "codec_disagrees": lambda: TokenDispatcher(E, K, codec="int4" if bad else "int8", block=32).plan(ids, w, x),
        "top_k_above_experts": lambda: TokenDispatcher(E, E + 1),
        "experts_not_divisible": lambda: TokenDispatcher(E + 1, K),
        "layer_experts_not_divisible": lambda: ExpertParallelMoE(_moe(n_expert=ctx.world_size + 1)),
        "route_nan": lambda: route(torch.full((3, E), float("nan")), K),
        "route_top_k": lambda: route(torch.zeros(3, E), E + 1),
        "capacity_type": lambda: TokenDispatcher(E, K, capacity=0),
        "codec_name": lambda: TokenDispatcher(E, K, codec="fp4"),
    }
    return collect_errors(scenarios)


@pytest.fixture(scope="module", params=[2, 4], ids=["ep2", "ep4"])
def results(request):
    return launch("tests.test_moe_dispatcher:equivalence", request.param, {}, timeout_s=300, progress="none")


def test_equal_to_a_single_process_moe(results):
    for res in results:
        for mode in ("plain", "dedup", "bf16_combine"):
            r = res[mode]
            assert r["tokens_per_expert_is_global_bincount"] and r["pairs_conserved"], (mode, r)
            if mode == "bf16_combine":  # the expert outputs (and the backward) travel as bf16: 8 mantissa bits
                assert r["out_rel"] < 2 ** -8 and r["grad_x_rel"] < 2 ** -8, r
                continue
            assert r["out"] and r["grad_x"] and r["grad_router"] and r["grad_experts"], (mode, r)


def test_deterministic_receive_order_and_async(results):
    for res in results:
        assert res["receive_order"] == {"plain": True, "dedup": True}
        assert res["async_equals_sync"] == {"outputs_bitwise": True, "grad_x_bitwise": True, "grad_experts_close": True}
        assert res["empty_rank"]
        assert res["gradcheck"] == {"plain": True, "dedup": True}
        assert res["whole_gpt"]["loss_close"] and res["whole_gpt"]["grads_close"], res["whole_gpt"]
        assert res["clone_slot"]["outputs_close"], res["clone_slot"]
    assert results[0]["clone_slot"]["home_plus_clone_grad"] and results[-1]["clone_slot"]["clone_received"] > 0


def test_capacity_drops_are_counted_never_silent(results):
    for res in results:
        c = res["capacity_drop"]
        assert c["dropped_slot0"] == c["expected_dropped_slot0"] and c["exact"] and c["first_tokens_kept"]


def test_codecs_round_trip(results):
    for res in results:
        snr = res["codecs"]
        assert snr["none/plain"] == snr["none/dedup"] == float("inf")  # weights 1/2: dyadic, so exact
        assert 40 < snr["int8/plain"] < 50 and 25 < snr["fp8/plain"] < 35 and 15 < snr["int4/plain"] < 25
        assert 45 < snr["bf16/plain"]


def test_bad_input_raises_the_same_error_on_every_rank():
    res = launch("tests.test_moe_dispatcher:bad_inputs", 2, {}, timeout_s=300, progress="none")
    assert res[0] == res[1]
    msg = res[0]
    assert "expert ids out of range on rank(s) [1]" in msg["out_of_range"] and "got values in 0..9" in msg["out_of_range"]
    assert "router weights hold NaN/Inf on rank(s) [1]" in msg["nan_router_logits"]
    assert "tokens x hold NaN/Inf on rank(s) [1]" in msg["nan_tokens_int8"]
    assert "capacity=1 is too small" in msg["capacity_too_small"] and "overflow='drop'" in msg["capacity_too_small"]
    assert "ranks disagree on the dispatcher's codec (rank 0: 'int8', rank 1: 'int4')" in msg["codec_disagrees"]
    assert "top_k=9 must be <=" in msg["top_k_above_experts"]
    assert "n_slots=9 experts must be divisible by the expert-parallel size ep=2" in msg["experts_not_divisible"]
    assert "n_expert=3 experts must be divisible" in msg["layer_experts_not_divisible"]
    assert "router logits hold" in msg["route_nan"] and "top_k=9" in msg["route_top_k"]
    assert "capacity=0" in msg["capacity_type"] and "codec='fp4'" in msg["codec_name"]


def test_layout_without_processes():
    ids = torch.tensor([[0, 1], [2, 7], [6, 7], [3, 3]])
    lay = dispatch_layout(ids, 8, 4, ranks_per_node=2)
    assert lay.token_in_rank.tolist() == [[True, False, False, False], [False, True, False, True],
                                          [False, False, False, True], [False, True, False, False]]
    assert lay.tokens_per_rank.tolist() == [1, 2, 0, 2] and lay.tokens_per_expert.tolist() == [1, 1, 1, 2, 0, 0, 1, 2]
    assert lay.tokens_per_node.tolist() == [3, 2]
    assert Codec("fp8", 128).row_bytes(7168) == 7168 + 4 * 56 and Codec("bf16").row_bytes(7168) == 2 * 7168
