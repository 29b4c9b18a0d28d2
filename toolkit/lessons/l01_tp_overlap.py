"""Lesson 01, per rank: tensor-parallel communication hidden behind the GEMMs (flux-style rings).

    the same n_layer blocks + head of the tiny GPT, one micro-batch of real text, tp = world size
    ├─ single process: mean next-token loss, backward                          (the reference)
    └─ sequence-parallel TP, four variants:  bulk / ring  ×  re-gather / keep the gathered input
         1 checked step each: loss, input gradient, every gradient vs the reference (sliced like the
         weights), saved-activation bytes after the forward, bytes and calls on the wire per pass
         1 traced step each: per-rank spans (gemm, wait = exposed comm, message in flight)
         then the four timed side by side (``bench.compare``)
    micro-benchmarks at the MLP's shapes: AG+GEMM (fc1) and GEMM+RS (fc2), each as comm alone, GEMM alone,
         bulk, ring and tiled ring (``tiles`` row tiles per chunk), timed side by side
         -> overlap = (T_comm + T_gemm - T_fused) / T_comm
"""
from __future__ import annotations

import copy
from contextlib import nullcontext
from dataclasses import asdict

import torch
import torch.distributed as dist

from toolkit.data import batches
from toolkit.models import GPT, lm_loss, preset
from toolkit.parallel.tensor import check_tp
from toolkit.parallel.tp_overlap import (SequenceParallelStack, all_gather_matmul, allreduce_sequence_parallel_grads,
                                         bytes_per_layer, kept_bytes_per_layer, matmul_reduce_scatter, overlap_ceiling,
                                         overlap_fraction, shard_tokens)
from toolkit.pipeline.executor import ActivationMeter
from toolkit.runtime import compat
from toolkit.runtime.bench import compare, replayed
from toolkit.runtime.emulator import what_if
from toolkit.runtime.config import Param, common, resolve

PARAMS = {**common("model", "n_layer", "micro_batch", "seed", "warmup", "bench_steps", "rounds"),
          "n_head": Param(int, "attention heads (None: the model preset's); tp must divide it", ge=1, nullable=True),
          "d_model": Param(int, "hidden size (None: the model preset's; d_ff = 4·d_model); tp must divide it", ge=1,
                           nullable=True),
          "op_steps": Param(int, "timed calls per round in the AG+GEMM / GEMM+RS micro-benchmarks", ge=1),
          "tiles": Param(int, "row tiles per chunk in the micro-benchmarks' tiled ring (flux's tile-level overlap); "
                              "must divide the tokens per rank", ge=1),
          "stands_for": Param(str, "the real model whose MLP the emulated cluster times the toy's as (the "
                                   "workload-matched mode)", choices=("llama2-7b", "llama2-13b", "llama2-70b")),
          "sweep": Param(list, "emulated cluster: GEMM lengths swept, as factors of the real workload's "
                               "(1 = the real one)", of=float, gt=0)}
PRESETS = {
    "smoke": {"model": "smoke", "n_layer": 1, "micro_batch": 4, "seed": 0, "n_head": None, "d_model": None,
              "warmup": 1, "bench_steps": 2, "rounds": 3, "op_steps": 5, "tiles": 2, "stands_for": "llama2-13b",
              "sweep": [0.25, 1.0, 4.0]},
    "default": {"model": "default", "n_layer": 2, "micro_batch": 8, "seed": 0, "n_head": None, "d_model": None,
                "warmup": 1, "bench_steps": 2, "rounds": 3, "op_steps": 8, "tiles": 4, "stands_for": "llama2-13b",
                "sweep": [0.125, 0.25, 0.5, 1.0, 2.0, 4.0]},
    "full": {"model": "full", "n_layer": 4, "micro_batch": 4, "seed": 0, "n_head": None, "d_model": None,
             "warmup": 3, "bench_steps": 5, "rounds": 5, "op_steps": 20, "tiles": 8, "stands_for": "llama2-70b",
             "sweep": [0.125, 0.25, 0.5, 1.0, 2.0, 4.0]},
}
VARIANTS = {"bulk": ("bulk", False), "bulk+keep": ("bulk", True), "ring": ("ring", False), "ring+keep": ("ring", True)}


