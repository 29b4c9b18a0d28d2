"""Per-rank programs that run the parallel techniques (``toolkit.parallel``) beside their references and
return plain numbers: experiments, not techniques, so they live with the lesson programs.

Lesson 00 calls them inside ``run(ctx, cfg)``; tests launch them directly::

    launch("parallel_demos:run_dp_zero_fsdp", 2, {"preset": "smoke", "steps": 3})
    launch("parallel_demos:run_tensor_parallel", 2, {"preset": "smoke"})

Bytes come from ``ctx.ledger`` (sent bytes per rank, the ledger's ring convention), memory from the
storages the tensors live in, step times from ``toolkit.runtime.bench.measure``.
"""
from __future__ import annotations

import copy
import gc
import math
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.nn as nn

from toolkit.data import batches
from toolkit.models import GPT, GPTConfig, preset
from toolkit.runtime.bench import measure
from toolkit.runtime.memory import MemoryTracker

from toolkit.parallel.tensor import check_tp, qkv_rows, tensor_parallel_block
from toolkit.parallel.zero import ZeroDataParallel, adamw, default_units, memory_per_rank, optimizer_state, storage_bytes

def _per_step(ledger, tag: str, steps: int, field: str = "sent_bytes") -> dict[str, float]:
    out: dict[str, float] = defaultdict(int)
    for r in ledger.records:
        if r.tag == tag:
            out[r.op] += 1 if field == "calls" else getattr(r, field)
    return {op: v / steps if v % steps else v // steps for op, v in sorted(out.items())}


# ---- configuration (checked before any process starts) ------------------------------------------------

DP_VARIANTS = ("ddp", "zero0", "zero1", "zero2", "zero3", "fsdp2", "fsdp2_keep")
DP_DEFAULTS = {"preset": "smoke", "overrides": {}, "steps": 3, "batch_size": 4, "lr": 1e-3, "seed": 0, "timing": True,
               "bench": {"warmup": 1, "steps": 2, "rounds": 3, "trim": 1}, "variants": list(DP_VARIANTS)}
TP_DEFAULTS = {"preset": "smoke", "overrides": {}, "batch_size": 4, "seed": 0}


def _positive_ints(cfg: dict, *keys: str) -> None:
    for key in keys:
        if not isinstance(cfg[key], int) or isinstance(cfg[key], bool) or cfg[key] < 1:
            raise ValueError(f"{key} must be a positive int, got {cfg[key]!r}")


def _model_cfg(cfg: dict) -> GPTConfig:
    """The GPT size of ``cfg``; ValueError naming an unknown preset, override field or bad size."""
    fields = set(GPTConfig.__dataclass_fields__)
    if not isinstance(cfg["overrides"], dict) or set(cfg["overrides"]) - fields:
        raise ValueError(f"overrides={cfg['overrides']!r}: must be a dict of GPTConfig fields {sorted(fields)}")
    return preset(cfg["preset"], **cfg["overrides"])


def validate_dp_zero_fsdp(cfg: dict, world_size: int) -> dict:
    """``cfg`` with :data:`DP_DEFAULTS` filled in; ValueError naming the bad parameter. Runs before launch."""
    cfg = {**DP_DEFAULTS, **cfg}
    _model_cfg(cfg)
    _positive_ints(cfg, "steps", "batch_size")
    unknown = [v for v in cfg["variants"] if v not in DP_VARIANTS]
    if unknown or not cfg["variants"]:
        raise ValueError(f"variants={cfg['variants']!r}: need a non-empty subset of {DP_VARIANTS}")
    cfg["variants"] = [v for v in DP_VARIANTS if v in cfg["variants"]]  # "ddp" first: the reference
    timing = cfg["timing"]
    if not isinstance(timing, bool) and not (isinstance(timing, list) and set(timing) <= set(cfg["variants"])):
        raise ValueError(f"timing={timing!r}: True, False or a list of the variants to time")
    if world_size < 2:
        raise ValueError(f"world_size={world_size}: data parallelism needs at least 2 ranks")
    return cfg


def validate_tensor_parallel(cfg: dict, world_size: int) -> dict:
    """``cfg`` with :data:`TP_DEFAULTS` filled in; tp = ``world_size`` must divide n_head and d_ff."""
    cfg = {**TP_DEFAULTS, **cfg}
    model = _model_cfg(cfg)
    _positive_ints(cfg, "batch_size")
    check_tp(world_size, n_head=model.n_head, d_ff=model.d_ff)
    return cfg


# ---- data parallel: DDP, ZeRO 0-3, FSDP2 ------------------------------------------------------------


class DPVariant:
    """One data-parallel variant: ``loss = fwd_bwd(x, y)``, ``step()``, memory and full parameters."""

    def __init__(self, name: str, base: nn.Module, group, lr: float):
        if name not in DP_VARIANTS:
            raise ValueError(f"variant={name!r} is not known; allowed: {DP_VARIANTS}")
        self.name, n = name, dist.get_world_size(group)
        model = copy.deepcopy(base)
        factory = lambda ps: adamw(ps, lr=lr)  # noqa: E731
        if name.startswith("zero"):
            self.zero = ZeroDataParallel(model, factory, stage=int(name[-1]), group=group)
            self.model, self.optimizer = self.zero, self.zero.optimizer
            forms = self.zero.closed_forms()
            self.closed_bytes, self.closed_memory = forms["bytes"], forms["memory"]
        elif name == "ddp":
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
            from torch.nn.parallel import DistributedDataParallel as DDP
            # the default C++ reducer calls the process group directly; the stock Python hook does the
            # same all-reduce (divide by n, then sum) through dist.all_reduce, where the ledger sees it
            self.model = DDP(model, process_group=group, gradient_as_bucket_view=True)
            self.model.register_comm_hook(group, allreduce_hook)
            self.optimizer = factory(list(self.model.parameters()))
            psi = sum(p.numel() for p in model.parameters())
            self.closed_bytes = {"all_reduce": 2 * (n - 1) * psi * 4 // n}
            self.closed_memory = memory_per_rank(0, psi, n)
        else:
            from torch.distributed.device_mesh import DeviceMesh
            from torch.distributed.fsdp import fully_shard
            mesh = DeviceMesh.from_group(group, next(model.parameters()).device.type)
            reshard, r = name == "fsdp2", dist.get_rank(group)
            # FSDP2 cuts every parameter's dim 0 as torch.chunk does (ceil(d/n) rows each, the last ranks
            # get fewer) and stores the shard padded; the optimizer's state follows the unpadded shard
            chunks = [(math.ceil(p.shape[0] / n), p.shape[0], p[0].numel()) for p in model.parameters()]
            psi = sum(c * n * row for c, _, row in chunks)
            mine = sum(max(0, min(c, d - r * c)) * row for c, d, row in chunks)
            for unit in default_units(model):
                fully_shard(unit, mesh=mesh, reshard_after_forward=reshard)
            fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
            self.model, self.optimizer = model, factory(list(model.parameters()))
            ag = (n - 1) * psi * 4 // n
            self.closed_bytes = {"all_gather_into_tensor": (2 if reshard else 1) * ag, "reduce_scatter_tensor": ag}
            self.closed_memory = {**memory_per_rank(3, psi, n), "optim": 2 * 4 * mine}

    def fwd_bwd(self, x: torch.Tensor, y: torch.Tensor) -> float:
        loss = self.model(x, y)
        loss.backward()
        return loss.item()

    def step(self) -> None:
        if self.name.startswith("zero"):
            self.zero.step()
        else:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)

    def memory(self) -> dict[str, int]:
        """Bytes at rest on this rank right after backward, by category (distinct storages)."""
        if self.name.startswith("zero"):
            return self.zero.memory_by_category()
        params = list(self.model.parameters())
        return {"params": storage_bytes(params), "grads": storage_bytes([p.grad for p in params]),
                "optim": storage_bytes(optimizer_state(self.optimizer))}

    def full_parameters(self) -> dict[str, torch.Tensor]:
        if self.name.startswith("zero"):
            return self.zero.full_parameters()
        module = self.model.module if self.name == "ddp" else self.model
        return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                for name, p in module.named_parameters()}


