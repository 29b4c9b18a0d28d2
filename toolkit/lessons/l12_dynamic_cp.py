"""Lesson 12, per rank: static vs dynamic context parallelism on one global batch of real-length documents.

    every rank   loads batch sequences (lengths of the corpus's real documents / length_scale, truncated to
                 static_cp·cap, padded to a multiple of 2·world_size), all-gathers the lengths
    plans        static CP (cp = static_cp, dp = world / static_cp, packs in data order), dynamic CP with
                 Megatron's rules as they are (schedule_dynamic without a cost model) and the toolkit's dynamic
                 CP (schedule_dynamic with ``cost_model``: refill and merge where the modelled time, ring
                 included, says they pay; Megatron's plan where they add up to no shorter a step), identical
                 on every rank
    reroute      each plan's shards to their ranks, one all_to_all_single per plan
    checked step forward/backward of the tiny GPT over each plan's micro-batches (ring attention inside every
                 CP group), ring bytes by direction (ledger), gradients summed over the ranks; the reference is
                 every sequence alone through the same model (each rank its own sequences, summed)
    timed        the three steps side by side (toolkit.runtime.bench.compare)
    selfcheck    ring attention on random packed sequences over the whole world, against one-process attention

On an emulated cluster (``launch(..., cluster=)``) the checked and timed steps run workload-matched
(``dcp_sim.stretch_scales``): every length and width of the toy times r = 5120 / d_model, i.e. the layers of
Llama-13B on sequences r times as long, so the timed steps' virtual times are that step on the cluster's GPUs,
ring attention's sends and receives on its links. The toolkit's scheduler plans for that cluster and workload.

    true shapes  (``true_shapes``, in the notebook's process; ``l12_true_shapes``) the blog's own setting, Llama-13B,
                 PP8 x 8, full recompute, the corpus's lengths at full scale: the layer this lesson runs traced at
                 its true shapes on fake tensors, the plans' steps simulated from those traces.
"""
from __future__ import annotations

import contextlib
from dataclasses import replace

import torch
import torch.distributed as dist

from toolkit.context import dcp_sim
from toolkit.context import ring_attention as ra
from toolkit.context.dcp_sim import corpus_lengths
from toolkit.context.dynamic_cp import (Plan, cp_size_for, pad_length, prebuilt_groups, reroute, schedule_dynamic,
                                        schedule_static)
from toolkit.data import corpus
from toolkit.lessons.l12_true_shapes import true_shapes  # noqa: F401 (the lesson's true_shapes)
from toolkit.models import GPT, GPTConfig, preset
from toolkit.runtime import compat
from toolkit.runtime.bench import compare, replayed
from toolkit.runtime.cluster import Cluster, cluster
from toolkit.runtime.config import Param, common, require_ranks, resolve

WORLD_SIZE = 4  # the generated bad-input tests validate at this world size
PARAMS = {**common("model", "n_layer", "batch", "seed", "warmup", "bench_steps", "rounds"),
          "cap": Param(int, "tokens per rank per micro-batch (Megatron's max_seqlen_per_dp_cp_rank)", ge=8),
          "static_cp": Param(int, "CP size of the static baseline: a power of two dividing world_size", ge=1),
          "min_cp": Param(int, "smallest CP size the dynamic scheduler gives a sequence (a power of two)", ge=1),
          "length_scale": Param(int, "the corpus's document lengths are divided by this (the tail stays)", ge=1),
          "lengths": Param(list, "explicit sequence lengths (tokens) instead of the corpus's; None = corpus",
                           of=int, ge=1, nullable=True)}
