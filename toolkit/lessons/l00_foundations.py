"""Lesson 00, per rank: the foundations of distributed training, each measured on real processes.

Sections (each returns plain numbers under its own key):
    data_parallel  DDP vs the toolkit's ZeRO-0/1/2/3 vs FSDP2: losses, bytes/step, memory/rank (toolkit.parallel)
    tensor_parallel  Megatron column/row-parallel block vs one process vs torch's parallelize_module
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
from toolkit.memory.checkpointing import POLICIES, apply_checkpointing, saved_activation_bytes
from toolkit.models import GPT, preset
from toolkit.lessons.parallel_demos import (run_dp_zero_fsdp, run_tensor_parallel, validate_dp_zero_fsdp,
                                    validate_tensor_parallel)
from toolkit.precision import MODES, train
from toolkit.runtime.bench import comm_efficiency_ratio, measure, memory_volatility
from toolkit.runtime.memory import MemoryTracker
from toolkit.runtime.config import require_positive_ints

PRESETS = {
    "smoke": {"model": "smoke", "batch_size": 4, "train_steps": 8, "dp_steps": 3, "dp_timing": ["ddp", "zero3", "fsdp2"],
              "pp_microbatches": 4, "bench_steps": 3, "bench_rounds": 3,
              "bench_warmup": 1, "probe_sizes": [2**10, 2**14, 2**18], "probe_iters": 3},
    "default": {"model": "default", "batch_size": 8, "train_steps": 60, "dp_steps": 5, "pp_microbatches": 8,
                "dp_timing": ["ddp", "zero3", "fsdp2"], "bench_steps": 10, "bench_rounds": 5,
                "bench_warmup": 3, "probe_sizes": [2**k for k in range(10, 25, 2)], "probe_iters": 5},
    "full": {"model": "full", "batch_size": 8, "train_steps": 300, "dp_steps": 10, "dp_timing": True,
             "pp_microbatches": 16, "bench_steps": 50, "bench_rounds": 5,
             "bench_warmup": 10, "probe_sizes": [2**k for k in range(10, 31, 2)], "probe_iters": 20},
}
SECTIONS = ("data_parallel", "tensor_parallel", "pipeline", "checkpointing", "precision", "bandwidth", "bench")
# the progress bar's phases: one per section run, weighted by its rough share of the run time at the default
# preset (precision, four training runs of which two in bf16 on the CPU, is the long one)
WEIGHTS = {"data_parallel": 20, "tensor_parallel": 2, "pipeline": 10, "checkpointing": 8, "precision": 40,
           "bandwidth": 8, "bench": 12}


def PHASES(cfg: dict) -> list[tuple[str, float]]:  # noqa: N802 - the launcher reads PHASES
    return [(name, WEIGHTS[name]) for name in cfg["sections"]]


def validate(cfg: dict, world_size: int) -> dict:
    name = cfg.get("preset", "default")
    if name not in PRESETS:
        raise ValueError(f"preset={name!r} is not known; allowed: {sorted(PRESETS)}")
    if world_size < 2:
        raise ValueError(f"world_size={world_size}: lesson 00 compares parallel variants and needs at least 2 ranks")
    sections = cfg.get("sections", list(SECTIONS))
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        raise ValueError(f"sections has unknown entries {unknown}; allowed: {SECTIONS}")
    out = {**PRESETS[name], **cfg, "sections": sections}
    require_positive_ints(out, "batch_size", "train_steps", "bench_steps", "bench_rounds", "dp_steps",
                          "pp_microbatches")
    if "pipeline" in sections and out["pp_microbatches"] < world_size:
        raise ValueError(f"pp_microbatches={out['pp_microbatches']} must be >= the {world_size} pipeline stages "
                         "(1F1B needs at least one micro-batch per stage)")
    if "data_parallel" in sections:
        validate_dp_zero_fsdp(_dp_cfg(out), world_size)
    if "tensor_parallel" in sections:
        validate_tensor_parallel(_tp_cfg(out), world_size)
    return out


def _dp_cfg(cfg: dict) -> dict:
    return {"preset": cfg["model"], "steps": cfg["dp_steps"], "batch_size": cfg["batch_size"],
            "timing": cfg["dp_timing"]}


def _tp_cfg(cfg: dict) -> dict:
    return {"preset": cfg["model"], "batch_size": cfg["batch_size"]}


def run(ctx, cfg: dict) -> dict:
    model_cfg = preset(cfg["model"])
    out = {"rank": ctx.rank, "world_size": ctx.world_size, "model": vars(model_cfg)}
    steps = {"data_parallel": lambda: run_dp_zero_fsdp(ctx, _dp_cfg(cfg)),
             "tensor_parallel": lambda: run_tensor_parallel(ctx, _tp_cfg(cfg)),
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
    """GPipe and 1F1B, one stage per rank, on ``pp_microbatches`` micro-batches of real tokens."""
    from toolkit.pipeline.harness import Job, PipelineSetup, measure_schedules
    from toolkit.pipeline.schedule import make_schedule
    from toolkit.pipeline.simulate import timeline_bubble

    p, m = ctx.world_size, cfg["pp_microbatches"]
    n_layer = -(-model_cfg.n_layer // p) * p  # a whole number of blocks per stage
    setup = PipelineSetup.build(cfg["model"], n_layer=n_layer, m=m, micro_batch=max(cfg["batch_size"] // 2, 1),
                                device=ctx.device)
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
    x, y = next(batches(cfg["batch_size"], model_cfg.seq_len, 1, seed=3))
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
    mine, steps = MODES[ctx.rank::ctx.world_size], cfg["train_steps"]
    return [train(mode, model_cfg, steps, cfg["batch_size"], device=ctx.device,
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
    data = iter(batches(cfg["batch_size"], model_cfg.seq_len, 10**6, seed=11, rank=ctx.rank, world=ctx.world_size))

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
        timing = measure(tracked_step, warmup=cfg["bench_warmup"], steps=cfg["bench_steps"],
                         rounds=cfg["bench_rounds"], on_step=lambda d, t: ctx.progress(d, 2 * t, "DDP steps"))
    n_steps = cfg["bench_warmup"] + cfg["bench_steps"] * cfg["bench_rounds"]
    sent, comm_s = ctx.ledger.total("sent_bytes", op="all_reduce"), ctx.ledger.total("seconds", op="all_reduce")
    compute = measure(local_step, warmup=1, steps=cfg["bench_steps"], rounds=cfg["bench_rounds"],
                      on_step=lambda d, t: ctx.progress(t + d, 2 * t, "compute-only steps"))
    totals = [s["total"] for s in mem.samples]
    comm_s /= n_steps  # all-reduce wall time per step, measured around each bucket's call
    return {"timing": timing.to_dict(), "compute_only": compute.to_dict(), "steps_measured": n_steps,
            "allreduce_sent_bytes_per_step": sent // n_steps, "allreduce_seconds_per_step": comm_s,
            "memory_volatility": memory_volatility(totals), "memory_samples": len(totals),
            "peak_bytes": mem.peak, "comm_efficiency_ratio": comm_efficiency_ratio(comm_s, timing.mean_s,
                                                                                   compute.mean_s)}
