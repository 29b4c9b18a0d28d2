"""Lesson 00's parallelism sections, per rank: each technique of ``toolkit.parallel`` beside its reference.

    data_parallel    DDP vs the toolkit's ZeRO-0/1/2/3 vs FSDP2 (``DataParallelTrainer``): losses, bytes/step,
                     memory/rank, each against its closed form
    zero3_prefetch   ZeRO-3 with and without prefetching the next unit's all-gather: timelines, exposed wait
    tensor_parallel  Megatron column/row-parallel block vs one process vs torch's parallelize_module

``l00_foundations`` runs them with its other sections; its ``PARAMS`` and ``PRESETS`` include these, and
its ``validate`` calls ``check`` for the sections it runs. Each section takes the lesson's cfg and the GPT
(``model_config(cfg)``, or any ``GPTConfig``: the tests pass odd sizes)::

    cfg = validate({"preset": "smoke"}, world_size)        # before any process starts
    data_parallel(ctx, cfg, model_config(cfg))              # on every rank

Bytes come from ``ctx.ledger`` (sent bytes per rank, the ledger's ring convention), memory from the
storages the tensors live in, step times from ``toolkit.runtime.bench``.
"""
from __future__ import annotations

import copy
import functools
import gc
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.nn as nn

from toolkit.data import batches
from toolkit.models import GPT, GPTConfig, preset
from toolkit.parallel.tensor import check_tp, qkv_rows, tensor_parallel_block
from toolkit.parallel.trainer import DataParallelTrainer
from toolkit.parallel.zero import ZeroDataParallel, adamw
from toolkit.runtime.bench import compare, measure
from toolkit.runtime.config import Param, common, require_ranks, resolve
from toolkit.runtime.memory import MemoryTracker
from toolkit.runtime.timeline import Timeline

SECTIONS = ("data_parallel", "zero3_prefetch", "tensor_parallel")
DP_VARIANTS = {"ddp": {"kind": "ddp"}, "zero0": {"kind": "zero", "stage": 0}, "zero1": {"kind": "zero", "stage": 1},
               "zero2": {"kind": "zero", "stage": 2}, "zero3": {"kind": "zero", "stage": 3},
               "fsdp2": {"kind": "fsdp2", "reshard": True}, "fsdp2_keep": {"kind": "fsdp2", "reshard": False}}
"""variant -> ``DataParallelTrainer`` arguments ("fsdp2_keep": FSDP2 with ``reshard_after_forward=False``)."""
PREFETCH_STEPS = 2
"""Steps both ZeRO-3 variants train (their losses and parameters compared bit for bit) before the recorded one."""

PARAMS = {
    **common("model", "n_layer", "seq_len", "batch", "lr", "seed", "warmup", "bench_steps", "rounds"),
    "dp_steps": Param(int, "training steps of each data-parallel variant (DDP, ZeRO, FSDP2)", ge=2),
    "dp_variants": Param(list, "data-parallel variants trained side by side (DDP, when in, is the reference)",
                         of=str, choices=tuple(DP_VARIANTS)),
    "dp_timing": Param(list, "data-parallel variants whose step time is measured", of=str,
                       choices=tuple(DP_VARIANTS), nonempty=False),
}
_SHARED = {"lr": 1e-3, "seed": 0, "dp_variants": list(DP_VARIANTS)}
PRESETS = {
    "smoke": {"model": "smoke", "n_layer": 2, "seq_len": 32, "batch": 4, "dp_steps": 3,
              "dp_timing": ["ddp", "zero3", "fsdp2"], "warmup": 1, "bench_steps": 3, "rounds": 3, **_SHARED},
    "default": {"model": "default", "n_layer": 2, "seq_len": 64, "batch": 8, "dp_steps": 3,
                "dp_timing": ["zero3", "fsdp2"], "warmup": 2, "bench_steps": 4, "rounds": 5, **_SHARED},
    "full": {"model": "full", "n_layer": 12, "seq_len": 1024, "batch": 8, "dp_steps": 10,
             "dp_timing": list(DP_VARIANTS), "warmup": 10, "bench_steps": 50, "rounds": 5, **_SHARED},
}


