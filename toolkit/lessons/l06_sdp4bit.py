"""Lesson 06 per-rank program: sharded data parallelism with SDP4Bit's 4-bit communication.

Every rank trains the same tiny GPT with ZeRO-style sharding four ways, from the same init and batches:

    baseline             bf16 gradient reduce-scatter, bf16 weight all-gather
    sdp4bit              TLq-HS gradients (8-bit in the node, 4-bit across, Hadamard) + qWD weights
    sdp4bit_no_hadamard  the same without the Hadamard rotation
    direct4              bf16 gradients, 4-bit weights all-gathered directly (the ablation)

and reports losses, bytes per step by phase and by link (intra-/inter-node, from the ledger), gradient
and weight SNR, and whether the replicas stayed bitwise identical. ``invariants`` runs the checks of
the technique on random tensors (used by the tests).
"""
from __future__ import annotations

import copy
import math

import torch
import torch.distributed as dist

from toolkit.comm.sdp4bit import (Codec, SDPConfig, ShardedDP, all_gather_direct, all_gather_qwd, check_topology,
                                  make_topology, reduce_scatter_bf16, reduce_scatter_fp32, reduce_scatter_tlq)
from toolkit.data import batches, held_out_loss
from toolkit.models.gpt import GPT, count_params, preset
from toolkit.quant import dequantize_blockwise, hadamard32, qsnr_db, quantize_blockwise
from toolkit.runtime.config import require_positive_ints, resolve_preset

PRESETS = {
    "smoke": dict(model="smoke", batch=8, steps=20, lr=3e-3, nodes=2, snr_every=5, eval_batches=4),
    "default": dict(model="default", batch=8, steps=150, lr=2e-3, nodes=2, snr_every=10, eval_batches=8),
    "full": dict(model="full", batch=8, steps=2000, lr=6e-4, nodes=2, snr_every=50, eval_batches=16),
}
MODES = {
    "baseline": dict(weights="bf16", grads="bf16"),
    "sdp4bit": dict(weights="qwd", grads="tlq", hadamard=True),
    "sdp4bit_no_hadamard": dict(weights="qwd", grads="tlq", hadamard=False),
    "direct4": dict(weights="direct4", grads="bf16"),
}


def validate(cfg: dict, world_size: int) -> dict:
    out = resolve_preset(cfg, PRESETS)
    if world_size < 2:
        raise ValueError(f"world_size={world_size}: sharded data parallelism needs at least 2 ranks")
    require_positive_ints(out, "batch", "steps", "snr_every", "eval_batches")
    if not (isinstance(out["lr"], (int, float)) and math.isfinite(out["lr"]) and out["lr"] > 0):
        raise ValueError(f"lr must be a finite number > 0, got {out['lr']!r}")
    check_topology(world_size, out["nodes"])
    modes = out.get("modes", list(MODES))
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise ValueError(f"modes={modes!r}: allowed values are {list(MODES)}")
    out["modes"] = modes
    for m in modes:
        SDPConfig(**MODES[m], nodes=out["nodes"]).validate(world_size)
    return out





def _replicas_identical(ctx, replica: torch.Tensor) -> bool:
    """All-gather every rank's full replica and compare bit for bit (a check, tagged apart)."""
    with ctx.ledger.tag("check"):
        rows = replica.new_empty(ctx.world_size * replica.numel())
        dist.all_gather_into_tensor(rows, replica)
    rows = rows.view(ctx.world_size, -1).view(torch.int32)
    return bool((rows == rows[0]).all())


