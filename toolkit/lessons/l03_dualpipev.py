"""Lesson 03, per rank: DualPipeV against 1F1B, ZB-H1 and interleaved 1F1B, and against torch's DualPipeV.

    jobs (toolkit.pipeline.harness, one PipelineSetup: same tiny GPT, same micro-batches, same reference)
        1f1b, zb-h1, interleaved          ours
        dualpipev                         ours, F&B overlapped: each half waits for its own input, the first
                                          half's output leaves while the second computes
        dualpipev, fb_overlap=False       ours, both inputs of a pair awaited first, halves back to back
                                          (how torch runs OVERLAP_F_B)
        dualpipev-unpaired                ours, the same order with every F&B as a separate F and B
        dualpipev                         torch.distributed.pipelining.ScheduleDualPipeV (torch >= 2.9; on an
                                          older torch the lesson runs without it and says why)
    per job: 1 checked step (loss, grads vs single process, saved-activation bytes over the step), then all
    timed side by side (bench.compare), ours with per-op spans, receive waits and the ledger's p2p counts
    -> step times, op times (F, B, I, W, F&B per stage), the last step's timeline, exposed receive time;
       the notebook simulates every schedule with the measured op times and compares with the real steps.

1F1B and ZB-H1 cut the model into p stages; interleaved (v = 2) and DualPipeV into 2p, so n_layer must be
a multiple of 2p.
"""
from __future__ import annotations

import contextlib

from toolkit.pipeline.harness import Job, PipelineSetup, measure_schedules, replayed_steps
from toolkit.pipeline.schedule import check_layout, make_schedule, torch_order_missing
from toolkit.pipeline.torch_compare import compare_orders, runtime_missing
from toolkit.runtime.config import Param, common, require_divisible, resolve

SCHEDULES = ("1f1b", "zb-h1", "interleaved", "dualpipev")
PARAMS = {**common("model", "n_layer", "m", "micro_batch", "warmup", "bench_steps", "rounds"),
          "schedules": Param(list, "schedules run beside DualPipeV's variants", of=str, choices=SCHEDULES),
          "stands_for": Param(str, "the real model whose layers the emulated cluster times the toy's as (the "
                                   "workload-matched mode)", choices=("llama2-7b", "llama2-13b", "llama2-70b"))}
PRESETS = {
    "smoke": {"model": "smoke", "n_layer": 4, "m": 4, "micro_batch": 2, "warmup": 1, "bench_steps": 1, "rounds": 3,
              "schedules": list(SCHEDULES), "stands_for": "llama2-7b"},
    "default": {"model": "default", "n_layer": 4, "m": 8, "micro_batch": 4, "warmup": 1, "bench_steps": 2,
                "rounds": 3, "schedules": list(SCHEDULES), "stands_for": "llama2-7b"},
    "full": {"model": "full", "n_layer": 12, "m": 16, "micro_batch": 2, "warmup": 3, "bench_steps": 5, "rounds": 5,
             "schedules": list(SCHEDULES), "stands_for": "llama2-13b"},
}


def validate(cfg: dict, world_size: int) -> dict:
    cfg = resolve(cfg, PRESETS, PARAMS)
    p = world_size
    for name in ("dualpipev", "interleaved"):  # each schedule says what it needs (interleaved: v = 2 stages a rank)
        check_layout(name, p, cfg["m"], cfg["n_layer"], p_name="world_size")
    require_divisible("m", cfg["m"], p, "world_size", "interleaved 1F1B")
    return cfg


def run(ctx, cfg: dict) -> dict:
    p, m = ctx.world_size, cfg["m"]
    setup = PipelineSetup.build(cfg["model"], n_layer=cfg["n_layer"], m=m, micro_batch=cfg["micro_batch"],
                                device=ctx.device)
    dpv = make_schedule("dualpipev", p, m)
    jobs = [Job(make_schedule(name, p, m)) for name in cfg["schedules"] if name != "dualpipev"]
    jobs += [Job(dpv),                                              # F&B overlapped (ours)
             Job(dpv, fb_overlap=False),                            # F&B halves back to back (torch's way)
             Job(make_schedule("dualpipev", p, m, pair=False))]     # the same order, no pairs
    torch_missing = {"runtime": runtime_missing("dualpipev"), "order": torch_order_missing("dualpipev")}
    if torch_missing["runtime"] is None:
        jobs.append(Job(dpv, impl="torch"))                         # torch's ScheduleDualPipeV
    # the bar: measure_schedules counts its own steps, so each call gets its slice (the emulated cluster's
    # one step per schedule took 1/7 of the default run)
    slices = 7 if ctx.emulator is not None else 6
    with ctx.part(0, slices, size=6):
        runs, _ = measure_schedules(ctx, setup, jobs, warmup=cfg["warmup"], steps=cfg["bench_steps"],
                                    rounds=cfg["rounds"])
    with ctx.part(6, 7, "emulated cluster") if ctx.emulator is not None else contextlib.nullcontext():
        emulated_runs = emulated(ctx, cfg, setup, [j for j in jobs if j.impl == "ours"])
    return {"rank": ctx.rank, "emulated": emulated_runs, "p": p, "m": m, "model": vars(setup.model_cfg), "ref_loss": setup.ref_loss,
            "runs": runs, "orders": {name: make_schedule(name, p, m).to_strings() for name in cfg["schedules"]},
            "torch_missing": torch_missing,  # None, or why this torch cannot run / list torch's DualPipeV
            "torch_order_identical": (compare_orders(dpv, "dualpipev")["identical"]
                                      if torch_missing["order"] is None else None),
            "attention_modules": [name for name, _ in setup.base.blocks[0].attn.named_children()]}


def emulated(ctx, cfg: dict, setup: PipelineSetup, jobs: list[Job]) -> dict | None:
    """Our schedules once more on the emulated cluster, matched to ``cfg["stands_for"]`` (its layers' GEMMs and
    its activations between stages; ``toolkit.models.matched.dense_layer_op``): per job the step time, the time a rank
    waited for its receives (exposed p2p) and each link's busy time, all virtual. The same ops run at the toy's
    own shapes in ``runs`` (their virtual times ride along in ``bench["virtual"]``)."""
    from toolkit.models import catalog, matched
    emu = ctx.emulator
    if emu is None:
        return None
    ctx.reserve_for_replay()  # the bar's last quarter: the run replayed on other figures
    real = catalog.get(cfg["stands_for"])
    scales = matched.matched_scales(setup.layer_op(emu.cluster.float_bytes), matched.layer_op(real, real.seq_len))
    with emu.scaled(**scales):
        records, _ = measure_schedules(ctx, setup, jobs, warmup=0, steps=1, rounds=1, trim=0, label="matched")
    labels = [job.label for job in jobs]
    out = {"cluster": emu.cluster.name, "gpu": emu.cluster.gpu.name, "link": emu.cluster.intra.name,
           "stands_for": cfg["stands_for"], "scales": scales, "jobs": [],
           "sensitivity": ctx.replay(lambda clocks: replayed_steps(clocks, labels, "matched"))}
    for job, rec in zip(jobs, records):
        out["jobs"].append({"schedule": rec["schedule"], "fb_overlap": rec["fb_overlap"], "meta": rec["meta"],
                            "step_s": rec["bench"]["virtual"]["mean_s"], "exposed_recv_s": rec["exposed_recv_vs"],
                            "exposed_wire_s": rec["exposed_wire_vs"],
                            "op_seconds": rec["op_vseconds"], "spans": rec["spans"],
                            "link_busy_s": emu.link_busy("pipeline:" + job.label)})
    return out