def run_dp_zero_fsdp(ctx, cfg: dict) -> dict:
    """Train the tiny GPT with DDP, ZeRO stages 0-3 and FSDP2 side by side on the same data; measure each.

    cfg (defaults in :data:`DP_DEFAULTS`, checked by :func:`validate_dp_zero_fsdp`): ``preset`` ("smoke" |
    "default" | "full"), ``overrides`` (GPTConfig fields), ``steps``, ``batch_size`` per rank, ``lr``, ``seed``,
    ``timing`` (measure step times: True, False or a list of variants), ``bench`` (``measure`` arguments),
    ``variants`` (a subset of ``DP_VARIANTS``, run in that order: "ddp" is torch's DistributedDataParallel,
    "zero0".."zero3" this toolkit's ZeroDataParallel, "fsdp2" ``fully_shard`` per unit, "fsdp2_keep" the
    same with ``reshard_after_forward=False``). Data parallel over all ranks.

    Returns (per rank; v = variant name, op = ledger op name):
        ``world_size``, ``preset``, ``steps``, ``variants``: the run.
        ``numel``: Ψ, parameters of the model. ``embed_numel``: parameters of the embedding unit.
        ``loss[v]``: list of this rank's micro-batch loss at each step.
        ``max_abs_diff_vs_ddp[v]``: max |p - p_ddp| over all parameters after ``steps`` steps (0.0 = bitwise;
            present when "ddp" is among the variants).
        ``bytes_per_step[v]``: bytes this rank sent per step (ledger), all ops.
        ``bytes_per_step_by_op[v][op]``, ``calls_per_step_by_op[v][op]``: the same split by op.
        ``bytes_closed_form[v][op]``: what the formulas of ``toolkit.parallel.zero`` predict.
        ``memory[v]``: {"params", "grads", "optim"} bytes at rest right after backward (distinct storages;
            AdamW's 0-dim step counters left out). ``memory_closed_form[v]``: the formulas' prediction.
        ``peak_memory[v]``: MemoryTracker over one whole step: {"param", "grad", "optim", "act", "comm", "host",
            "total"} bytes at the moment of the highest total; ``max_memory_by_category[v]``: each one's own max.
        ``step_time_s[v]``: trimmed mean step time (timed variants only); ``step_time_stability[v]``: std/mean.
    """
    cfg = validate_dp_zero_fsdp(cfg, ctx.world_size)
    steps, variants = cfg["steps"], cfg["variants"]
    timed = variants if cfg["timing"] is True else cfg["timing"] or []
    bench = {**DP_DEFAULTS["bench"], **cfg["bench"]}
    group = dist.group.WORLD
    torch.manual_seed(cfg["seed"])
    base = GPT(_model_cfg(cfg)).to(ctx.device)
    data = [(x.to(ctx.device), y.to(ctx.device)) for x, y in batches(cfg["batch_size"], base.cfg.seq_len, steps + 1,
                                                                     seed=cfg["seed"], rank=ctx.rank,
                                                                     world=ctx.world_size)]
    work = len(variants) * (steps + 1) + len(timed) * (bench["warmup"] + bench["steps"] * bench["rounds"])
    out: dict = defaultdict(dict)
    out.update(world_size=ctx.world_size, preset=cfg["preset"], steps=steps, variants=variants,
               numel=sum(p.numel() for p in base.parameters()),
               embed_numel=sum(p.numel() for p in base.embed.parameters()))
    reference, done = None, 0
    for name in variants:
        trainer = DPVariant(name, base, group, float(cfg["lr"]))
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
        out["loss"][name] = losses
        out["bytes_per_step_by_op"][name] = _per_step(ctx.ledger, name, steps)
        out["calls_per_step_by_op"][name] = _per_step(ctx.ledger, name, steps, "calls")
        out["bytes_per_step"][name] = sum(out["bytes_per_step_by_op"][name].values())
        out["bytes_closed_form"][name] = trainer.closed_bytes
        out["memory"][name], out["memory_closed_form"][name] = mem, trainer.closed_memory
        with ctx.ledger.tag(f"{name}/peak"), MemoryTracker(trainer.model, trainer.optimizer, every_op=False) as mt:
            trainer.fwd_bwd(*data[steps])
            trainer.step()
        out["peak_memory"][name], out["max_memory_by_category"][name] = dict(mt.peak), dict(mt.max_by_category)
        done += 1
        if name in timed:
            x, y = data[0]
            with ctx.ledger.tag(f"{name}/timing"):
                res = measure(lambda: (trainer.fwd_bwd(x, y), trainer.step()), **bench,
                              on_step=lambda d, t, base_done=done: ctx.progress(base_done + d, work, f"{name} timing"))
            done += bench["warmup"] + bench["steps"] * bench["rounds"]
            out["step_time_s"][name], out["step_time_stability"][name] = res.mean_s, res.throughput_stability
        del trainer, params
        gc.collect()  # DDP with a Python comm hook must be gone before the process group is destroyed
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


def run_tensor_parallel(ctx, cfg: dict) -> dict:
    """One transformer block (and the whole tiny GPT) split over all ranks by tensor parallelism.

    The single-process block, this toolkit's Megatron-style TP block and torch's ``parallelize_module``
    block get the same weights, input x and output gradient dy (seeded identically on every rank).

    cfg (defaults in :data:`TP_DEFAULTS`, checked by :func:`validate_tensor_parallel`): ``preset``, ``overrides``,
    ``batch_size``, ``seed``. tp = world size.

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
    cfg = validate_tensor_parallel(cfg, ctx.world_size)
    seed, bs = cfg["seed"], cfg["batch_size"]
    group, n = dist.group.WORLD, ctx.world_size
    torch.manual_seed(seed)
    model = GPT(_model_cfg(cfg)).to(ctx.device)
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