PRESETS = {
    "smoke": {"model": "smoke", "n_layer": 2, "batch": 6, "seed": 0, "warmup": 0, "bench_steps": 1, "rounds": 2,
              "cap": 128, "static_cp": 2, "min_cp": 1, "length_scale": 128, "lengths": None},
    "default": {"model": "default", "n_layer": 2, "batch": 12, "seed": 0, "warmup": 0, "bench_steps": 1, "rounds": 2,
                "cap": 256, "static_cp": 2, "min_cp": 1, "length_scale": 128, "lengths": None},
    "full": {"model": "full", "n_layer": 12, "batch": 64, "seed": 0, "warmup": 2, "bench_steps": 3, "rounds": 5,
             "cap": 4096, "static_cp": 4, "min_cp": 1, "length_scale": 2, "lengths": None},
}
PHASES = [("plan", 1), ("reference", 1), ("checked", 3), ("timing", 4), ("selfcheck", 1)]
LOSS_RTOL = 1e-5  # fp32: packing, sharding and the ring only reorder additions
GRAD_ATOL = 1e-5


def _power_of_two(name: str, value: int, why: str) -> None:
    if value & (value - 1):
        raise ValueError(f"{name}={value} must be a power of two (1, 2, 4, ...): {why}")


def validate(cfg: dict, world_size: int) -> dict:
    cfg = resolve(cfg, PRESETS, PARAMS)
    require_ranks(world_size, 2, "context parallelism")
    _power_of_two("world_size", world_size, "CP groups are aligned power-of-two blocks of the DP x CP ranks")
    _power_of_two("static_cp", cfg["static_cp"], "a CP group is a power-of-two block of ranks")
    _power_of_two("min_cp", cfg["min_cp"], "CP sizes are powers of two")
    if cfg["static_cp"] > world_size:
        raise ValueError(f"static_cp={cfg['static_cp']} must divide world_size={world_size}")
    if cfg["min_cp"] > world_size:
        raise ValueError(f"min_cp={cfg['min_cp']} must be <= world_size={world_size}")
    if cfg["cap"] % (2 * world_size):
        raise ValueError(f"cap={cfg['cap']} must be a multiple of 2*world_size={2 * world_size} (sequences are "
                         f"padded to that so that any CP size can cut them into 2*cp chunks)")
    limit = cfg["static_cp"] * cfg["cap"]
    if cfg["lengths"] is not None:
        if len(cfg["lengths"]) % world_size:
            raise ValueError(f"lengths has {len(cfg['lengths'])} sequences; it must be a multiple of "
                             f"world_size={world_size} (each rank loads an equal share)")
        for i, n in enumerate(cfg["lengths"]):
            if pad_length(n, 2 * world_size) > limit:
                raise ValueError(f"lengths[{i}]={n}: longer than the CP cap static_cp*cap = {cfg['static_cp']}*"
                                 f"{cfg['cap']} = {limit} tokens (after padding to a multiple of {2 * world_size})")
    model_config(cfg)  # a valid model shape
    return cfg


def global_lengths(cfg: dict, world_size: int) -> list[int]:
    """The real (unpadded) lengths of the step's global batch: ``cfg["lengths"]`` or ``batch x world_size``
    corpus document lengths / length_scale, truncated so that padding keeps them within static_cp·cap."""
    if cfg["lengths"] is not None:
        return list(cfg["lengths"])
    limit = cfg["static_cp"] * cfg["cap"]
    return corpus_lengths(cfg["batch"] * world_size, limit, seed=cfg["seed"], scale=cfg["length_scale"])


def sample_rows(sid: int, length: int, padded: int, seed: int) -> torch.Tensor:
    """Sample ``sid``: ``[padded, 2]`` (input token, target) from a seeded window of the corpus; positions from
    ``length`` on are padding (token 0, target ignored)."""
    tokens = corpus()
    gen = torch.Generator().manual_seed(seed * 1_000_003 + sid)
    start = int(torch.randint(0, tokens.numel() - length - 1, (1,), generator=gen))
    rows = torch.zeros(padded, 2, dtype=torch.long)
    rows[:, 1] = ra.IGNORE
    rows[:length, 0] = tokens[start:start + length]
    rows[:length, 1] = tokens[start + 1:start + length + 1]
    return rows


SCHEDULER_CLUSTER = "h100-ib400"
"""The cluster the toolkit's scheduler plans for when the run has no emulated one."""