def _train(ctx, model0: GPT, cfg: dict, mode: str, topo) -> dict:
    model = copy.deepcopy(model0)
    sdp = ShardedDP(model, SDPConfig(**MODES[mode], nodes=cfg["nodes"]), topo, lr=cfg["lr"])
    led, seq = ctx.ledger, model.cfg.seq_len
    out = {"loss": [], "grad_snr_db": [], "weight_snr_db": [], "snr_steps": []}
    for step, (x, y) in enumerate(batches(cfg["batch"], seq, cfg["steps"], seed=1, rank=ctx.rank,
                                          world=ctx.world_size, device=ctx.device)):
        sdp.zero_grad()
        loss = model(x, y)
        loss.backward()
        with led.tag(f"{mode}:grads"):
            shard_grad = sdp.reduce_scatter(step)
        if step % cfg["snr_every"] == 0:  # against the exact fp32 mean, sent apart under its own tag
            with led.tag("check"):
                exact = reduce_scatter_fp32(sdp.grad)
            out["snr_steps"].append(step)
            out["grad_snr_db"].append(qsnr_db(exact, shard_grad))
        sdp.apply(shard_grad)
        with led.tag(f"{mode}:weights"):
            sdp.gather_weights()
        if out["snr_steps"] and out["snr_steps"][-1] == step:
            out["weight_snr_db"].append(qsnr_db(sdp.master, sdp.replica[sdp.shard]))
        out["loss"].append(ctx.mean_over_ranks(loss))
        ctx.progress(step + 1, cfg["steps"], mode)
    out["replicas_identical"] = _replicas_identical(ctx, sdp.replica)
    out["eval_loss"] = held_out_loss(model, cfg["batch"], cfg["eval_batches"])
    out["padded_numel"] = sdp.padded
    for phase in ("grads", "weights"):
        tag = f"{mode}:{phase}"
        out[f"{phase}_bytes_per_step"] = led.total("sent_bytes", tag=tag) // cfg["steps"]
        out[f"{phase}_bytes_by_link"] = {row["group"]: row["sent_bytes"] // cfg["steps"]
                                         for row in led.summary(("tag", "group")) if row["tag"] == tag}
    return out


def _static_snr(ctx, model0: GPT, cfg: dict, topo) -> dict:
    """SNR (dB) of each path on one and the same gradient: rank 0's local grad and the reduce-scattered mean."""
    model = copy.deepcopy(model0)
    x, y = next(batches(cfg["batch"], model.cfg.seq_len, 1, seed=3, rank=ctx.rank, world=ctx.world_size,
                        device=ctx.device))
    model(x, y).backward()
    g = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    unit = ctx.world_size * 2048
    g = torch.cat([g, g.new_zeros(-g.numel() % unit)])
    local = {}
    for bits in (8, 4):
        for rot in (False, True):
            v = hadamard32(g) if rot else g
            q = dequantize_blockwise(quantize_blockwise(v, bits=bits, block=128))
            local[f"int{bits}{' + H32' if rot else ''}"] = qsnr_db(v, q)  # H is orthogonal up to √32: same SNR
    gen = torch.Generator().manual_seed(900 + ctx.rank)  # heavy tails: Student t, 2 degrees of freedom
    t2 = (torch.randn(g.numel(), generator=gen) / (-torch.rand(g.numel(), generator=gen).log()).sqrt()).to(g.device)
    out = {"local_fake_quant": local}
    for name, grad in (("real gradient", g), ("synthetic t(2)", t2)):
        with ctx.ledger.tag("check"):
            exact = reduce_scatter_fp32(grad)
            paths = {"bf16": reduce_scatter_bf16(grad, topo),
                     "TLq": reduce_scatter_tlq(grad, topo, hadamard=False, seed=7 + 2 * ctx.rank),
                     "TLq-HS": reduce_scatter_tlq(grad, topo, hadamard=True, seed=7 + 2 * ctx.rank)}
        out[name] = {k: qsnr_db(exact, v) for k, v in paths.items()}
    return out


def run(ctx, cfg: dict) -> dict:
    cfg = cfg if "modes" in cfg else validate(cfg, ctx.world_size)
    topo = make_topology(cfg["nodes"], ctx.ledger)
    torch.manual_seed(0)
    model0 = GPT(preset(cfg["model"])).to(ctx.device)
    runs = {mode: _train(ctx, model0, cfg, mode, topo) for mode in cfg["modes"]}
    return {"cfg": cfg, "world_size": ctx.world_size, "nodes": topo.nodes, "local": topo.local,
            "n_params": count_params(model0), "runs": runs, "snr": _static_snr(ctx, model0, cfg, topo),
            "ledger": ctx.ledger.summary()}


