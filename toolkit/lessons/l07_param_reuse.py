"""Lesson 07, per rank: parameter copy reuse under a sharded (ZeRO-1) optimizer on ``dp = world_size`` ranks.

Three replicas of one bf16 GPT train side by side on the same data, each with its parameters in one
flat bf16 buffer and its optimizer on this rank's shard of it::

    backward ─► flat fp32 grads ─► all_reduce / dp ─► my shard ─► optimizer.step ─► all_gather shards ─► flat bf16
                                                                      │
       reuse : ReuseAdamW                     master = bf16 shard + int16 residual      (what we teach)
       same  : MasterAdamW(rounding="away")   fp32 master, cast ties-away               (the bit-exact reference)
       amp   : MasterAdamW("nearest_even")    fp32 master, cast round-half-even         (plain mixed precision)

Checked at every step: reuse == same (bf16 weights and fp32 masters, torch.equal); reuse's bf16
differs from ``master.bfloat16()`` on exactly the ties. The lesson is about bf16 storage, so on a CPU whose bf16
GEMMs are slow the three replicas' GEMMs compute in fp32 from the bf16 tensors (``toolkit.runtime.bf16``). Measured: bytes per parameter by category
(storage nbytes and the MemoryTracker), how soon ``amp`` drifts away from ``same``, step times.
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn

from toolkit.data import batches
from toolkit.memory.param_reuse import MasterAdamW, ReuseAdamW, bytes_by_category, count_ties, flatten_params_
from toolkit.models import GPT, count_params, preset
from toolkit.runtime import compat
from toolkit.runtime.bench import compare
from toolkit.runtime.bf16 import bf16_as_storage, compute
from toolkit.runtime.config import Param, common, require_divisible, resolve
from toolkit.runtime.memory import MemoryTracker

PARAMS = {**common("model", "seq_len", "batch", "steps", "lr", "warmup", "bench_steps", "rounds"),
          "chunk_numel": Param(int, "elements the reuse optimizer updates at a time (a multiple of 64)", ge=64)}
PRESETS = {
    "smoke": {"model": "smoke", "seq_len": 32, "batch": 4, "steps": 20, "lr": 1e-2, "chunk_numel": 1 << 16,
              "warmup": 1, "bench_steps": 2, "rounds": 3},
    "default": {"model": "default", "seq_len": 64, "batch": 4, "steps": 40, "lr": 3e-3, "chunk_numel": 1 << 16,
                "warmup": 1, "bench_steps": 3, "rounds": 5},
    "full": {"model": "full", "seq_len": 1024, "batch": 8, "steps": 1000, "lr": 3e-4, "chunk_numel": 1 << 16,
             "warmup": 2, "bench_steps": 10, "rounds": 5},
}
PHASES = [("train", 4), ("measure", 1)]  # the bar: training took 4/5 of a default run, memory and timing the rest


def validate(cfg: dict, world_size: int) -> dict:
    cfg = resolve(cfg, PRESETS, PARAMS)
    longest = preset(cfg["model"]).seq_len
    if cfg["seq_len"] > longest:
        raise ValueError(f"seq_len={cfg['seq_len']} exceeds the {cfg['model']} model's {longest}")
    require_divisible("chunk_numel", cfg["chunk_numel"], 64, "64", "the optimizer's chunks are 64-aligned")
    return cfg


class Replica:
    """One bf16 model whose parameters live in a flat buffer, and an optimizer on this rank's shard of it."""

    def __init__(self, model: nn.Module, make_opt, rank: int, dp: int):
        self.model, self.rank, self.dp = model, rank, dp
        self.params = list(model.parameters())
        self.numel = sum(p.numel() for p in self.params)
        self.flat = flatten_params_(model, multiple_of=dp)  # [N_pad] bf16; every parameter is a view of it
        self.shard = self.flat.chunk(dp)[rank]  # [N_pad/dp] bf16, what this rank's optimizer owns
        self.opt = make_opt([self.shard])

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> float:
        for p in self.params:
            p.grad = None
        with bf16_as_storage():  # bf16 GEMMs in fp32, rounded once, where this CPU's bf16 GEMMs are slow
            loss = self.model(x, y)
            loss.backward()
        return loss.item()

    def step(self, x: torch.Tensor, y: torch.Tensor, mem: MemoryTracker | None = None) -> float:
        mark = mem.mark if mem else (lambda label: None)
        mark("forward+backward")
        loss = self.forward_backward(x, y)
        mark("grad all-reduce")
        grads = torch.zeros(self.flat.numel(), dtype=torch.float32)  # [N_pad] fp32 bucket
        torch.cat([p.grad.reshape(-1).float() for p in self.params], out=grads[:self.numel])
        if mem:
            mem.register(grads, "comm")
        dist.all_reduce(grads)
        grads /= self.dp
        self.shard.grad = grads.chunk(self.dp)[self.rank].bfloat16()
        del grads
        mark("optimizer")
        self.opt.step()
        mark("all-gather")
        compat.all_gather_single(self.flat, self.shard.clone())
        self.shard.grad = None
        return loss

    def master(self) -> torch.Tensor:
        return self.opt.master(self.shard)