def model_config(cfg: dict) -> GPTConfig:
    """The tiny GPT of a resolved ``cfg``: its preset with ``n_layer``, positions up to static_cp·cap."""
    return preset(cfg["model"], n_layer=cfg["n_layer"], seq_len=cfg["static_cp"] * cfg["cap"])


def scheduler_cluster(spec: str | Cluster | None) -> Cluster:
    """The cluster the toolkit's scheduler plans for: the run's emulated cluster (a preset name or a
    ``Cluster``), else ``SCHEDULER_CLUSTER``."""
    return cluster(SCHEDULER_CLUSTER if spec in (None, "none") else spec)


def cost_model(model_cfg: GPTConfig, hw: Cluster) -> dcp_sim.CostModel:
    """The toolkit scheduler's cost of a CP group in this run: ``dcp_sim``'s model of the toy's layers and output
    layer timed as Llama-13B's at r = 5120 / d_model times the lengths (the workload-matched run: the output
    layer's vocabulary r times the toy's), every kernel at ``hw``'s achieved rates as the emulated cluster times
    them, no recompute (the lesson recomputes nothing)."""
    r = dcp_sim.stretch_scales(model_cfg.d_model)["scale"]
    shape = replace(dcp_sim.LLAMA_13B, vocab=round(model_cfg.vocab_size * r))
    return dcp_sim.CostModel(shape, hw, model_cfg.n_layer, recompute=False, scale=r, output_layer=True)


def predicted(result: dict) -> dict[str, dict]:
    """The cost model's step (``dcp_sim.step_time`` with pp = 1: ``step_s`` and its parts, seconds) of each plan of
    a run, on the cluster its scheduler planned for: what the emulated run's virtual step is compared with."""
    hw = Cluster.from_dict(result["scheduler"]["cluster"])
    model = cost_model(GPTConfig(**result["model"]), hw)
    shape = replace(model.shape, layers=model.layers)
    return {k: dcp_sim.step_time(p, shape, hw, 1, False, model.scale, output_layer=True)
            for k, p in plans_of(result).items()}


