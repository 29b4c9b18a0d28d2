"""Lesson 00, per rank: the foundations of distributed training, each measured on real processes.

Sections (each returns plain numbers under its own key):
    data_parallel  DDP vs the toolkit's ZeRO-0/1/2/3 vs FSDP2: losses, bytes/step, memory/rank (toolkit.parallel)
    zero3_prefetch ZeRO-3 with and without prefetching the next unit's all-gather: timelines, exposed wait
    tensor_parallel  Megatron column/row-parallel block vs one process vs torch's parallelize_module
                   (these three are ``foundations_parallel``; its knobs and presets are part of this lesson's)
    pipeline       GPipe and 1F1B on one stage per rank (toolkit.pipeline): loss and grads vs one process,
                   real timelines, bubble fraction, peak activation bytes
    checkpointing  activation bytes kept for backward and fwd+bwd time per checkpoint policy; grads equal
    precision      loss curves and bytes/parameter of fp32, bf16 autocast, fp16 + scaler, bf16 + fp32 master
    bandwidth      busbw vs message size of each collective (nccl-tests style)
    bench          the article's benchmark procedure on a DDP step: trimmed mean, stability metrics
The ranks split the checkpointing and precision sweeps between them (rank r takes items r, r+N, ...).
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from toolkit.comm.bandwidth import environment_report, probe
from toolkit.data import batches
from toolkit.memory.checkpointing import POLICIES, apply_checkpointing
from toolkit.runtime.memory import saved_activation_bytes
from toolkit.lessons import foundations_parallel as parallel
from toolkit.models import GPT, preset
from toolkit.precision import MODES, train
from toolkit.runtime.bench import comm_efficiency_ratio, measure, memory_volatility
from toolkit.runtime.config import Param, common, require_ranks, resolve
from toolkit.runtime.memory import MemoryTracker

SECTIONS = (*parallel.SECTIONS, "pipeline", "checkpointing", "precision", "bandwidth", "bench")
PARAMS = {
    **parallel.PARAMS,  # model, n_layer, seq_len, batch, lr, seed, warmup, bench_steps, rounds, dp_*
    **common("m"),
    "sections": Param(list, "the parts of the lesson to run", of=str, choices=SECTIONS),
    "precision_model": Param(str, "toolkit.models size preset of the mixed-precision section (bf16/fp16 matmuls "
                             "are slow on CPUs without AVX-512)", choices=("smoke", "default", "full")),
    "precision_steps": Param(int, "training steps of each mixed-precision recipe", ge=1),
    "probe_sizes": Param(list, "message sizes of the bandwidth probe (bytes)", of=int, ge=1),
    "probe_iters": Param(int, "timed calls per op and size in the bandwidth probe", ge=1),
}
# default: what a 2-core CPU runs within the course's time budget (every section, shorter sweeps and
# fewer timed steps than `full`; every figure keeps its points)
PRESETS = {
    "smoke": {**parallel.PRESETS["smoke"], "precision_model": "smoke", "precision_steps": 8, "m": 4,
              "probe_sizes": [2**10, 2**14, 2**18], "probe_iters": 3, "sections": list(SECTIONS)},
    "default": {**parallel.PRESETS["default"], "precision_model": "smoke", "precision_steps": 40, "m": 8,
                "probe_sizes": [2**k for k in range(10, 23, 2)], "probe_iters": 5, "sections": list(SECTIONS)},
    "full": {**parallel.PRESETS["full"], "precision_model": "full", "precision_steps": 300, "m": 16,
             "probe_sizes": [2**k for k in range(10, 31, 2)], "probe_iters": 20, "sections": list(SECTIONS)},
}
# the progress bar's phases: one per section run, weighted by its rough share of the run time at the default
# preset (CPU seconds per rank, measured)
WEIGHTS = {"data_parallel": 30, "zero3_prefetch": 18, "tensor_parallel": 2, "pipeline": 9, "checkpointing": 5,
           "precision": 13, "bandwidth": 2, "bench": 16}


def PHASES(cfg: dict) -> list[tuple[str, float]]:  # noqa: N802 - the launcher reads PHASES
    return [(name, WEIGHTS[name]) for name in cfg["sections"]]


def validate(cfg: dict, world_size: int) -> dict:
    out = resolve(cfg, PRESETS, PARAMS)
    require_ranks(world_size, 2, "lesson 00 (it compares parallel variants)")
    sections = out["sections"]
    if "pipeline" in sections and out["m"] < world_size:
        raise ValueError(f"m={out['m']} micro-batches must be >= the {world_size} pipeline stages "
                         "(1F1B needs at least one micro-batch per stage)")
    return parallel.check(out, world_size, sections)


def run(ctx, cfg: dict) -> dict:
    model_cfg = parallel.model_config(cfg)
    out = {"rank": ctx.rank, "world_size": ctx.world_size, "model": vars(model_cfg)}
    steps = {"data_parallel": lambda: parallel.data_parallel(ctx, cfg, model_cfg),
             "zero3_prefetch": lambda: parallel.zero3_prefetch(ctx, cfg, model_cfg),
             "tensor_parallel": lambda: parallel.tensor_parallel(ctx, cfg, model_cfg),
             "pipeline": lambda: pipeline(ctx, cfg, model_cfg),
             "checkpointing": lambda: checkpointing(ctx, cfg, model_cfg),
             "precision": lambda: precision(ctx, cfg, model_cfg),
             "bandwidth": lambda: bandwidth(ctx, cfg),
             "bench": lambda: bench(ctx, cfg, model_cfg)}
    for name in cfg["sections"]:
        with ctx.phase(name), ctx.ledger.tag(name):
            out[name] = steps[name]()
    return out


def pipeline(ctx, cfg, model_cfg) -> dict:
    """GPipe and 1F1B, one stage per rank, on ``m`` micro-batches of real tokens."""
    from toolkit.pipeline.harness import Job, PipelineSetup, measure_schedules
    from toolkit.pipeline.schedule import make_schedule
    from toolkit.pipeline.simulate import timeline_bubble

    p, m = ctx.world_size, cfg["m"]
    n_layer = -(-model_cfg.n_layer // p) * p  # a whole number of blocks per stage
    setup = PipelineSetup.build(cfg["model"], n_layer=n_layer, m=m, micro_batch=max(cfg["batch"] // 2, 1),
                                device=ctx.device, seq_len=model_cfg.seq_len)
    out = {"p": p, "m": m, "n_layer": n_layer}
    jobs = [Job(make_schedule(name, p, m)) for name in ("gpipe", "1f1b")]
    records, _ = measure_schedules(ctx, setup, jobs, warmup=1, steps=2, rounds=3)
    for got in records:
        spans = [None] * p
        dist.all_gather_object(spans, got["spans"])  # every rank's spans of the last timed step
        merged = [s for rank_spans in spans for s in rank_spans]
        out[got["schedule"]] = {"loss": got["loss"], "grad_diff": got["grad_diff"],
                                "peak_act_bytes": got["peak_act_bytes"], "step_s": got["bench"]["mean_s"],
                                "spans": merged, "measured_bubble_fraction": timeline_bubble(merged, p)["bubble_fraction"]}
    return out


def checkpointing(ctx, cfg, model_cfg) -> list[dict]:
    """Per policy (this rank's share): saved activation bytes, fwd+bwd time, grads equal to no checkpointing."""
    torch.manual_seed(0)
    base = GPT(model_cfg)
    x, y = next(batches(cfg["batch"], model_cfg.seq_len, 1, seed=3))
    reference = None
    rows = []
    for policy in POLICIES:
        model = apply_checkpointing(copy.deepcopy(base), policy)
        saved, loss = saved_activation_bytes(lambda: model(x, y), list(model.parameters()))
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        reference = grads if reference is None else reference
        ctx.progress(POLICIES.index(policy) + 1, len(POLICIES), policy)
        if policy not in POLICIES[ctx.rank::ctx.world_size]:
            continue  # every rank computes the reference grads; each times its own share of policies

        def step():
            model.zero_grad(set_to_none=True)
            model(x, y).backward()
        timing = measure(step, warmup=1, steps=2, rounds=3, trim=1)
        rows.append({"policy": policy, "saved_bytes": saved, "fwd_bwd_s": timing.mean_s,
                     "grads_bitwise_equal": bool(torch.equal(grads, reference))})
    return rows


def precision(ctx, cfg, model_cfg) -> list[dict]:
    """This rank's share of the mixed-precision modes, trained on identical data."""
    mine, steps = MODES[ctx.rank::ctx.world_size], cfg["precision_steps"]
    return [train(mode, preset(cfg["precision_model"]), steps, cfg["batch"], device=ctx.device,
                  on_step=lambda done, _, k=k, mode=mode: ctx.progress(k * steps + done, len(mine) * steps, mode))
            for k, mode in enumerate(mine)]


def bandwidth(ctx, cfg) -> dict:
    rows = probe(cfg["probe_sizes"], iters=cfg["probe_iters"], device=ctx.device,
                 on_step=lambda done, total: ctx.progress(done, total, "message sizes"))
    return {"rows": rows, "environment": environment_report(), "backend": ctx.backend}


def bench(ctx, cfg, model_cfg) -> dict:
    """The article's procedure on a DDP training step (fixed seed, warm-up, rounds, trimmed mean)."""
    torch.manual_seed(0)
    model = GPT(model_cfg).to(ctx.device)
    ddp = DDP(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
    ddp.register_comm_hook(None, allreduce_hook)  # same all-reduce as the C++ reducer, but through the ledger
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    data = iter(batches(cfg["batch"], model_cfg.seq_len, 10**6, seed=11, rank=ctx.rank, world=ctx.world_size))

    def ddp_step():
        x, y = next(data)
        opt.zero_grad(set_to_none=True)
        ddp(x.to(ctx.device), y.to(ctx.device)).backward()
        opt.step()

    def local_step():  # the same compute without gradient synchronisation
        x, y = next(data)
        opt.zero_grad(set_to_none=True)
        with ddp.no_sync():
            ddp(x.to(ctx.device), y.to(ctx.device)).backward()
        opt.step()

    ctx.ledger.reset()
    with MemoryTracker(model, opt, every_op=False) as mem:
        def tracked_step():
            ddp_step()
            mem.mark("step")
        timing = measure(tracked_step, warmup=cfg["warmup"], steps=cfg["bench_steps"],
                         rounds=cfg["rounds"], on_step=lambda d, t: ctx.progress(d, 2 * t, "DDP steps"))
    n_steps = cfg["warmup"] + cfg["bench_steps"] * cfg["rounds"]
    sent, comm_s = ctx.ledger.total("sent_bytes", op="all_reduce"), ctx.ledger.total("seconds", op="all_reduce")
    compute = measure(local_step, warmup=1, steps=cfg["bench_steps"], rounds=cfg["rounds"],
                      on_step=lambda d, t: ctx.progress(t + d, 2 * t, "compute-only steps"))
    totals = [s["total"] for s in mem.samples][cfg["warmup"]:]  # steady state: AdamW's state exists from step 1
    comm_s /= n_steps  # all-reduce wall time per step, measured around each bucket's call
    return {"timing": timing.to_dict(), "compute_only": compute.to_dict(), "steps_measured": n_steps,
            "allreduce_sent_bytes_per_step": sent // n_steps, "allreduce_seconds_per_step": comm_s,
            "memory_volatility": memory_volatility(totals), "memory_samples": len(totals),
            "peak_bytes": mem.peak, "comm_efficiency_ratio": comm_efficiency_ratio(comm_s, timing.mean_s,
                                                                                   compute.mean_s)}