def run(ctx, cfg: dict) -> dict:
    dp, rank = ctx.world_size, ctx.rank
    ctx.make_grid(dp=dp)
    model_cfg = preset(cfg["model"], seq_len=cfg["seq_len"])
    torch.manual_seed(0)
    base = GPT(model_cfg).to(torch.bfloat16)
    n_params = count_params(base)
    hyper = {"lr": cfg["lr"], "weight_decay": 0.1}
    makers = {"reuse": lambda ps: ReuseAdamW(ps, chunk_numel=cfg["chunk_numel"], **hyper),
              "same": lambda ps: MasterAdamW(ps, rounding="away", **hyper),
              "amp": lambda ps: MasterAdamW(ps, rounding="nearest_even", **hyper)}
    reps = {name: Replica(copy.deepcopy(base), make, rank, dp) for name, make in makers.items()}

    # ---- training: reuse == same at every step; amp drifts once a tie rounds the other way -----------
    ctx.phase("train")
    data = list(batches(cfg["batch"], cfg["seq_len"], cfg["steps"] + 1, seed=1, rank=rank, world=dp))
    losses = {name: [] for name in reps}
    bitexact_steps, tie_rows, drift = 0, [], []
    first_drift = None
    for step, (x, y) in enumerate(data[:-1]):
        for name, rep in reps.items():
            losses[name].append(rep.step(x, y))
        r, s, a = reps["reuse"], reps["same"], reps["amp"]
        master_r = r.master()
        same = torch.equal(r.flat.view(torch.int16), s.flat.view(torch.int16)) and torch.equal(
            master_r.view(torch.int32), s.master().view(torch.int32))
        ties = count_ties(master_r)  # this rank's shard
        rne_diff = int((r.shard.view(torch.int16) != master_r.bfloat16().view(torch.int16)).sum())
        counts = torch.tensor([int(same), ties["ties"], ties["rne_mismatches"], rne_diff], dtype=torch.int64)
        dist.all_reduce(counts)
        bitexact_steps += int(counts[0] == dp)
        tie_rows.append({"step": step, "ties": int(counts[1]), "rne_mismatches": int(counts[2]),
                         "bf16_vs_rne_cast": int(counts[3])})
        n_drift = int((a.flat != s.flat).sum())  # flat is identical on every rank after the all-gather
        drift.append(n_drift)
        if n_drift and first_drift is None:
            first_drift = step
        ctx.progress(step + 1, cfg["steps"], "training reuse / same / amp")

    # ---- memory: storage bytes per parameter, unsharded and sharded -------------------------------------
    ctx.phase("measure")
    def per_param(model, opt, numel):
        b = bytes_by_category(model, opt)
        return {k: v / numel for k, v in b.items()} | {"bytes": b}

    unsharded = {}
    for name in ("reuse", "amp"):
        m = copy.deepcopy(base)
        unsharded[name] = per_param(m, makers[name](list(m.parameters())), n_params)
    sharded = {name: per_param(reps[name].model, reps[name].opt, n_params) for name in ("reuse", "amp")}
    shard_numel = reps["reuse"].shard.numel()

    # ---- memory over one training step, by category (MemoryTracker) -----------------------------------
    x, y = data[-1]
    tracked = {}
    for name in ("amp", "reuse"):
        rep = reps[name]
        with MemoryTracker(rep.model, rep.opt) as mem:
            rep.step(x, y, mem)
            mem.mark("end")
        tracked[name] = {"peak": mem.peak, "peak_label": mem.peak_label, "max": mem.max_by_category,
                         "end": mem.samples[-1], "samples": mem.samples}

    # ---- step time: plain mixed precision vs reuse, side by side (bench.compare: rounds, the order rotating) ----
    timing = {"warmup": cfg["warmup"], "steps": cfg["bench_steps"], "rounds": cfg["rounds"], "sync": ctx.barrier}
    grad = (torch.randn(reps["amp"].shard.shape) * 1e-3).bfloat16()
    for name in ("amp", "reuse"):
        reps[name].shard.grad = grad
    opt_times = compare({name: reps[name].opt.step for name in ("amp", "reuse")}, **timing)
    for name in ("amp", "reuse"):
        reps[name].shard.grad = None
    ctx.progress(1, 2, "timing the training step")
    train_times = compare({name: (lambda rep=reps[name]: rep.step(x, y)) for name in ("amp", "reuse")}, **timing)
    bench = {name: {"optimizer_step_s": opt_times[name].mean_s, "train_step_s": train_times[name].mean_s}
             for name in ("amp", "reuse")}

    return {
        "dp": dp, "n_params": n_params, "numel_padded": reps["reuse"].flat.numel(), "shard_numel": shard_numel,
        "model": {"d_model": model_cfg.d_model, "n_layer": model_cfg.n_layer, "seq_len": cfg["seq_len"]},
        "steps": cfg["steps"], "bitexact_steps": bitexact_steps, "ties": tie_rows, "amp_drift": drift,
        "amp_first_drift_step": first_drift, "losses": losses,
        "bytes_per_param_unsharded": unsharded, "bytes_per_param_sharded": sharded, "tracked": tracked,
        "bench": bench, "bf16_compute": compute(),
    }
