"""Lesson 16, per rank: what CUDA graphs would remove from DualPipeV's chunks, and the DP all-reduce kept
outside them (issued per stage or bucket by bucket, overlapped with the rest of the schedule).

    grid dp × pp (tp = 1); every pipeline rank holds two stages of the V (DualPipeV, 2·pp stages)
    ├─ DualPipeV on real ranks, DP gradient all-reduce three ways (toolkit.pipeline.dp_separate):
    │     plain      after the pipeline step            separated  per stage, right after its last B/W
    │     bucketed   buckets of ``bucket_bytes``, each issued inside the stage's last B/W once its gradients are final
    │     1 checked step each: loss, gradients (bitwise vs plain; vs one process over all dp·m micro-batches),
    │     bytes; 1 traced step each (op spans + all-reduce in flight); timed side by side
    └─ per stage of this rank: ATen ops of one micro-batch's forward and backward (TorchDispatchMode; all,
          and the compute ops among them: not views, about one kernel launch each on a GPU), the chunk's
          time at the run's shape and at one token (host cost per op: what a graph replay removes), and the
          capture audit of a dense stage, an MoE block, the DP all-reduce and the loss's .item()
    on an emulated cluster: one step per variant, eager and graphed at the toy's shapes, and eager matched to
    STANDS_FOR's layers (its GEMMs, activations and gradients): the DP wait at the step's end per stage
"""
from __future__ import annotations

import contextlib
from dataclasses import replace

import torch
import torch.distributed as dist

from toolkit.models import catalog, matched
from toolkit.graphs import audit, count_ops, dispatch_cost
from toolkit.graphs.cuda_graphs import GraphReplay
from toolkit.models import GPT, lm_loss
from toolkit.pipeline.dp_separate import DataParallelSeparation, last_grad_ops
from toolkit.pipeline.executor import PipelineExecutor
from toolkit.pipeline.harness import PipelineSetup, grads_bitwise_equal
from toolkit.pipeline.schedule import check_layout, make_schedule
from toolkit.runtime.bench import compare
from toolkit.runtime.config import Param, common, resolve
from toolkit.runtime.timeline import Timeline

WORLD_SIZE = 4  # the generated bad-input tests validate at this size (dp = pp = 2)
PARAMS = {**common("model", "n_layer", "m", "micro_batch", "seed", "warmup", "bench_steps", "rounds"),
          "pp": Param(int, "pipeline ranks (DualPipeV: 2·pp stages)", ge=1),
          "dp": Param(int, "data-parallel replicas of each pipeline rank (dp·pp = world size)", ge=1),
          "bucket_bytes": Param(int, "bucketed DP reduce: gradient bytes per bucket (a bucket closes at the first "
                                     "parameter that reaches it)", ge=1)}
PRESETS = {  # small models on purpose: the host's cost per op is what a graph removes, and it dominates there
    "smoke": {"model": "smoke", "n_layer": 4, "m": 4, "micro_batch": 2, "seed": 0, "pp": 2, "dp": 2,
              "bucket_bytes": 16384, "warmup": 1, "bench_steps": 2, "rounds": 2},
    "default": {"model": "smoke", "n_layer": 4, "m": 8, "micro_batch": 2, "seed": 0, "pp": 2, "dp": 2,
                "bucket_bytes": 16384, "warmup": 1, "bench_steps": 2, "rounds": 3},
    "full": {"model": "default", "n_layer": 8, "m": 16, "micro_batch": 4, "seed": 0, "pp": 2, "dp": 2,
             "bucket_bytes": 262144, "warmup": 2, "bench_steps": 5, "rounds": 5},
}
VARIANTS = ("plain", "separated", "bucketed")
STANDS_FOR = "llama2-7b"  # the emulated cluster's matched run: each toy layer timed as one of this model's layers