def model_config(cfg: dict):
    """The GPT size of ``cfg`` (the preset with ``n_layer``, ``n_head`` and ``d_model`` overridden)."""
    over = {"n_layer": cfg["n_layer"]}
    if cfg["n_head"] is not None:
        over["n_head"] = cfg["n_head"]
    if cfg["d_model"] is not None:
        over.update(d_model=cfg["d_model"], d_ff=4 * cfg["d_model"])
    try:
        return preset(cfg["model"], **over)
    except ValueError as err:  # d_model not divisible by n_head
        raise ValueError(f"n_head/d_model: {err}") from None


def validate(cfg: dict, world_size: int) -> dict:
    cfg = resolve(cfg, PRESETS, PARAMS)
    mc = model_config(cfg)
    check_tp(world_size, n_head=mc.n_head, d_model=mc.d_model, d_ff=mc.d_ff)  # "n_head=2 is not divisible by tp=4"
    tokens = cfg["micro_batch"] * mc.seq_len
    if tokens % world_size:
        raise ValueError(f"micro_batch={cfg['micro_batch']} × seq_len={mc.seq_len} = {tokens} tokens must be "
                         f"divisible by tp={world_size} (sequence parallelism splits the tokens)")
    if (tokens // world_size) % cfg["tiles"]:
        raise ValueError(f"tiles={cfg['tiles']} must divide the {tokens // world_size} tokens per rank "
                         f"(micro_batch × seq_len / tp)")
    if 1.0 not in cfg["sweep"]:
        raise ValueError(f"sweep={cfg['sweep']} must hold 1.0 (the real workload's GEMM length)")
    return cfg


def run(ctx, cfg: dict) -> dict:
    mc, tp = model_config(cfg), ctx.world_size
    group = ctx.make_grid(tp=tp).group("tp")
    B, T, D, n_layer = cfg["micro_batch"], mc.seq_len, mc.d_model, mc.n_layer
    M = B * T
    torch.manual_seed(cfg["seed"])
    model = GPT(mc).to(ctx.device)
    idx, tgt = next(batches(B, T, 1, seed=cfg["seed"], device=ctx.device))
    with torch.no_grad():
        x = model.embed(idx)  # [B,T,D]: the blocks' input, real text

    # checks, traced and timed steps read the wall clock only: paused (the virtual clock runs in emulated())
    with ctx.paused():
        # -- the single-process reference, and its gradients sliced exactly like the weights ----------------
        ref = copy.deepcopy(model)
        xr = x.clone().requires_grad_()
        h = xr
        for block in ref.blocks:
            h = block(h)
        loss_ref = lm_loss(ref.head(h), tgt)
        loss_ref.backward()
        as_params = copy.deepcopy(ref)  # a model whose "weights" are the reference gradients, sharded like ours
        with torch.no_grad():
            for p, q in zip(as_params.parameters(), ref.parameters()):
                if q.grad is not None:  # the embedding is not part of the stack
                    p.copy_(q.grad)
        ref_grads = dict(SequenceParallelStack.from_model(as_params, group).named_parameters())

        x_r, dx_ref = shard_tokens(x, group), shard_tokens(xr.grad, group)
        t_r = shard_tokens(tgt[..., None], group)[:, 0]
        stacks = {name: SequenceParallelStack.from_model(copy.deepcopy(model), group, mode, keep)
                  for name, (mode, keep) in VARIANTS.items()}

        def step(stack: SequenceParallelStack, meter: ActivationMeter | None = None, name: str = "step"):
            xi = x_r.clone().requires_grad_()
            with ctx.ledger.tag(f"{name}/forward"), meter.recording((0, 0, 0)) if meter else nullcontext():
                local = stack(xi, t_r, M)
            saved = meter.live if meter else None
            with ctx.ledger.tag(f"{name}/backward"):
                local.backward()
            with ctx.ledger.tag("sp-grads"):
                allreduce_sequence_parallel_grads(stack, group)
            return local, xi.grad, saved

        # -- one checked step per variant ----------------------------------------------------------------------
        variants, grads = {}, {}
        for i, (name, stack) in enumerate(stacks.items()):
            local, dx, saved = step(stack, ActivationMeter(stack.parameters()), name)
            loss = local.detach().clone()
            with ctx.ledger.tag("metrics"):
                dist.all_reduce(loss, group=group)
            grads[name] = {n: p.grad.clone() for n, p in stack.named_parameters()}
            variants[name] = {
                "mode": VARIANTS[name][0], "keep_gathered": VARIANTS[name][1], "loss": loss.item(),
                "loss_ref": loss_ref.item(), "dx_max_diff": _diff(dx, dx_ref),
                "grad_max_diff": max(_diff(g, ref_grads[n]) for n, g in grads[name].items()),
                "saved_act_bytes": saved,
                "sent_bytes": {p: ctx.ledger.total("sent_bytes", tag=f"{name}/{p}") for p in ("forward", "backward")},
                "calls": {p: _calls(ctx.ledger, f"{name}/{p}") for p in ("forward", "backward")}}
            ctx.progress(i + 1, 9, "checked " + name)
        bitwise = {mode: all(torch.equal(g, grads[f"{mode}+keep"][n]) for n, g in grads[mode].items())
                   for mode in ("bulk", "ring")}

        # -- one traced step per variant: spans for the timeline, exposed vs hidden communication ----------------
        spans, exposure = {}, {}
        for name, stack in stacks.items():
            stack.zero_grad(set_to_none=True)
            stack.configure(timeline=ctx.timeline)
            ctx.barrier()
            mark = len(ctx.timeline.spans)
            with ctx.timeline.span("step", lane="step", variant=name):
                step(stack, name="traced")
            stack.configure(timeline=None)
            spans[name] = [asdict(s) for s in ctx.timeline.spans[mark:]]
            exposure[name] = exposure_of(spans[name])
        ctx.progress(5, 9, "timing the four variants")

        # -- the four variants, timed side by side ---------------------------------------------------------------
        def timed(stack):
            def one():
                stack.zero_grad(set_to_none=True)
                step(stack, name="bench")
            return one

        bench = compare({name: timed(s) for name, s in stacks.items()}, warmup=cfg["warmup"], steps=cfg["bench_steps"],
                        rounds=cfg["rounds"], sync=ctx.barrier)
    ctx.progress(6, 9, "micro-benchmarks")
    ops = op_benchmarks(ctx, group, stacks["ring"].blocks[0], M, cfg)
    ctx.progress(8, 9, "on the emulated cluster" if ctx.emulator else "done")
    on_cluster = (emulated(ctx, group, stacks["ring"].blocks[0], M, cfg, stacks, step) if ctx.emulator is not None
                  else None)
    ctx.progress(9, 9, "done")
    return {"rank": ctx.rank, "tp": tp, "model": vars(mc), "tiles": cfg["tiles"], "tokens": M, "local_tokens": M // tp,
            "n_layer": n_layer, "variants": variants, "grads_bitwise_keep_vs_regather": bitwise,
            "bytes_closed_form": {k: {p: n_layer * v for p, v in bytes_per_layer(M, D, tp, keep).items()}
                                  for k, keep in (("regather", False), ("keep", True))},
            "kept_bytes_closed_form": n_layer * kept_bytes_per_layer(M, D, tp),
            "sp_grad_bytes": _sp_grad_bytes(ctx.ledger),
            "exposure": exposure, "spans": spans, "bench": {n: b.to_dict() for n, b in bench.items()}, "ops": ops,
            "emulated": on_cluster}


def exposure_of(spans: list[dict], clock: str = "wall") -> dict[str, float]:
    """A traced step's step time, GEMM time, exposed communication (the waits) and communication in flight, on
    the wall clock or (``clock="virtual"``) the emulated cluster's."""
    a, b = ("start", "end") if clock == "wall" else ("vstart", "vend")
    total = lambda kind: sum(s[b] - s[a] for s in spans if s["kind"] == kind)  # noqa: E731
    return {"step_s": total("step"), "gemm_s": total("gemm"), "exposed_comm_s": total("wait"),
            "comm_in_flight_s": total("comm")}


def run_ops(ctx, cfg: dict) -> dict:
    """Only the micro-benchmarks of ``run`` (``benchmarks/bench_tp_overlap.py`` launches this)."""
    mc, tp = model_config(cfg), ctx.world_size
    group = ctx.make_grid(tp=tp).group("tp")
    torch.manual_seed(cfg["seed"])
    stack = SequenceParallelStack.from_model(GPT(mc).to(ctx.device), group)
    return {"rank": ctx.rank, "tp": tp, "model": vars(mc), "tiles": cfg["tiles"],
            "ops": op_benchmarks(ctx, group, stack.blocks[0], cfg["micro_batch"] * mc.seq_len, cfg)}


def op_benchmarks(ctx, group, block, tokens: int, cfg: dict) -> dict:
    """AG+GEMM at fc1's shapes and GEMM+RS at fc2's (``tokens`` in the micro-batch): the collective alone, the
    GEMM alone, bulk, ring, tiled ring, and the ring's messages alone (the same ring with GEMMs of width 0), timed side by
    side; and the invariants: ring and tiled ring == bulk (allclose; the gathered input bitwise).

    ``overlap`` takes T_comm of the collective (the collective timed alone); ``overlap_own_messages`` takes the
    ring's own messages, which gloo may move faster or slower than its collective."""
    o = _mlp_operands(ctx, group, block, tokens, cfg)
    x, w1, h, w2, gathered, partial, scattered = (o[k] for k in ("x", "w1", "h", "w2", "gathered", "partial",
                                                                 "scattered"))
    tiles = cfg["tiles"]
    ring_y, ring_x = all_gather_matmul(x, w1, group, mode="ring", keep_gathered=True)
    tiled_y, tiled_x = all_gather_matmul(x, w1, group, mode="ring", keep_gathered=True, tiles=tiles)
    compat.all_gather_single(gathered, x, group=group)
    ref_y = gathered @ w1  # the definition: all_gather, then matmul
    ring_rs = matmul_reduce_scatter(h, w2, group, mode="ring")
    tiled_rs = matmul_reduce_scatter(h, w2, group, mode="ring", tiles=tiles)
    compat.reduce_scatter_single(scattered, partial, group=group)
    close = lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-6)  # noqa: E731
    out = {"invariants": {
        "ag_gathered_bitwise": torch.equal(ring_x, gathered), "ag_max_diff": _diff(ring_y, ref_y),
        "ag_allclose": close(ring_y, ref_y), "ag_bitwise": torch.equal(ring_y, ref_y),
        "rs_max_diff": _diff(ring_rs, scattered), "rs_allclose": close(ring_rs, scattered),
        "rs_bitwise": torch.equal(ring_rs, scattered),
        "tiled_ag_gathered_bitwise": torch.equal(tiled_x, gathered), "tiled_ag_max_diff": _diff(tiled_y, ref_y),
        "tiled_ag_allclose": close(tiled_y, ref_y), "tiled_rs_max_diff": _diff(tiled_rs, scattered),
        "tiled_rs_allclose": close(tiled_rs, scattered)}}
    candidates = _candidates(group, o, tiles)
    for op, (shapes, cands) in candidates.items():
        with ctx.ledger.tag(f"ops/{op}"), ctx.paused():  # wall time without the emulator's bookkeeping
            res = compare(cands, warmup=cfg["warmup"], steps=cfg["op_steps"], rounds=cfg["rounds"], sync=ctx.barrier)
        t = {n: r.mean_s for n, r in res.items()}
        out[op] = {"shapes": shapes, "mean_s": t, "median_s": {n: r.median_s for n, r in res.items()},
                   "bench": {n: r.to_dict() for n, r in res.items()},
                   "overlap": {v: overlap_fraction(t["comm"], t["gemm"], t[v]) for v in ("bulk", "ring", "tiled ring")},
                   "overlap_own_messages": overlap_fraction(t["ring comm"], t["gemm"], t["ring"])}
    if ctx.emulator is not None:  # the same candidates on the emulated cluster's clock, toy shapes: one call each
        for op, point in _virtual_ops(ctx, group, block, tokens, cfg).items():
            out[op]["virtual"] = {"mean_s": point["mean_s"], "overlap": point["overlap"]}
    return out


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.detach().float() - b.detach().float()).abs().max().item()