def model_config(cfg: dict) -> GPTConfig:
    """The GPT of ``cfg``: the ``model`` preset with ``n_layer`` and ``seq_len``."""
    return preset(cfg["model"], n_layer=cfg["n_layer"], seq_len=cfg["seq_len"])


def validate(cfg: dict, world_size: int) -> dict:
    """``resolve`` against this module's table, then ``check`` every section. Runs before any process starts."""
    return check(resolve(cfg, PRESETS, PARAMS), world_size, SECTIONS)


def check(cfg: dict, world_size: int, sections) -> dict:
    """The cross-checks of ``sections`` on a resolved ``cfg``; ValueError naming the parameter."""
    require_ranks(world_size, 2, "data and tensor parallelism")
    if "data_parallel" in sections:
        untimed = [v for v in cfg["dp_timing"] if v not in cfg["dp_variants"]]
        if untimed:
            raise ValueError(f"dp_timing={cfg['dp_timing']!r}: {untimed} not among dp_variants={cfg['dp_variants']!r}")
        cfg["dp_variants"] = [v for v in DP_VARIANTS if v in cfg["dp_variants"]]  # "ddp" first: the reference
    if "tensor_parallel" in sections:
        mc = model_config(cfg)
        check_tp(world_size, n_head=mc.n_head, d_ff=mc.d_ff)
    return cfg