def validate(cfg: dict, world_size: int) -> dict:
    cfg = resolve(cfg, PRESETS, PARAMS)
    if cfg["dp"] * cfg["pp"] != world_size:
        raise ValueError(f"dp={cfg['dp']} × pp={cfg['pp']} = {cfg['dp'] * cfg['pp']} must equal "
                         f"world_size={world_size} (one rank per (dp, pp) pair)")
    check_layout("dualpipev", cfg["pp"], cfg["m"], cfg["n_layer"])
    return cfg


def run(ctx, cfg: dict) -> dict:
    dp, pp, m = cfg["dp"], cfg["pp"], cfg["m"]
    grid = ctx.make_grid(dp=dp, pp=pp)
    r, d = grid.rank_in("pp"), grid.rank_in("dp")
    schedule = make_schedule("dualpipev", pp, m)
    # all dp·m micro-batches and the one-process reference over them; this replica runs its own m
    setup = PipelineSetup.build(cfg["model"], m=dp * m, micro_batch=cfg["micro_batch"], n_layer=cfg["n_layer"],
                                seed=cfg["seed"], device=ctx.device)
    mc = setup.model_cfg
    inputs, targets = setup.inputs[d * m:(d + 1) * m], setup.targets[d * m:(d + 1) * m]

    def executor(variant: str, timeline=None, graphs: bool = False, grad_context=None):
        """(model, executor, its data-parallel hook) on a fresh copy of the model, the DP reduce as ``variant``
        (``VARIANTS``); ``graphs``: every op one CUDA graph replay on the emulated cluster (``GraphReplay``)."""
        model = setup.fresh()
        sep = DataParallelSeparation(grid.group("dp"), variant != "plain",
                                     cfg["bucket_bytes"] if variant == "bucketed" else None, grad_context)
        ex = PipelineExecutor(schedule, r, setup.stages(model, schedule, r), lm_loss, setup.act_shape,
                              device=ctx.device, peers=grid.ranks("pp"), group=grid.group("pp"), timeline=timeline,
                              hooks=[sep] + ([GraphReplay(ctx.emulator)] if graphs else []))
        return model, ex, sep

    # the real run: every section but the emulated one runs with the emulator paused (no bookkeeping on every op,
    # which the host cost per op measured below would otherwise include)
    with ctx.paused():
        # -- one checked step per variant ------------------------------------------------------------------
        runs, models = {}, {}
        for name in VARIANTS:
            model, ex, sep = executor(name)
            with ctx.ledger.tag(name):
                loss = ex.step(inputs, targets)
            runs[name] = {"loss": loss, "grad_max_diff": setup.grad_diff(model, schedule, r),
                          "dp_bytes": ctx.ledger.total("sent_bytes", tag=name, op="all_reduce"),
                          "p2p_bytes": ctx.ledger.total("sent_bytes", tag=name, op="isend"),
                          "reduces": [{k: v for k, v in x.items() if k in ("stage", "bucket", "bytes")}
                                      for x in sep.reduces]}
            models[name] = model
        plain_stages = setup.stages(models["plain"], schedule, r).values()
        bitwise = {name: grads_bitwise_equal(models["plain"], models[name], plain_stages) for name in VARIANTS[1:]}
        losses = [runs[n]["loss"] for n in VARIANTS]
        ctx.progress(1, 5, "checked")

        # -- one traced step per variant (aligned clocks), then all timed side by side ------------------------
        traced = {}
        for name in VARIANTS:
            tl = Timeline(ctx.rank)
            tl.origin = ctx.timeline.origin
            model, ex, sep = executor(name, tl)
            ctx.barrier()
            start = tl.now()
            ex.step(inputs, targets)
            end = tl.now()
            spans = tl.to_json()
            for x in sep.reduces:
                spans.append({"rank": ctx.rank, "kind": "DP all-reduce", "start": x["issued"], "end": x["done_by"],
                              "meta": {"stage": x["stage"], "bucket": x["bucket"], "lane": "dp"}})
            reduces = [{**x, "before_end_s": end - x["issued"]} for x in sep.reduces]
            traced[name] = {"spans": spans, "step_s": end - start, "waits_s": sum(x["waited_s"] for x in sep.reduces),
                            "reduces": reduces}
        ctx.progress(2, 5, "timing")
        timed = {name: executor(name) for name in VARIANTS}

        def stepper(name):
            model, ex, _ = timed[name]

            def one():
                model.zero_grad(set_to_none=True)
                ex.step(inputs, targets)
            return one

        with ctx.ledger.tag("bench"):
            bench = compare({n: stepper(n) for n in VARIANTS}, warmup=cfg["warmup"], steps=cfg["bench_steps"],
                            rounds=cfg["rounds"], sync=ctx.barrier)
        exposed = {}
        for name in VARIANTS:  # the DP wait at the end of the last timed step
            exposed[name] = sum(x["waited_s"] for x in timed[name][2].reduces)

        # -- what a graph would remove: ops and host cost per chunk of this rank's stages ------------------------
        ctx.progress(3, 5, "op counts")
        chunks = {}
        stages = setup.stages(setup.fresh(), schedule, r)
        last = schedule.n_stages - 1
        for s, module in stages.items():
            x = inputs[0] if s == 0 else torch.randn(cfg["micro_batch"], mc.seq_len, mc.d_model, device=ctx.device,
                                                       requires_grad=True)
            tiny = inputs[0][:1, :1] if s == 0 else torch.randn(1, 1, mc.d_model, device=ctx.device, requires_grad=True)
            chunk = _chunk(module, x, targets[0] if s == last else None)
            tiny_chunk = _chunk(module, tiny, targets[0][:1, :1] if s == last else None)
            ops = count_ops(chunk)
            tiny_ops = count_ops(tiny_chunk)
            module.zero_grad(set_to_none=True)
            passes = ("forward", "backward")
            chunks[s] = {"ops": {k: sum(ops[k].values()) for k in passes}, "op_types": ops,
                         "compute_ops": {k: sum(n for op, n in ops[k].items() if op not in ops["no_kernel"])
                                         for k in passes},
                         "tiny_ops": {k: sum(tiny_ops[k].values()) for k in passes},
                         "time_s": dispatch_cost(chunk, repeats=5, device=ctx.device),
                         "tiny_time_s": dispatch_cost(tiny_chunk, repeats=10, device=ctx.device),
                         "has_loss": s == last, "embeds": s == 0}
            module.zero_grad(set_to_none=True)
        ctx.progress(4, 5, "capture audit")
        audits = capture_audit(ctx, grid, mc, inputs[0], targets[0])
    on_cluster = emulated(ctx, cfg, mc, executor, inputs, targets)
    ctx.progress(5, 5, "done")
    return {"rank": ctx.rank, "device": ctx.device.type, "pp_rank": r, "dp_rank": d, "dp": dp, "pp": pp, "m": m, "model": vars(mc),
            "stages": schedule.stages_of(r), "order": [str(a) for a in schedule.ranks[r]], "ref_loss": setup.ref_loss,
            "last_grad_op": last_grad_ops(schedule, r), "n_ops": sum(len(a.parts) for a in schedule.ranks[r]),
            "runs": runs, "losses_equal": len(set(losses)) == 1,
            "grads_bitwise_plain_vs_separated": bitwise["separated"], "grads_bitwise_plain_vs_bucketed": bitwise["bucketed"],
            "traced": traced, "bench": {n: b.to_dict() for n, b in bench.items()}, "exposed_dp_wait_s": exposed,
            "chunks": {str(s): c for s, c in chunks.items()}, "audit": audits, "emulated": on_cluster}