# ---- invariants on random tensors (the tests launch this) -------------------------------------------

def invariants(ctx, cfg: dict) -> dict:
    """H·H = 32·I; quantization off == plain reduce-scatter / all-gather; qWD replicas bitwise equal."""
    nodes = cfg.get("nodes", 2)
    topo = make_topology(nodes, ctx.ledger)
    W, S = ctx.world_size, cfg.get("shard", 4096)
    gen = torch.Generator().manual_seed(50 + ctx.rank)
    out = {}

    H = hadamard32(torch.eye(32))
    out["hadamard_squared_is_32I"] = bool(torch.equal(H @ H, 32 * torch.eye(32)))

    g = torch.randn(W * S, generator=gen) * torch.rand(W * S, generator=gen).pow(4) * 10  # heavy-ish tails
    exact = reduce_scatter_fp32(g)
    off = Codec(None)
    plain_2level = reduce_scatter_tlq(g, topo, off, off, hadamard=False)
    rot_2level = reduce_scatter_tlq(g, topo, off, off, hadamard=True)
    out["off_rs_bitwise"] = bool(torch.equal(plain_2level, exact))
    out["off_rs_max_rel_err"] = ((plain_2level - exact).abs().max() / exact.abs().max()).item()
    out["off_rs_hadamard_max_rel_err"] = ((rot_2level - exact).abs().max() / exact.abs().max()).item()
    tlq_h = reduce_scatter_tlq(g, topo, hadamard=True, seed=11 + 2 * ctx.rank)
    tlq = reduce_scatter_tlq(g, topo, hadamard=False, seed=11 + 2 * ctx.rank)
    out["tlq_snr_db"], out["tlq_hadamard_snr_db"] = qsnr_db(exact, tlq), qsnr_db(exact, tlq_h)

    # weights: random walk of every owner's master shard, replica updated by qWD each step
    torch.manual_seed(1234)  # same initial replica everywhere
    replica = (torch.randn(W * S) * 0.02).bfloat16().float()
    master = replica[ctx.rank * S:(ctx.rank + 1) * S].clone()
    identical, worst = [], []
    for _ in range(cfg.get("qwd_steps", 5)):
        master += torch.randn(S, generator=gen) * 1e-3
        all_gather_qwd(replica, master)
        identical.append(_replicas_identical(ctx, replica))
        worst.append((replica[ctx.rank * S:(ctx.rank + 1) * S] - master).abs().max().item())
    out["qwd_replicas_identical"], out["qwd_max_abs_err"] = identical, worst

    # quantization off on the weight path: replica + (master - replica) vs the plain fp32 all-gather
    replica_off = replica.clone()
    all_gather_qwd(replica_off, master, codec=off, round_to=None)
    plain = all_gather_direct(torch.empty_like(replica), master, None, None)
    # W + (M − W) rounds twice; measured in ulps of the larger operand it is off by at most one
    ulp = torch.finfo(torch.float32).eps * torch.maximum(replica.abs(), plain.abs()).clamp_min(1e-30)
    out["off_ag_bitwise"] = bool(torch.equal(replica_off, plain))
    out["off_ag_max_ulps"] = ((replica_off - plain).abs() / ulp).max().item()

    # bad gradients are refused before anything is sent (every rank raises: no rank waits in a collective)
    sdp = ShardedDP(torch.nn.Linear(8, 8), SDPConfig(nodes=nodes), topo, lr=1e-3)
    sdp.grad.fill_(float("nan"))
    try:
        sdp.reduce_scatter(0)
        out["nan_error"] = None
    except ValueError as exc:
        out["nan_error"] = str(exc)
    return out
