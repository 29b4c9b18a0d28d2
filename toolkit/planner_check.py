"""The planner's configurations timed at the model's true shapes: its step-time model checked by the emulator.

``planner.configuration_time`` prices a configuration with formulas: each GPU's kernels from the catalog's
kernel list, the pipeline bubble from unit costs (F = 1, B = 2), tensor-parallel traffic from a count of
collectives. Here the same configuration is timed from the program instead::

    a transformer layer, the embedding, the head + loss     the project's GPT code at the true shapes, sharded
        at (tp, micro-batch, recompute)                     by its own tensor-parallel layers, on fake tensors
                                 │ runtime.shapes.estimate: every ATen op and every TP collective timed
                                 ▼
    each stage's F and B = its layers' + (first) embedding + (last) head; one activation hop between stages
                                 │ pipeline.simulate on the schedule, with these per-stage costs
                                 ▼
    step = the simulated pipeline + the planner's data-parallel and offload terms (the same model on both sides)

What the two sides share is the last line (ZeRO's gradient traffic, the offload's PCIe and NVMe time), so the
comparison checks what the planner tunes with: compute, tensor-parallel traffic and the bubble. The layer is the
project's GPT block (LayerNorm, GELU), its MLP widened to Llama's SwiGLU parameter count (3 · ffn = 2 · d_ff),
so the GEMM FLOPs equal the catalog's and the shapes differ. A model, not a measurement.
"""
from __future__ import annotations

import math
from dataclasses import replace
from functools import lru_cache

import torch

from toolkit.models.gpt import Block, GPTConfig
from toolkit.pipeline.schedule import Action, make_schedule
from toolkit.pipeline.simulate import simulate
from toolkit.runtime import collectives
from toolkit.runtime.cluster import Cluster
from toolkit.runtime.shapes import Estimate, default_dtype, estimate


def _forward_backward(build, forward, hw: Cluster, world_size: int = 1) -> tuple[Estimate, Estimate]:
    """Estimates of ``forward(*build())`` alone and of it with its backward (the backward is their difference)."""
    def alone(*built):
        with torch.no_grad():
            forward(*built)
    return (estimate(build, alone, hw, world_size=world_size),
            estimate(build, lambda *built: forward(*built).float().sum().backward(), hw, world_size=world_size))


@lru_cache(maxsize=None)
def unit_estimates(model, hw: Cluster, seq_len: int, tp: int, micro_batch: int) -> dict[str, tuple[Estimate, Estimate]]:
    """One micro-batch of one layer (on one rank of a ``tp``-way group of ``hw``), of the embedding and of the
    output head with its loss, each traced forward alone and forward + backward (``_forward_backward``); and
    ``frozen``: the layer with its weights frozen (its backward is the input's gradient alone)."""
    from torch.distributed import new_group

    from toolkit.parallel.tensor import tensor_parallel_block
    d_ff = model.mlp_matrices * model.ffn // 2  # a GELU MLP with the model's MLP parameters
    cfg = GPTConfig(vocab_size=model.vocab, seq_len=seq_len, n_layer=1, n_head=model.heads, d_model=model.hidden,
                    d_ff=d_ff)
    shape = (micro_batch, seq_len)

    def layer():
        with default_dtype(torch.bfloat16):
            block = Block(cfg)
        if tp > 1:
            tensor_parallel_block(block, new_group(list(range(tp))))
        return block, torch.empty(*shape, model.hidden, dtype=torch.bfloat16, requires_grad=True)

    def head():
        return (torch.nn.Linear(model.hidden, model.vocab, bias=False, dtype=torch.bfloat16),
                torch.empty(*shape, model.hidden, dtype=torch.bfloat16, requires_grad=True),
                torch.zeros(*shape, dtype=torch.long))

    def embed():
        return torch.nn.Embedding(model.vocab, model.hidden, dtype=torch.bfloat16), torch.zeros(*shape,
                                                                                               dtype=torch.long)

    def loss(lin, x, y):
        return torch.nn.functional.cross_entropy(lin(x).flatten(0, 1).float(), y.flatten())

    def frozen_layer():  # the input's gradient alone: the backward's dX half (zero-bubble schedules' I)
        block, x = layer()
        block.requires_grad_(False)
        return block, x

    return {name: _forward_backward(build, forward, hw, world)
            for name, build, forward, world in (("layer", layer, lambda b, x: b(x), tp), ("head", head, loss, 1),
                                                ("embed", embed, lambda e, idx: e(idx), 1),
                                                ("frozen", frozen_layer, lambda b, x: b(x), tp))}