def emulated(ctx, cfg: dict, mc, executor, inputs, targets) -> dict | None:
    """One DualPipeV step per variant on the emulated cluster's clock (virtual time, deterministic): at the toy's
    shapes eager and with every op one CUDA graph replay (``GraphReplay``; bucketed eager only: inside a chunk's
    graph no bucket can leave before the chunk ends), and eager matched to ``STANDS_FOR``'s layers: each toy layer
    timed as one of its layers (GEMM FLOPs and activation bytes, ``matched.matched_scales``; gradient bytes as its
    layer's weights, ``grad_scale``). Per run: the step, the host's launch time within it, and the time the step's
    end waited for the DP all-reduces, in all and per stage."""
    emu = ctx.emulator
    if emu is None:
        return None
    ctx.reserve_for_replay()  # the bar's last quarter: the run replayed on other figures
    real = catalog.get(STANDS_FOR)
    toy_tokens, real_tokens = cfg["micro_batch"] * mc.seq_len, real.seq_len
    scales = matched.matched_scales(matched.dense_layer_op(toy_tokens, mc.d_model, mc.d_ff, emu.cluster.float_bytes),
                                    matched.layer_op(real, real_tokens, elem=emu.cluster.float_bytes))
    grad_scale = scales["flops"] * toy_tokens / real_tokens  # a layer's weights: its GEMM FLOPs per token, halved
    out = {"cluster": emu.cluster.name, "gpu": emu.cluster.gpu.name, "dp_link": None, "runs": {},
           "matched": {"stands_for": STANDS_FOR, "scales": {**scales, "grads": grad_scale}, "runs": {}}}

    def one(variant: str, graphs: bool = False, matched: bool = False) -> dict:
        grad_context = (lambda: emu.scaled(flops=scales["flops"], bytes=grad_scale)) if matched else None
        model, ex, sep = executor(variant, graphs=graphs, grad_context=grad_context)
        ctx.barrier()  # clocks aligned, hosts synchronized
        launches, t0 = emu.totals()["launch_s"], emu.now()
        with emu.window(f"{'matched' if matched else 'graphed' if graphs else 'eager'} · {variant}"):
            with emu.scaled(**scales) if matched else contextlib.nullcontext():
                ex.step(inputs, targets)
        return {"graphs": graphs, "dp": variant, "step_s": emu.now() - t0,
                "launch_s": emu.totals()["launch_s"] - launches,
                "dp_wait_s": sum(x.get("waited_vs", 0.0) for x in sep.reduces),
                "dp_wait_by_stage": {str(s): sum(x.get("waited_vs", 0.0) for x in sep.reduces if x["stage"] == s)
                                     for s in sep.buckets},
                "reduces": len(sep.reduces)}
    for graphs in (False, True):
        for name in VARIANTS:
            if not (graphs and name == "bucketed"):
                out["runs"][f"{'graphed' if graphs else 'eager'} · {name}"] = one(name, graphs)
    for name in VARIANTS:
        out["matched"]["runs"][name] = one(name, matched=True)
    out["dp_link"] = next((c["link"] for c in emu.comms if c["op"] == "all_reduce" and c["link"]), None)
    runs = list(out["runs"]) + [f"matched · {name}" for name in VARIANTS]
    out["sensitivity"] = ctx.replay(lambda clocks: {r: max(c.window(r)["s"] for c in clocks) for r in runs})
    return out


def capture_audit(ctx, grid, mc, idx: torch.Tensor, tgt: torch.Tensor) -> dict[str, dict[str, str]]:
    """What would break a CUDA-graph capture, found by running each candidate region under ``audit``."""
    torch.manual_seed(1)
    dense = GPT(mc).to(ctx.device)
    moe = GPT(replace(mc, n_layer=1, n_expert=4)).to(ctx.device)
    grad = torch.ones(1, device=ctx.device)
    out = {"dense stage: forward + backward": audit(lambda: dense(idx, tgt).backward()),
           "MoE block: forward + backward": audit(lambda: moe(idx, tgt).backward())}
    with ctx.ledger.tag("audit"):
        out["DP gradient all-reduce"] = audit(lambda: dist.all_reduce(grad, group=grid.group("dp")))
    out["the loss read on the host (.item())"] = audit(lambda: dense(idx, tgt).item())
    return out


def _chunk(module, x: torch.Tensor, target: torch.Tensor | None):
    """One micro-batch through ``module`` (and the loss, on the last stage), as a callable."""
    if target is None:
        return lambda: module(x)
    return lambda: lm_loss(module(x), target)