def _per_step(ledger, tag: str, steps: int, field: str = "sent_bytes") -> dict[str, float]:
    out: dict[str, float] = defaultdict(int)
    for r in ledger.records:
        if r.tag == tag:
            out[r.op] += 1 if field == "calls" else getattr(r, field)
    return {op: v / steps if v % steps else v // steps for op, v in sorted(out.items())}


# ---- data parallel: DDP, ZeRO 0-3, FSDP2 ------------------------------------------------------------

def data_parallel(ctx, cfg: dict, model_cfg: GPTConfig) -> dict:
    """Train the GPT with every variant of ``dp_variants`` side by side on the same data; measure each.

    cfg (``PARAMS``): ``dp_steps``, ``batch`` per rank, ``lr``, ``seed``, ``dp_variants`` (run in
    ``DP_VARIANTS`` order: "ddp" is torch's DistributedDataParallel, "zero0".."zero3" the toolkit's
    ZeroDataParallel, "fsdp2" ``fully_shard`` per unit, "fsdp2_keep" the same with
    ``reshard_after_forward=False``), ``dp_timing`` (the variants whose step time is measured with
    ``warmup``, ``bench_steps``, ``rounds``). Data parallel over all ranks.

    Returns (per rank; v = variant name, op = ledger op name):
        ``world_size``, ``steps``, ``variants``: the run.
        ``numel``: Ψ, parameters of the model. ``embed_numel``: parameters of the embedding unit.
        ``loss[v]``: list of this rank's micro-batch loss at each step.
        ``max_abs_diff_vs_ddp[v]``: max |p - p_ddp| over all parameters after the steps (0.0 = bitwise;
            present when "ddp" is among the variants).
        ``bytes_per_step[v]``: bytes this rank sent per step (ledger), all ops.
        ``bytes_per_step_by_op[v][op]``, ``calls_per_step_by_op[v][op]``: the same split by op.
        ``bytes_closed_form[v][op]``: what the formulas predict (``DataParallelTrainer.closed_forms``).
        ``memory[v]``: {"params", "grads", "optim"} bytes at rest right after backward (distinct storages;
            AdamW's 0-dim step counters left out). ``memory_closed_form[v]``: the formulas' prediction.
        ``peak_memory[v]``: MemoryTracker over one whole step: {"param", "grad", "optim", "act", "comm", "host",
            "total"} bytes at the moment of the highest total; ``max_memory_by_category[v]``: each one's own max.
        ``step_time_s[v]``: trimmed mean step time (timed variants only); ``step_time_stability[v]``: std/mean.
    """
    steps, variants, timed = cfg["dp_steps"], cfg["dp_variants"], cfg["dp_timing"]
    timing = {"warmup": cfg["warmup"], "steps": cfg["bench_steps"], "rounds": cfg["rounds"]}
    optimizer = functools.partial(adamw, lr=float(cfg["lr"]))
    torch.manual_seed(cfg["seed"])
    base = GPT(model_cfg).to(ctx.device)
    data = [(x.to(ctx.device), y.to(ctx.device)) for x, y in batches(cfg["batch"], base.cfg.seq_len, steps + 1,
                                                                     seed=cfg["seed"], rank=ctx.rank,
                                                                     world=ctx.world_size)]
    work = len(variants) * (steps + 1) + len(timed) * (timing["warmup"] + timing["steps"] * timing["rounds"])
    out: dict = defaultdict(dict)
    out.update(world_size=ctx.world_size, steps=steps, variants=variants,
               numel=sum(p.numel() for p in base.parameters()),
               embed_numel=sum(p.numel() for p in base.embed.parameters()))
    reference, done = None, 0
    for name in variants:
        trainer = DataParallelTrainer(base=base, optimizer=optimizer, **DP_VARIANTS[name])
        losses = []
        with ctx.ledger.tag(name):
            for i, (x, y) in enumerate(data[:steps]):
                losses.append(trainer.fwd_bwd(x, y))
                if i == min(1, steps - 1):  # optimizer state exists from the second step on
                    mem = trainer.memory()
                trainer.step()
                done += 1
                ctx.progress(done, work, f"{name} step {i + 1}")
        with ctx.ledger.tag("check"):
            params = trainer.full_parameters()
        if name == "ddp":
            reference = params
        if reference is not None:
            out["max_abs_diff_vs_ddp"][name] = max((params[k] - reference[k]).abs().max().item() for k in reference)
        closed = trainer.closed_forms()
        out["loss"][name] = losses
        out["bytes_per_step_by_op"][name] = _per_step(ctx.ledger, name, steps)
        out["calls_per_step_by_op"][name] = _per_step(ctx.ledger, name, steps, "calls")
        out["bytes_per_step"][name] = sum(out["bytes_per_step_by_op"][name].values())
        out["bytes_closed_form"][name] = closed["bytes"]
        out["memory"][name], out["memory_closed_form"][name] = mem, closed["memory"]
        with ctx.ledger.tag(f"{name}/peak"), MemoryTracker(trainer.model, trainer.optimizer, every_op=False) as mt:
            trainer.fwd_bwd(*data[steps])
            trainer.step()
        out["peak_memory"][name], out["max_memory_by_category"][name] = dict(mt.peak), dict(mt.max_by_category)
        done += 1
        if name in timed:
            x, y = data[0]
            with ctx.ledger.tag(f"{name}/timing"):
                res = measure(lambda: (trainer.fwd_bwd(x, y), trainer.step()), **timing,
                              on_step=lambda d, t, base_done=done: ctx.progress(base_done + d, work, f"{name} timing"))
            done += timing["warmup"] + timing["steps"] * timing["rounds"]
            out["step_time_s"][name], out["step_time_stability"][name] = res.mean_s, res.throughput_stability
        del trainer, params
        gc.collect()  # DDP with a Python comm hook must be gone before the process group is destroyed
    return dict(out)


# ---- ZeRO-3 with and without prefetch ------------------------------------------------------------------

def zero3_prefetch(ctx, cfg: dict, model_cfg: GPTConfig) -> dict:
    """ZeRO-3 (``toolkit.parallel.zero``) with and without prefetching the next unit's all-gather, side by side.

    Both train ``steps`` steps from the same init on the same data (losses and parameters must agree bit for
    bit: prefetch changes *when* a gather is issued, not what it brings), then record one step each on a
    timeline aligned across ranks, then are timed round-robin (``toolkit.runtime.bench.compare``).

    cfg (``PARAMS``): ``batch``, ``lr``, ``seed``, ``warmup``, ``bench_steps``, ``rounds``; both train
    ``PREFETCH_STEPS`` steps. ``model_cfg``: the GPT.

    Returns (per rank; v = "no prefetch" | "prefetch"):
        ``units``: [{"name", "numel"}] in forward order. ``losses[v]``: this rank's loss at each step.
        ``bitwise_equal``: losses and full parameters of the two variants identical after ``steps`` steps.
        ``trace[v]``: ``ZeroDataParallel.trace`` of the recorded step (events in program order, this rank).
        ``spans[v]``: every rank's spans of the recorded step ("F", "B", "AG", "wait", "RS"; meta ``unit``).
        ``ledger_order[v]``: the recorded step's all-gathers as the ledger saw them: [(is_async, bytes)].
        ``wait_s_per_step[v]``: time blocked on gathers (exposed communication), mean over the timed steps.
        ``step_s[v]``, ``step_stability[v]``: trimmed mean step time and std/mean (``compare``); ``bench[v]``
        the whole result (its rounds, for ``bench.verdict``).
    """
    steps = PREFETCH_STEPS
    torch.manual_seed(cfg["seed"])
    base = GPT(model_cfg).to(ctx.device)
    data = [(x.to(ctx.device), y.to(ctx.device)) for x, y in batches(cfg["batch"], base.cfg.seq_len, steps + 1,
                                                                     seed=cfg["seed"], rank=ctx.rank,
                                                                     world=ctx.world_size)]
    names = {False: "no prefetch", True: "prefetch"}
    factory = lambda ps: adamw(ps, lr=float(cfg["lr"]))  # noqa: E731
    zdp = {names[pf]: ZeroDataParallel(copy.deepcopy(base), factory, stage=3, prefetch=pf) for pf in (False, True)}
    out: dict = defaultdict(dict)
    out["units"] = [{"name": type(u.module).__name__, "numel": u.numel} for u in zdp["prefetch"].units]

    def step(z: ZeroDataParallel, x, y) -> float:
        loss = z(x, y)
        loss.backward()
        z.step()
        return loss.item()

    for v, z in zdp.items():
        with ctx.ledger.tag(f"zero3/{v}"):
            out["losses"][v] = [step(z, x, y) for x, y in data[:steps]]
    with ctx.ledger.tag("check"):
        full = {v: z.full_parameters() for v, z in zdp.items()}
    out["bitwise_equal"] = (out["losses"]["prefetch"] == out["losses"]["no prefetch"]
                            and all(torch.equal(full["prefetch"][k], t) for k, t in full["no prefetch"].items()))
    ctx.progress(1, 3, "ZeRO-3 prefetch: trained")

    for v, z in zdp.items():  # one step on the timeline, clocks aligned by a barrier
        ctx.barrier()
        z.timeline, z.trace[:] = Timeline(ctx.rank), []
        first = len(ctx.ledger.records)
        with ctx.ledger.tag(f"zero3/{v}/recorded"):
            step(z, *data[steps])
        out["trace"][v] = [list(e) for e in z.trace]
        out["ledger_order"][v] = [[r.is_async, r.sent_bytes] for r in ctx.ledger.records[first:]
                                  if r.op == "all_gather_into_tensor"]
        gathered: list = [None] * ctx.world_size
        dist.all_gather_object(gathered, z.timeline.to_json())
        out["spans"][v] = [s for spans in gathered for s in spans]
    ctx.progress(2, 3, "ZeRO-3 prefetch: recorded")

    calls = {v: 0 for v in zdp}

    def timed(v: str):
        def run():
            calls[v] += 1
            step(zdp[v], *data[0])
        return run

    for z in zdp.values():
        z.timeline = Timeline(ctx.rank)
    with ctx.ledger.tag("zero3/timing"):
        res = compare({v: timed(v) for v in zdp}, warmup=cfg["warmup"], steps=cfg["bench_steps"],
                      rounds=cfg["rounds"], sync=ctx.barrier)
    for v, z in zdp.items():
        waits = sum(s.end - s.start for s in z.timeline.spans if s.kind == "wait")
        out["wait_s_per_step"][v] = waits / calls[v]
        out["step_s"][v], out["step_stability"][v] = res[v].mean_s, res[v].throughput_stability
        out["bench"][v] = res[v].to_dict()
        z.timeline = None
    ctx.progress(3, 3, "ZeRO-3 prefetch: timed")
    return dict(out)


# ---- tensor parallel ---------------------------------------------------------------------------------

def _torch_tp_block(block: nn.Module, group, device_type: str) -> nn.Module:
    """The same block sharded by torch's ``parallelize_module`` (DTensor) on the same weights."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    tp, d_model, n_head = dist.get_world_size(group), block.attn.proj.in_features, block.attn.core.n_head
    with torch.no_grad():  # ColwiseParallel cuts qkv rows contiguously: order them rank by rank, by heads
        order = torch.cat([qkv_rows(d_model, n_head, tp, r) for r in range(tp)])
        block.attn.qkv.weight.copy_(block.attn.qkv.weight[order])
        block.attn.qkv.bias.copy_(block.attn.qkv.bias[order])
    block.attn.core.n_head = n_head // tp
    mesh = DeviceMesh.from_group(group, device_type)
    return parallelize_module(block, mesh, {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(),
                                            "mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel()})


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.detach() - b.detach()).abs().max().item()


def tensor_parallel(ctx, cfg: dict, model_cfg: GPTConfig) -> dict:
    """One transformer block (and the whole tiny GPT) split over all ranks by tensor parallelism.

    The single-process block, this toolkit's Megatron-style TP block and torch's ``parallelize_module``
    block get the same weights, input x and output gradient dy (seeded identically on every rank).

    cfg (``PARAMS``): ``batch``, ``seed``; ``model_cfg``: the GPT. tp = world size.

    Returns (per rank):
        ``tp``; ``shape``: [B, T, D] of the activations.
        ``max_abs_diff``: {"toolkit_vs_single": {"y", "dx", "grads"}, "torch_vs_single": {"y", "dx"},
            "toolkit_vs_torch": {"y", "dx"}}: max |difference| of the block output, input gradient and
            (toolkit) every parameter gradient against the same slice of the single-process gradient.
        ``scale``: {"y", "dx", "grads"}: max |value| of the single-process results (for relative errors).
        ``bytes``: {"forward": {op: sent bytes}, "backward": {...}} from the ledger (toolkit block);
            ``payload``: the same as buffer bytes; ``calls``: the same as call counts.
        ``bytes_closed_form``: {"forward": int, "backward": int}: 2 all-reduces of B·T·D·4 bytes, each
            sending 2(n-1)/n of it; ``payload_closed_form``: 2·B·T·D·4 per pass.
        ``torch_comm_counts``: {"forward": {op: calls}, "backward": {...}} for parallelize_module, from
            ``CommDebugMode`` (DTensor's functional collectives bypass ``torch.distributed``'s functions,
            so the ledger cannot see them).
        ``param_numel``: {"single": block params, "tp": this rank's block params}.
        ``dp_grad_bytes_per_block``: for comparison, what data parallelism over the same ranks would send
            per step to all-reduce this block's gradients: 2(n-1)/n·4·(block params) (closed form).
        ``model``: {"loss_single", "loss_tp", "bytes_forward", "bytes_forward_closed_form", "n_layer"}: the
            whole GPT with every block tensor-parallel, one forward on a real batch.
    """
    from torch.distributed.tensor.debug import CommDebugMode
    seed, bs = cfg["seed"], cfg["batch"]
    group, n = dist.group.WORLD, ctx.world_size
    torch.manual_seed(seed)
    model = GPT(model_cfg).to(ctx.device)
    T, D = model.cfg.seq_len, model.cfg.d_model
    block = model.blocks[0]
    x = torch.randn(bs, T, D, device=ctx.device)  # [B,T,D], the same on every rank
    dy = torch.randn(bs, T, D, device=ctx.device)

    def run(b: nn.Module, tag: str):
        xi = x.clone().requires_grad_()
        with ctx.ledger.tag(f"{tag}/forward"):
            y = b(xi)
        with ctx.ledger.tag(f"{tag}/backward"):
            y.backward(dy)
        return y, xi.grad

    y_ref, dx_ref = run(block, "single")
    ours = tensor_parallel_block(copy.deepcopy(block), group)
    y_tp, dx_tp = run(ours, "tp")
    grads_as_params = copy.deepcopy(block)  # shard the reference gradients exactly as the weights were
    with torch.no_grad():
        for p, ref in zip(grads_as_params.parameters(), block.parameters()):
            p.copy_(ref.grad)
    grads_as_params = tensor_parallel_block(grads_as_params, group)
    grad_diff = max(_max_diff(p.grad, g) for p, g in zip(ours.parameters(), grads_as_params.parameters()))

    theirs = _torch_tp_block(copy.deepcopy(block), group, ctx.device.type)
    comm = {}
    xi = x.clone().requires_grad_()
    with CommDebugMode() as mode:
        y_pt = theirs(xi)
    comm["forward"] = {str(k).split(".")[-1]: v for k, v in mode.get_comm_counts().items()}
    with CommDebugMode() as mode:
        y_pt.backward(dy)
    comm["backward"] = {str(k).split(".")[-1]: v for k, v in mode.get_comm_counts().items()}
    dx_pt = xi.grad

    act = bs * T * D * 4
    out = {"tp": n, "shape": [bs, T, D],
           "max_abs_diff": {"toolkit_vs_single": {"y": _max_diff(y_tp, y_ref), "dx": _max_diff(dx_tp, dx_ref),
                                                  "grads": grad_diff},
                            "torch_vs_single": {"y": _max_diff(y_pt, y_ref), "dx": _max_diff(dx_pt, dx_ref)},
                            "toolkit_vs_torch": {"y": _max_diff(y_tp, y_pt), "dx": _max_diff(dx_tp, dx_pt)}},
           "scale": {"y": y_ref.abs().max().item(), "dx": dx_ref.abs().max().item(),
                     "grads": max(p.grad.abs().max().item() for p in block.parameters())},
           "bytes": {p: _per_step(ctx.ledger, f"tp/{p}", 1) for p in ("forward", "backward")},
           "payload": {p: _per_step(ctx.ledger, f"tp/{p}", 1, "payload_bytes") for p in ("forward", "backward")},
           "calls": {p: _per_step(ctx.ledger, f"tp/{p}", 1, "calls") for p in ("forward", "backward")},
           "bytes_closed_form": {p: 2 * (2 * (n - 1) * act // n) for p in ("forward", "backward")},
           "payload_closed_form": {p: 2 * act for p in ("forward", "backward")},
           "torch_comm_counts": comm,
           "param_numel": {"single": sum(p.numel() for p in block.parameters()),
                           "tp": sum(p.numel() for p in ours.parameters())}}
    out["dp_grad_bytes_per_block"] = 2 * (n - 1) * 4 * out["param_numel"]["single"] // n

    # the whole model: every block tensor-parallel, one forward on real tokens
    idx, tgt = next(batches(bs, T, 1, seed=seed))
    with torch.no_grad():
        loss_ref = model(idx.to(ctx.device), tgt.to(ctx.device)).item()
        tp_model = copy.deepcopy(model)
        for b in tp_model.blocks:
            tensor_parallel_block(b, group)
        with ctx.ledger.tag("tp_model/forward"):
            loss_tp = tp_model(idx.to(ctx.device), tgt.to(ctx.device)).item()
    out["model"] = {"loss_single": loss_ref, "loss_tp": loss_tp, "n_layer": model.cfg.n_layer,
                    "bytes_forward": ctx.ledger.total("sent_bytes", tag="tp_model/forward"),
                    "bytes_forward_closed_form": model.cfg.n_layer * out["bytes_closed_form"]["forward"]}
    ctx.progress(1, 1, "tensor parallel")
    return out