@lru_cache(maxsize=None)
def unit_seconds(model, hw: Cluster, seq_len: int, tp: int, micro_batch: int, on: Cluster | None = None
                 ) -> dict[str, float]:
    """Seconds of one micro-batch's forward and backward (``layer_F``, ``layer_B``) of one layer, with its
    tensor-parallel collectives exposed, as Megatron's blocking all-reduces are, on one rank of a ``tp``-way
    group of ``hw``; the weight-gradient part of the layer's backward (``layer_W``: B less the backward with the
    weights frozen); of the embedding (``embed_*``); of the output head with its loss (``head_*``; both
    unsharded, on the first and last stage); and each forward's FLOPs (``*_flops``). ``on``: the same ops
    re-timed on another cluster (``Estimate.on``; a sensitivity band's perturbed ``hw``)."""
    out = {}
    for name, (f, fb) in unit_estimates(model, hw, seq_len, tp, micro_batch).items():
        f, fb = (f, fb) if on is None else (f.on(on), fb.on(on))
        out[f"{name}_F"], out[f"{name}_B"], out[f"{name}_flops"] = f.step_s, fb.step_s - f.step_s, f.flops
    out["layer_W"] = out["layer_B"] - out.pop("frozen_B")
    for k in ("frozen_F", "frozen_flops"):
        del out[k]
    return out