def _calls(ledger, tag: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in ledger.records:
        if r.tag == tag:
            out[r.op] = out.get(r.op, 0) + 1
    return dict(sorted(out.items()))


def _sp_grad_bytes(ledger) -> int:
    """Bytes of one all-reduce of the sequence-parallel gradients (LayerNorms, row biases, head)."""
    first = next((r for r in ledger.records if r.tag == "sp-grads"), None)
    return first.sent_bytes if first else 0


# ---- on the emulated cluster: the toy's own shapes, the real workload's, and a sweep between ------------------
def emulated(ctx, group, block, tokens: int, cfg: dict, stacks: dict, step) -> dict:
    """On the emulated cluster's clock (``launch(..., cluster=)``), with the GEMMs and transfers timed as the
    real workload ``cfg["stands_for"]``'s (``toolkit.models.catalog``; its MLP at tp = world size, one sequence
    per micro-batch): the micro-benchmark candidates, a sweep of the GEMM's length against the transfer (where
    the ring pays, where tiles pay), and the four whole-step variants. Deterministic: one call each."""
    ctx.reserve_for_replay()  # the bar's last quarter: the run replayed on other figures
    from toolkit.models import catalog, matched
    emu, tp = ctx.emulator, dist.get_world_size(group)
    w1 = block.fc1.weight
    D, F = w1.shape[1], w1.shape[0] * tp
    real = catalog.get(cfg["stands_for"])
    toy_op = matched.tp_mlp_op(tokens, D, F, tp, elem=emu.cluster.float_bytes)
    real_op = matched.tp_mlp_op(real.seq_len, real.hidden, real.ffn, tp, gated=real.gated)
    scales = matched.matched_scales(toy_op, real_op)
    out = {"cluster": emu.cluster.name, "gpu": emu.cluster.gpu.name, "link": emu.cluster.intra.name,
           "stands_for": cfg["stands_for"], "real_shape": {"tokens": real.seq_len,
                                                           "hidden": real.hidden, "ffn": real.ffn},
           "scales": scales, "real_op": matched.op_times(real_op, emu.cluster), "tiles": cfg["tiles"], "sweep": []}
    for factor in cfg["sweep"]:  # the GEMM factor × the matched one; the transfer stays the real one
        with emu.scaled(flops=scales["flops"] * factor, bytes=scales["bytes"]):
            point = _virtual_ops(ctx, group, block, tokens, cfg)
        point["factor"] = factor
        out["sweep"].append(point)
    out["matched"] = next(p for p in out["sweep"] if p["factor"] == 1)
    for point in out["sweep"]:
        for op in OPS:
            t = point[op]["mean_s"]
            point[op]["ratio"] = t["gemm"] / t["comm"]
            point[op]["ceiling"] = {"ring": overlap_ceiling(tp, t["gemm"], t["comm"]),
                                    "tiled ring": overlap_ceiling(tp, t["gemm"], t["comm"], cfg["tiles"])}
    with emu.scaled(**scales):  # the whole step, matched
        def timed(stack):
            def one():
                stack.zero_grad(set_to_none=True)
                step(stack, name="matched")
            return one
        bench = compare({name: timed(st) for name, st in stacks.items()}, warmup=0, steps=1, rounds=1,
                        sync=ctx.barrier, clock="virtual", label="matched step")
        out["step_s"] = {name: b.mean_s for name, b in bench.items()}
        spans = {}
        for name in ("bulk", "ring+keep"):
            stacks[name].zero_grad(set_to_none=True)
            stacks[name].configure(timeline=ctx.timeline)
            ctx.barrier()
            mark = len(ctx.timeline.spans)
            step(stacks[name], name="matched")
            stacks[name].configure(timeline=None)
            spans[name] = [asdict(s) for s in ctx.timeline.spans[mark:]]
        out["spans"] = spans
    out["sensitivity"] = ctx.replay(step_ratio, grid=what_if(cfg["preset"]))
    return out


def step_ratio(clocks) -> dict[str, float]:
    """The matched step of ring+keep over bulk's, from a replay of the run (``Emulator.sensitivity``), and both."""
    bulk, keep = (replayed(clocks, f"matched step/{name}") for name in ("bulk", "ring+keep"))
    return {"ratio": keep / bulk, "bulk_s": bulk, "ring+keep_s": keep}


OPS = ("AG+GEMM", "GEMM+RS")


def _mlp_operands(ctx, group, block, tokens: int, cfg: dict) -> dict:
    """fc1's input (my tokens) and weight, fc2's input (all tokens, my features) and weight, and buffers."""
    tp = dist.get_world_size(group)
    w1 = block.fc1.weight.detach().t().contiguous()  # [D, d_ff/tp]
    m, D, device = tokens // tp, w1.shape[0], w1.device
    torch.manual_seed(cfg["seed"] + 1 + ctx.rank)
    x = torch.randn(m, D, device=device)
    h = torch.randn(tp * m, w1.shape[1], device=device)
    w2 = block.fc2.weight.detach().t().contiguous()  # [d_ff/tp, D]
    partial = h @ w2
    return {"x": x, "w1": w1, "h": h, "w2": w2, "gathered": x.new_empty(tp * m, D), "partial": partial,
            "scattered": partial.new_empty(m, D)}


def _candidates(group, o: dict, tiles: int) -> dict:
    """Per op: the collective alone, the GEMM alone, bulk, ring, tiled ring, the ring's messages alone."""
    x, w1, h, w2, gathered, partial, scattered = (o[k] for k in ("x", "w1", "h", "w2", "gathered", "partial",
                                                                 "scattered"))
    return {
        "AG+GEMM": ({"x": list(x.shape), "w": list(w1.shape)},
                    {"comm": lambda: compat.all_gather_single(gathered, x, group=group),
                     "gemm": lambda: torch.mm(gathered, w1),
                     "bulk": lambda: all_gather_matmul(x, w1, group, mode="bulk"),
                     "ring": lambda: all_gather_matmul(x, w1, group, mode="ring"),
                     "tiled ring": lambda: all_gather_matmul(x, w1, group, mode="ring", tiles=tiles),
                     "ring comm": lambda: all_gather_matmul(x, w1[:, :0], group, mode="ring")}),  # GEMMs of width 0
        "GEMM+RS": ({"h": list(h.shape), "w": list(w2.shape)},
                    {"comm": lambda: compat.reduce_scatter_single(scattered, partial, group=group),
                     "gemm": lambda: torch.mm(h, w2),
                     "bulk": lambda: matmul_reduce_scatter(h, w2, group, mode="bulk"),
                     "ring": lambda: matmul_reduce_scatter(h, w2, group, mode="ring"),
                     "tiled ring": lambda: matmul_reduce_scatter(h, w2, group, mode="ring", tiles=tiles),
                     "ring comm": lambda: matmul_reduce_scatter(h[:, :0], w2[:0], group, mode="ring")})}


def _virtual_ops(ctx, group, block, tokens: int, cfg: dict) -> dict:
    """The micro-benchmark candidates once each on the virtual clock (deterministic: one call is the time)."""
    out = {}
    for op, (shapes, cands) in _candidates(group, _mlp_operands(ctx, group, block, tokens, cfg), cfg["tiles"]).items():
        res = compare(cands, warmup=0, steps=1, rounds=1, sync=ctx.barrier, clock="virtual")
        t = {n: r.mean_s for n, r in res.items()}
        out[op] = {"shapes": shapes, "mean_s": t,
                   "overlap": {v: overlap_fraction(t["comm"], t["gemm"], t[v]) for v in ("bulk", "ring", "tiled ring")}}
    return out


# ---- the real layer at its true shapes (a model: nothing is computed) --------------------------------------------
def true_shapes(stands_for: str, tokens: int, tps=(2, 8), cluster="h100-ib400") -> list[dict]:
    """``stands_for``'s MLP (``toolkit.models.catalog``) on ``tokens`` tokens at each tensor-parallel size in
    ``tps``, one rank on torch's fake process group at the true shapes (``toolkit.runtime.shapes.estimate``):
    all-gather the sequence-parallel tokens, the column-parallel up (gate + up for SwiGLU), the activation, the
    row-parallel down, reduce-scatter. Per tp: the modelled GEMMs, the other kernels, the two collectives (bulk:
    exposed), their share of the step, and how much of them a ring could hide (``overlap_ceiling``)."""
    import warnings

    import torch.nn.functional as nnf

    from toolkit.models import catalog
    from toolkit.runtime.shapes import estimate
    spec, rows = catalog.get(stands_for), []
    for tp in tps:
        d, f = spec.hidden, spec.ffn // tp
        up_width = (spec.mlp_matrices - 1) * f

        def build():
            return (torch.nn.Linear(d, up_width, bias=False, dtype=torch.bfloat16),
                    torch.nn.Linear(f, d, bias=False, dtype=torch.bfloat16),
                    torch.empty(tokens // tp, d, dtype=torch.bfloat16))  # [T/tp, D] sequence-parallel input

        def step(up, down, x):
            full = torch.empty(tokens, d, dtype=torch.bfloat16)  # [T, D]
            dist.all_gather_into_tensor(full, x)
            h = up(full)  # [T, (2)F/tp]
            h = nnf.silu(h[:, :f]) * h[:, f:] if spec.gated else nnf.gelu(h)
            dist.reduce_scatter_tensor(torch.empty(tokens // tp, d, dtype=torch.bfloat16), down(h))

        with warnings.catch_warnings():  # torch 2.13 renames the two collectives; the toolkit's ledger knows both
            warnings.simplefilter("ignore", FutureWarning)
            est = estimate(build, step, cluster, world_size=tp)
        gemm = est.by_kind().get("gemm", 0.0)
        rows.append({"tp": tp, "GEMMs (ms)": gemm * 1e3, "other kernels (ms)": (est.kernels_s - gemm) * 1e3,
                     "all-gather + reduce-scatter (ms)": est.comm_s * 1e3,
                     "communication share (bulk)": est.comm_s / est.step_s,
                     "ring ceiling": overlap_ceiling(tp, gemm, est.comm_s)})
    return rows