def _flat_grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def run(ctx, cfg: dict) -> dict:
    world, rank = ctx.world_size, ctx.rank
    real = global_lengths(cfg, world)
    share = len(real) // world
    owner = [s // share for s in range(len(real))]
    mine = range(rank * share, (rank + 1) * share)

    # -- every rank loads its share, then all-gathers the lengths (the scheduler needs the global batch)
    dev = ctx.device
    ctx.phase("plan")
    local = torch.tensor([[real[s], pad_length(real[s], 2 * world)] for s in mine], dtype=torch.long, device=dev)
    gathered = torch.empty(world * share * 2, dtype=torch.long, device=dev)
    with ctx.ledger.tag("gather-lengths"):
        compat.all_gather_single(gathered, local.reshape(-1))
    real_g, padded = gathered.view(-1, 2)[:, 0].tolist(), gathered.view(-1, 2)[:, 1].tolist()
    samples = {s: sample_rows(s, real_g[s], padded[s], cfg["seed"]).to(dev) for s in mine}
    n_tokens = sum(real_g)

    model_cfg = model_config(cfg)
    emu = ctx.emulator
    hw = scheduler_cluster(emu.cluster if emu is not None else None)
    cost = cost_model(model_cfg, hw)
    plans = {"static": schedule_static(padded, world, cfg["static_cp"], cfg["cap"]),
             "dynamic-megatron": schedule_dynamic(padded, world, cfg["cap"], cfg["min_cp"]),
             "dynamic": schedule_dynamic(padded, world, cfg["cap"], cfg["min_cp"], cost=cost)}
    for plan in plans.values():
        plan.check()
    groups = prebuilt_groups(world)
    for (size, start), grp in groups.items():
        ctx.ledger.name_group(grp, f"cp{size}")
    shards = {}
    for name, plan in plans.items():
        with ctx.ledger.tag(f"reroute:{name}"):
            shards[name] = reroute(plan, owner, samples, rank)

    torch.manual_seed(cfg["seed"])
    model = GPT(model_cfg).to(dev)
    scales = dcp_sim.stretch_scales(model_cfg.d_model)

    def matched():
        """The measured steps on the emulated cluster: the toy's ops timed as Llama-13B's (lengths, widths x r)."""
        return emu.scaled(flops=scales["flops"], bytes=scales["bytes"]) if emu is not None else contextlib.nullcontext()

    def step(name: str, record: bool = False) -> float:
        """Forward and backward over every micro-batch of the plan; returns this rank's summed loss."""
        model.zero_grad(set_to_none=True)
        total = 0.0
        for i, mb in enumerate(shards[name]):
            group = groups.get(mb["key"])
            tokens, targets = mb["rows"][:, 0], mb["rows"][:, 1]
            with ctx.timeline.span(name, mb=i, cp=mb["key"][0]) if record else contextlib.nullcontext():
                with ctx.ledger.tag(f"ring-forward:{name}" if record else "bench"):
                    loss = ra.gpt_shard_loss(model, tokens, targets, mb["positions"], mb["layout"], group)
                with ctx.ledger.tag(f"ring-backward:{name}" if record else "bench"):
                    (loss / n_tokens).backward()
            total += loss.item()
        return total

    # -- the reference: each of my sequences alone, unpacked, through the same model; summed over ranks
    ctx.phase("reference")
    model.zero_grad(set_to_none=True)
    ref_sum = 0.0
    for i, s in enumerate(mine):
        ctx.progress(i, share)
        rows = samples[s][:real_g[s]]
        loss = ra.gpt_sequence_loss(model, rows[:, 0], rows[:, 1])
        (loss / n_tokens).backward()
        ref_sum += loss.item()
    ref = torch.cat([_flat_grads(model), torch.tensor([ref_sum], device=dev)])
    with ctx.ledger.tag("metrics"):
        dist.all_reduce(ref)
    checked = {"reference": {"loss_per_token": ref[-1].item() / n_tokens}}
    ctx.phase("checked")
    attention_flops = {}
    for k, name in enumerate(plans):
        ctx.progress(k, len(plans), name)
        ctx.barrier()
        before = _fused_attention_flops(emu)
        with matched():
            total = step(name, record=True)
        attention_flops[name] = _fused_attention_flops(emu) - before
        flat = torch.cat([_flat_grads(model), torch.tensor([total], device=dev)])
        with ctx.ledger.tag("grads"):
            dist.all_reduce(flat)  # the DP x CP gradient sum (every rank holds the whole model)
        checked[name] = {"loss_per_token": flat[-1].item() / n_tokens,
                         "max_grad_diff": (flat[:-1] - ref[:-1]).abs().max().item(),
                         "max_grad": ref[:-1].abs().max().item()}

    ring = {}
    for name, plan in plans.items():
        closed = plan.ring_bytes(model_cfg.d_model, 4, model_cfg.n_layer)[rank]
        ring[name] = {d: {"ledger": ctx.ledger.total("sent_bytes", tag=f"ring-{d}:{name}"), "closed_form": closed[d]}
                      for d in ("forward", "backward")}
    ctx.phase("timing")
    if emu is not None:
        ctx.reserve_for_replay()  # the phase's last quarter: the run replayed on other figures
    with matched():  # wall times as they are; the virtual ones beside them are the matched workload's
        bench = compare({name: (lambda name=name: step(name)) for name in plans}, warmup=cfg["warmup"],
                        steps=cfg["bench_steps"], rounds=cfg["rounds"], sync=ctx.barrier, on_round=ctx.progress,
                        label="timing")
    sensitivity = None if emu is None else ctx.replay(
        lambda clocks: {name: replayed(clocks, f"timing/{name}") for name in plans})
    ctx.phase("selfcheck")
    selfcheck = ring_selfcheck(ctx, [8 * world, 2 * world, 12 * world], cfg["seed"])
    return {"rank": rank, "world": world, "cfg": cfg, "model": vars(model_cfg), "n_tokens": n_tokens,
            "lengths": real_g, "padded": padded, "plans": {k: p.to_json() for k, p in plans.items()},
            "need": [cp_size_for(n, cfg["cap"], cfg["min_cp"]) for n in padded],
            "checked": checked, "tolerances": {"loss_rtol": LOSS_RTOL, "grad_atol": GRAD_ATOL}, "ring_bytes": ring,
            "reroute_bytes": {k: ctx.ledger.total("sent_bytes", tag=f"reroute:{k}") for k in plans},
            "gather_bytes": ctx.ledger.total("sent_bytes", tag="gather-lengths"),
            "tokens_per_mb": {k: [len(mb["rows"]) for mb in shards[k]] for k in plans},
            "bench": {k: v.to_dict() for k, v in bench.items()}, "sensitivity": sensitivity,
            "spans": [s for s in ctx.timeline.to_json() if s["kind"] in plans], "selfcheck": selfcheck,
            "scheduler": {"cluster": hw.to_dict(), "scale": scales["scale"], "stands_for": dcp_sim.LLAMA_13B.name},
            "emulated": None if emu is None else {
                "cluster": emu.cluster.name, "gpu": emu.cluster.gpu.name, "link": emu.cluster.intra.name,
                "scales": scales, "attention_flops": attention_flops,
                "ring_link_s": {k: {d: emu.link_busy(f"ring-{d}:{k}") for d in ("forward", "backward")}
                                for k in plans}}}


def _fused_attention_flops(emu) -> float:
    """FLOPs the emulated cluster charged so far to ring attention's fused blocks (0 without one)."""
    if emu is None:
        return 0.0
    return sum(row["flops"] for name, row in emu.ops.items() if name.startswith("ring attention block (fused)"))


def ring_selfcheck(ctx, lengths: list[int], seed: int, heads: int = 2, head_dim: int = 8) -> dict:
    """Every rank, the whole world one CP group: ring attention on random packed sequences (``lengths``, each a
    multiple of 2·world) against ``packed_causal_attention`` in one process, forward and backward (fp32), and
    the bytes it sent. Returns max absolute differences (out, dq, dk, dv), ledger bytes per direction and the
    closed form (``ring_bytes``)."""
    cp, dtype = ctx.world_size, torch.float32
    gen = torch.Generator().manual_seed(seed)  # the same full tensors on every rank
    n = sum(lengths)
    dev = ctx.device
    full = [torch.randn(heads, n, head_dim, generator=gen, dtype=dtype).to(dev).requires_grad_() for _ in range(3)]
    grad_out = torch.randn(heads, n, head_dim, generator=gen, dtype=dtype).to(dev)
    ref = ra.packed_causal_attention(*full, lengths)
    ref_grads = torch.autograd.grad(ref, full, grad_out)
    layout = ra.CPLayout(lengths, cp)
    idx = layout.coords(dist.get_rank() if cp > 1 else 0, dev)[2]
    mine = [x.detach()[:, idx].clone().requires_grad_() for x in full]
    group = dist.group.WORLD if cp > 1 else None
    with ctx.ledger.tag("ring-forward"):
        out = ra.ring_attention(*mine, layout, group)
    with ctx.ledger.tag("ring-backward"):
        out.backward(grad_out[:, idx])
    diff = {"out": (out.detach() - ref.detach()[:, idx]).abs().max().item()}
    for name, x, g in zip(("dq", "dk", "dv"), mine, ref_grads):
        diff[name] = (x.grad - g[:, idx]).abs().max().item()
    sent = {d: ctx.ledger.total("sent_bytes", tag=f"ring-{d}") for d in ("forward", "backward")}
    return {"rank": ctx.rank, "cp": cp, "lengths": lengths, "tokens_per_rank": layout.tokens_per_rank,
            "max_abs_diff": diff, "sent_bytes": sent,
            "closed_form": ra.ring_bytes(layout.tokens_per_rank, heads * head_dim, cp, full[0].element_size())}


def plans_of(result: dict) -> dict[str, Plan]:
    """The plans a run returned, as ``Plan`` objects."""
    return {k: Plan.from_json(v) for k, v in result["plans"].items()}