@lru_cache(maxsize=None)
def activation_bytes(model, seq_len: int, tp: int, micro_batch: int, recompute: bool) -> float:
    """Device bytes one layer keeps from its forward for its backward, per micro-batch, on one rank of a
    ``tp``-way group: what the traced forward's graph holds when it returns (its output, the next layer's input,
    counted here, its own input in the layer before), ``recompute``: the layer under ``torch.utils.checkpoint``."""
    from torch.distributed import new_group
    from torch.utils.checkpoint import checkpoint

    from toolkit.parallel.tensor import tensor_parallel_block
    cfg = GPTConfig(vocab_size=model.vocab, seq_len=seq_len, n_layer=1, n_head=model.heads, d_model=model.hidden,
                    d_ff=model.mlp_matrices * model.ffn // 2)

    def layer():
        with default_dtype(torch.bfloat16):
            block = Block(cfg)
        if tp > 1:
            tensor_parallel_block(block, new_group(list(range(tp))))
        return block, torch.empty(micro_batch, seq_len, model.hidden, dtype=torch.bfloat16, requires_grad=True)

    def forward(block, x):
        return checkpoint(block, x, use_reentrant=False) if recompute else block(x)
    est = estimate(layer, forward, "a100-ib200", world_size=tp)  # bytes do not depend on the cluster
    return float(est.end_bytes - est.static_bytes)


def memory_gb(w, row: dict) -> float:
    """A configuration's device GB per GPU (a row of ``planner.choose``) with its activations traced: the
    planner's weights, gradients, optimizer and buffers, and ``activation_bytes`` × layers per stage × the
    micro-batches rank 0 holds at its peak (the row's ``peak_mb``, from the pipeline simulator)."""
    rest = sum(row[f"mem_{k}_gb"] for k in ("weights", "grads", "optimizer", "buffers"))
    act = activation_bytes(w.model, w.seq_len, row["tp"], row["micro_batch"], row["recompute"])
    return rest + act * w.layers / row["pp"] * row["peak_mb"] / 1e9


class _StageCosts:
    """``simulate``'s cost of an action: its stage's F or B (W: half of B, I: the other half; an F&B both)."""

    def __init__(self, F: list[float], B: list[float], comm: float):
        self.F, self.B, self.comm = F, B, comm

    def __call__(self, a: Action) -> float:
        if a.sub:
            return sum(self(x) for x in a.sub)
        return {"F": self.F, "R": self.F, "B": self.B}.get(a.op, [b / 2 for b in self.B])[a.stage]


def configuration_seconds(w, hw: Cluster, row: dict, assume) -> dict[str, float]:
    """One configuration of ``planner.choose`` (its dp, tp, pp, micro-batch, m, schedule, recompute, ZeRO stage
    and offload) timed from the traced units (module docstring): the simulated pipeline of one step, and the
    planner's own data-parallel and offload terms. Seconds by part and ``total``."""
    from toolkit.planner import offload_time, step_time
    tp, pp, mb, m = row["tp"], row["pp"], row["micro_batch"], row["m"]
    u = unit_seconds(w.model, hw, w.seq_len, tp, mb)
    schedule = make_schedule(row["schedule"] if pp > 1 else "1f1b", pp, m)
    stages = schedule.n_stages
    per_stage = w.layers / stages
    layer_b = u["layer_B"] + (u["layer_F"] if row["recompute"] else 0.0)  # full recompute: the forward again
    F = [per_stage * u["layer_F"] for _ in range(stages)]
    B = [per_stage * layer_b for _ in range(stages)]
    F[0] += u["embed_F"]
    B[0] += u["embed_B"]
    F[-1] += u["head_F"]
    B[-1] += u["head_B"]
    hop = collectives.seconds(hw, "send", [0, tp], tp * pp, mb * w.seq_len * w.hidden * 2)[0] if pp > 1 else 0.0
    pipeline = simulate(schedule, _StageCosts(F, B, hop)).makespan
    wl = replace(w, micro_batch=mb, recompute=row["recompute"])
    dp_comm = step_time(wl, hw, row["dp"], tp, pp, row["zero"], assume)["dp_comm"]
    offload = offload_time(wl, row["dp"], tp, pp, row["zero"], row["offload"], hw, assume)
    return {"pipeline": pipeline, "dp_comm": dp_comm, "offload": offload, "total": pipeline + dp_comm + offload}


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation of two equally long lists (ties share their mean rank)."""
    def ranks(xs):
        order = sorted(range(len(xs)), key=xs.__getitem__)
        r = [0.0] * len(xs)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r
    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    return cov / math.sqrt(sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb))


def compare(w, hw: Cluster, rows: list[dict], assume, headroom: float = 0.9) -> dict:
    """The planner's step against the traced one for every distinct layout among ``rows`` (dp, tp, pp,
    micro-batch, schedule, recompute; ZeRO-1 and no offload, whose terms are the same model on both sides):
    their rank correlation, the worst ratio, and each layout's pair; and its memory with traced activations
    (``memory_gb``): whether it fits in ``headroom`` of the GPU's memory (``traced_fits``, as ``planner.choose``
    decides ``fits``), and the layouts on which the two disagree (``fits_disagree``)."""
    seen, pairs = set(), []
    for r in rows:
        key = (r["dp"], r["tp"], r["pp"], r["micro_batch"], r["schedule"], r["recompute"])
        if r["zero"] != 1 or r["offload"] != "none" or key in seen:
            continue
        seen.add(key)
        traced = configuration_seconds(w, hw, r, assume)["total"]
        gb = memory_gb(w, r)
        pairs.append({**{k: r[k] for k in ("dp", "tp", "pp", "zero", "micro_batch", "m", "schedule", "recompute",
                                             "offload", "fits")}, "planner_s": r["step_s"], "traced_s": traced,
                      "ratio": traced / r["step_s"], "planner_gb": r["memory_gb"], "traced_gb": gb,
                      "traced_fits": gb <= hw.gpu.memory_bytes / 1e9 * headroom})
    worst = max(pairs, key=lambda p: abs(math.log(p["ratio"])))
    return {"pairs": pairs, "spearman": spearman([p["planner_s"] for p in pairs], [p["traced_s"] for p in pairs]),
            "worst": worst, "same_best": min(pairs, key=lambda p: p["planner_s"]) is min(pairs,
                                                                                       key=lambda p: p["traced_s"]),
            "fits_disagree": [p for p in pairs if p["fits"] != p["traced_fits"]]}
