"""A cost model of static vs dynamic CP at the seed's scale -- a *simulation*: every number it gives rests on the
cluster it is given (``CLUSTER``: the h100-ib400 preset with an assumed ring hop), whose GPU's efficiency model
(``toolkit.runtime.efficiency``, the emulated cluster's) times the kernels, and is labelled "simulated" wherever
it is shown.

The blog's setting: Llama-13B, pipeline 8 stages (PP8) x 8 DP·CP ranks per stage (64 GPUs), global batch 2048
sequences, full recompute; static CP8 (the CP size the longest sequence needs) against the dynamic scheduler.

Per micro-batch, per pipeline stage, for each CP group (c ranks, T tokens per rank, A = Σ L²/c over its
sequences; every rank of a group does the same work)::

    linear      the layer's GEMMs on T tokens (QKV, output projection,   each kernel at the GPU's achieved rate
                SwiGLU MLP) and its elementwise passes                (``catalog.layer_kernels``)
    attention   flash attention, causal, 2·d·A FLOPs, at the rate of sequences of A/T tokens (the
                token-weighted mean length: short documents run below the kernel's plateau)
    ring hop    α + 2·T·d_kv·b / β                                    K and V of one rank's tokens, on the link
                                                                      the CP group spans (intra-node up to
                                                                      gpus_per_node ranks, else inter-node)
    exposed     (c-1) · max(0, hop - attention/c)                     each hop hides behind 1/c of the attention

    forward  F = layers/stage · (linear + attention + exposed)
    backward B = layers/stage · (2·linear + 2.5·attention + exposed with 2x bytes per hop and one more hop
                                 (dK/dV going home))  +  F again with full recompute
                 (flash attention's backward: 5 matmuls against the forward's 2, scores recomputed)

A stage's time for a micro-batch is its slowest group's (groups of the same micro-batch finish together before
the next starts: with dynamic CP the groups change every micro-batch). The pipeline is then 1F1B over PP
stages with these unequal micro-batches, timed by ``toolkit.pipeline.simulate``. Static CP with DP > 1 runs
its replicas as independent pipelines (the step waits for the slowest); with DP = 1 there is one. Without a
pipeline (pp = 1, a run like lesson 12's) nothing makes the groups of a micro-batch wait for each other: each
rank keeps its own clock, and a group starts once its last rank is free (``_rank_clocks``).

The same per-group time is what the toolkit's scheduler judges its refill and merge steps by (``CostModel``, a
``dynamic_cp.GroupCost``). ``compare`` times four plans: static CP packed in data order, static CP packed
longest first (the ablation: the gain of packing alone), dynamic CP with Megatron's rules, and the toolkit's.

Not modelled: the embedding, and the output layer but where asked (``output_layer``, pp = 1); the DP gradient
all-reduce (the same for every plan); the scheduler's own time (Megatron runs it asynchronously); memory.
"""
from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, replace
from functools import lru_cache

from toolkit.models.catalog import ModelSpec, get, layer_kernels
from toolkit.pipeline.schedule import one_f_one_b
from toolkit.pipeline.simulate import simulate
from toolkit.runtime.cluster import GPU, Cluster, Link, cluster
from toolkit.runtime.efficiency import kernel_seconds

from .dynamic_cp import Group, Plan, advance, cp_size_for, pad_length, schedule_dynamic, schedule_static


LLAMA_13B = get("llama2-13b")
"""The blog's model (``toolkit.models.catalog``)."""


RING_HOP = Link("CP ring hop over NVLink (assumed)", 200e9, 20e-6,
                "assumed: one K/V send/recv between neighbours per attention step, issued inside the attention "
                "loop, reaches less than the 450 GB/s per direction a large NVLink 4 transfer does; 20 µs covers "
                "its launch and the step's synchronisation")
CLUSTER = cluster("h100-ib400", name="h100-ib400, CP ring hop assumed", intra=RING_HOP)
"""The simulation's default hardware: the H100 preset, its intra-node link replaced by ``RING_HOP``. The ring
hop's 200 GB/s and 20 µs are the figures this simulation started from (``bandwidth_sweep`` shows how the
speed-ups move with the bandwidth); ``cluster("h100-ib400")`` gives NVLink's full figure instead."""


@dataclass(frozen=True)
class Setup:
    """The parallel layout and batch of the simulated run."""

    pp: int = 8
    dcp: int = 8
    """DP x CP ranks per pipeline stage (the plane the dynamic scheduler packs)."""
    cap: int = 8192
    """Tokens per rank per micro-batch (Megatron's max_seqlen_per_dp_cp_rank)."""
    gbs: int = 2048
    """Sequences per global batch."""
    recompute: bool = True


def stretch_scales(d_model: int, shape: ModelSpec = LLAMA_13B) -> dict[str, float]:
    """The emulator's ``scaled(flops=, bytes=)`` factors that time a toy GPT of width ``d_model`` as ``shape``'s
    layers: every width and every length times r = shape.d_model / d_model. Attention's FLOPs (∝ d·L²) and the
    linear layers' (∝ d²·L) then both grow as r³, activations, K/V blocks and weights as r², so the toy keeps
    the real model's ratios of attention to linear work and of compute to ring traffic. Approximate where the
    shapes differ: the toy's 12·d² linear FLOPs per token and layer (a 4·d GELU MLP) stand for Llama-13B's
    12.1·d² (SwiGLU of 2.7·d), its 256-token vocabulary for 256·r."""
    r = shape.hidden / d_model
    return {"scale": r, "flops": r ** 3, "bytes": r ** 2}


def corpus_lengths(n: int, max_len: int, seed: int = 0, scale: int = 1) -> list[int]:
    """``n`` lengths drawn (seeded) from the corpus's real document lengths (``toolkit.data.doc_lengths``,
    Python's stdlib: code, i.e. GitHub-like), divided by ``scale`` and truncated to ``max_len``."""
    from toolkit.data import doc_lengths
    pool = [x for x in doc_lengths() if x > 0]
    rng = random.Random(seed)
    return [min(max(1, -(-rng.choice(pool) // scale)), max_len) for _ in range(n)]


def lognormal_lengths(n: int, max_len: int, median: float = 800.0, sigma: float = 1.2, seed: int = 0) -> list[int]:
    """``n`` synthetic lengths, log-normal with the given median and sigma, truncated to ``max_len``. The
    "CommonCrawl-like" distribution of the notebook is this, an assumption (short web documents, a thin tail),
    not data."""
    rng = random.Random(seed)
    return [min(max(1, round(median * math.exp(sigma * rng.gauss(0.0, 1.0)))), max_len) for _ in range(n)]


def _seconds(gpu: GPU, kernels) -> tuple[float, float]:
    """(all the kernels' seconds, the attention kernels' share of them) on ``gpu``."""
    t = [(kernel_seconds(k, gpu.bf16_flops, gpu.hbm_bytes_per_s, gpu.sms, gpu.efficiency), k.kind) for k in kernels]
    return sum(x for x, _ in t), sum(x for x, kind in t if kind == "attention")


@lru_cache(maxsize=1 << 16)
def _layer_seconds(shape: ModelSpec, gpu: GPU, batch: float, length: int, elem: int) -> tuple[float, ...]:
    """One layer's (forward, its attention, backward, its attention) seconds: remembered, as a scheduler times
    the same groups on many links."""
    return (*_seconds(gpu, layer_kernels(shape, batch, length, elem=elem)),
            *_seconds(gpu, layer_kernels(shape, batch, length, backward=True, elem=elem)))


def group_times(tokens: float, attn_work: float, cp: int, layers: int, shape: ModelSpec, hw: Cluster,
                recompute: bool = True, output_layer: bool = False, elem: int = 2) -> dict[str, float]:
    """Forward and backward seconds of one CP group on one stage (see the module docstring), and their parts:
    ``tokens`` per rank, ``attn_work`` = Σ L²/cp per rank. ``output_layer``: the stage also runs the output
    layer's GEMM (the last stage; a run without a pipeline)."""
    from toolkit.models.catalog import head_kernels
    if tokens <= 0:
        return {"F": 0.0, "B": 0.0, "compute": 0.0, "exposed_comm": 0.0}
    length = max(1.0, attn_work / tokens)  # the token-weighted mean sequence length
    batch = tokens / length
    fwd_s, attention, bwd_s, attention_b = _layer_seconds(shape, hw.gpu, batch, round(length), elem)
    link = hw.intra if cp <= hw.gpus_per_node else hw.inter
    hop = link.seconds(2 * tokens * shape.kv_dim * elem)
    exposed_f = (cp - 1) * max(0.0, hop - attention / cp) if cp > 1 else 0.0
    hop_b = link.seconds(4 * tokens * shape.kv_dim * elem)  # K/V and dK/dV in flight together
    exposed_b = ((cp - 1) * max(0.0, hop_b - attention_b / cp) + hop) if cp > 1 else 0.0
    head_f = _seconds(hw.gpu, head_kernels(shape, round(tokens)))[0] if output_layer else 0.0
    head_b = _seconds(hw.gpu, head_kernels(shape, round(tokens), backward=True))[0] if output_layer else 0.0
    fwd = layers * (fwd_s + exposed_f) + head_f
    bwd = layers * (bwd_s + exposed_b) + head_b + (layers * fwd_s if recompute else 0.0)
    compute = layers * (fwd_s * (2 if recompute else 1) + bwd_s) + head_f + head_b
    return {"F": fwd, "B": bwd, "compute": compute, "exposed_comm": fwd + bwd - compute}


@dataclass(frozen=True)
class CostModel:
    """A CP group's modelled forward + backward seconds on one stage (``group_times``, ring hops included), as a
    ``dynamic_cp.GroupCost``: what the toolkit's scheduler minimises. ``scale``: the plan's lengths stand for
    ``scale`` times as many tokens (a workload-matched run: the toy's lengths and widths both times ``scale``)."""

    shape: ModelSpec = LLAMA_13B
    hw: Cluster = CLUSTER
    layers: int = LLAMA_13B.layers // 8
    recompute: bool = True
    scale: float = 1.0
    output_layer: bool = False

    def __post_init__(self):
        object.__setattr__(self, "_memo", {})  # groups already timed (not a field): a scheduler asks again and again

    def __call__(self, tokens: float, attn_work: float, cp: int) -> float:
        key = (tokens, attn_work, cp)
        seconds = self._memo.get(key)
        if seconds is None:
            t = group_times(tokens * self.scale, attn_work * self.scale ** 2, cp, self.layers, self.shape,
                            self.hw, self.recompute, self.output_layer)
            seconds = self._memo[key] = t["F"] + t["B"]
        return seconds


def group_inputs(group: Group, lengths: list[int], scale: float = 1.0) -> tuple[float, float]:
    """``group_times``' tokens per rank and work per rank Σ L²/cp of ``group``, its lengths times ``scale``."""
    return (scale * sum(lengths[s] for s in group.samples) / group.size,
            scale ** 2 * sum(lengths[s] ** 2 for s in group.samples) / group.size)


def _stage_costs(plan: Plan, groups_of, shape: ModelSpec, hw: Cluster, pp: int, recompute: bool, scale: float,
                 output_layer: bool, times_of=None):
    layers = shape.layers // pp
    out = []
    for mb in plan.micro_batches:
        times = []
        for g in groups_of(mb):
            if not g.samples:
                continue
            times.append(times_of(g, plan.lengths) if times_of else
                         group_times(*group_inputs(g, plan.lengths, scale), g.size, layers, shape, hw, recompute,
                                     output_layer))
        if times:
            out.append(max(times, key=lambda t: t["F"] + t["B"]))
    return out


@lru_cache(maxsize=32)
def _one_f_one_b(pp: int, m: int):
    return one_f_one_b(pp, m)


def step_time(plan: Plan, shape: ModelSpec, hw: Cluster, pp: int, recompute: bool = True, scale: float = 1.0,
              output_layer: bool = False, times_of=None) -> dict:
    """Simulated seconds of one training step of ``plan`` on ``pp`` pipeline stages: 1F1B with each micro-batch's
    slowest group as its stage time; static plans with several replicas run them as independent pipelines. With
    pp = 1, rank clocks (``_rank_clocks``): no micro-batch waits for groups it does not share ranks with.
    ``scale``: the plan's lengths stand for ``scale`` times as many tokens (see ``CostModel``); ``output_layer``
    (pp = 1 only: here every stage costs the same): the stage runs the output layer too. ``times_of(group,
    lengths)`` (pp > 1): a group's stage times in ``group_times``' keys, from elsewhere than this cost model (a
    trace at true shapes)."""
    if output_layer and pp != 1:
        raise ValueError(f"output_layer=True needs pp=1 (got pp={pp}): the model gives every stage the same costs, "
                         f"and only the last stage holds the output layer")
    if pp == 1:
        if times_of is not None:
            raise ValueError("times_of needs pp > 1 (rank clocks time groups with this module's cost model)")
        return _rank_clocks(plan, shape, hw, recompute, scale, output_layer)
    if plan.kind.startswith("static"):
        starts = sorted({g.start for g in plan.micro_batches[0].groups})
        pipelines = [(lambda mb, a=a: [g for g in mb.groups if g.start == a]) for a in starts]
    else:
        pipelines = [lambda mb: mb.groups]
    results = []
    for groups_of in pipelines:
        costs = _stage_costs(plan, groups_of, shape, hw, pp, recompute, scale, output_layer, times_of)
        if not costs:
            continue
        if len(costs) < pp:
            raise ValueError(f"the {plan.kind} plan gives a pipeline {len(costs)} micro-batches, fewer than the "
                             f"pp={pp} stages 1F1B needs: use a larger global batch")
        sim = simulate(_one_f_one_b(pp, len(costs)),
                       lambda a: costs[a.mb]["F"] if a.op == "F" else costs[a.mb]["B"])
        busy = sum(c["F"] + c["B"] for c in costs)
        results.append({"step_s": sim.makespan, "m": len(costs), "busy_s": busy,
                        "compute_s": sum(c["compute"] for c in costs),
                        "exposed_comm_s": sum(c["exposed_comm"] for c in costs)})
    worst = max(results, key=lambda r: r["step_s"])
    return {**worst, "bubble_s": worst["step_s"] - worst["busy_s"], "pipelines": len(results)}


def _rank_clocks(plan: Plan, shape: ModelSpec, hw: Cluster, recompute: bool, scale: float,
                 output_layer: bool) -> dict:
    """Without a pipeline each rank runs its micro-batches in turn, and a group starts once its last rank is
    free (its ring needs them all): rank clocks (``dynamic_cp.advance``), the step ends with the last. Static
    replicas never wait for each other, nor do CP-1 groups; the time the last rank waited for the other ranks of
    its groups is its ``bubble_s``."""
    cost = CostModel(shape, hw, shape.layers, recompute, scale, output_layer)
    clock = [0.0] * plan.n_ranks
    for mb in plan.micro_batches:
        advance(clock, mb, plan.lengths, cost)
    last = clock.index(max(clock))
    parts = [group_times(*group_inputs(g, plan.lengths, scale), g.size, shape.layers, shape, hw, recompute,
                         output_layer) for mb in plan.micro_batches for g in mb.groups if last in g.ranks and g.samples]
    busy = sum(t["F"] + t["B"] for t in parts)
    return {"step_s": clock[last], "m": len(plan.micro_batches), "busy_s": busy,
            "compute_s": sum(t["compute"] for t in parts), "exposed_comm_s": sum(t["exposed_comm"] for t in parts),
            "bubble_s": clock[last] - busy, "pipelines": 1}


def model_flops(lengths: list[int], shape: ModelSpec) -> float:
    """Model FLOPs of one step over sequences of ``lengths`` (forward + backward = 3x forward; no recompute,
    the usual MFU convention): per layer 2·L·(linear params) + 2·d·L² (causal attention), plus the output layer."""
    d = shape.hidden
    per_token = 2 * shape.layers * shape.active_layer_params() + 2 * d * shape.vocab
    return 3 * sum(per_token * n + shape.layers * 2 * d * n * n for n in lengths)


def plans_for(lengths: list[int], setup: Setup = Setup(), min_cp: int = 1, shape: ModelSpec = LLAMA_13B,
              hw: Cluster = CLUSTER) -> dict[str, Plan]:
    """The four plans ``compare`` times: static CP (the size the longest sequence needs, dp = dcp / cp) packed in
    data order and packed longest first, Megatron's rules as they are, and the toolkit's dynamic scheduler with
    this simulation's ``CostModel`` on ``hw``."""
    padded = [pad_length(n, 2 * setup.dcp) for n in lengths]
    static_cp = cp_size_for(max(padded), setup.cap, min_cp, setup.dcp)
    cost = CostModel(shape, hw, shape.layers // setup.pp, setup.recompute)
    return {"static": schedule_static(padded, setup.dcp, static_cp, setup.cap),
            "static-sorted": schedule_static(padded, setup.dcp, static_cp, setup.cap, order="length"),
            "dynamic-megatron": schedule_dynamic(padded, setup.dcp, setup.cap, min_cp),
            "dynamic": schedule_dynamic(padded, setup.dcp, setup.cap, min_cp, cost=cost)}


def compare(lengths: list[int], setup: Setup = Setup(), shape: ModelSpec = LLAMA_13B, hw: Cluster = CLUSTER,
            min_cp: int = 1, plans: dict[str, Plan] | None = None) -> dict:
    """Static CP against dynamic CP (``plans_for``) on one global batch of ``lengths``: simulated step times, their
    parts, speed-ups over static and model TFLOPS/GPU, and ``ablation``: the speed-up of dynamic CP over static
    split into the packing gain (static packed longest first over static in data order) and the gain of a CP
    size per sequence (dynamic over static packed longest first); the two multiply to the whole. Pass ``plans``
    to reuse them."""
    plans = plans or plans_for(lengths, setup, min_cp, shape, hw)
    flops = model_flops(lengths, shape)
    gpus = setup.pp * setup.dcp
    out = {"static_cp": plans["static"].micro_batches[0].groups[0].size, "gpus": gpus, "setup": asdict(setup),
           "hardware": hw.to_dict(), "efficiency": asdict(hw.gpu.efficiency), "model": asdict(shape), "runs": {}}
    for name, plan in plans.items():
        plan.check()
        sim = step_time(plan, shape, hw, setup.pp, setup.recompute)
        balance = plan.balance()
        out["runs"][name] = {**sim, "tflops_per_gpu": flops / sim["step_s"] / gpus / 1e12,
                             "micro_batches": len(plan.micro_batches), "balance_max": max(balance),
                             "balance_mean": sum(balance) / len(balance),
                             "cp_sizes": _histogram(plan.cp_sizes().values())}
    base = out["runs"]["static"]["step_s"]
    for run in out["runs"].values():
        run["speedup_vs_static"] = base / run["step_s"]
    if "static-sorted" in out["runs"]:
        step = {k: r["step_s"] for k, r in out["runs"].items()}
        out["ablation"] = {"packing": step["static"] / step["static-sorted"],
                           "cp_size_per_sequence": step["static-sorted"] / step["dynamic"],
                           "whole": step["static"] / step["dynamic"]}
    return out


def bandwidth_sweep(plans: dict[str, Plan], gbytes_per_s: list[float], setup: Setup = Setup(),
                    shape: ModelSpec = LLAMA_13B, hw: Cluster = CLUSTER, min_cp: int = 1) -> dict[str, list[float]]:
    """Simulated speed-up of each plan over the static one for each ring link bandwidth (GB/s: the intra link's
    ``bytes_per_s`` replaced). The toolkit's dynamic plan is scheduled again for each link, as its cost model
    sees the link; the others do not depend on it."""
    out: dict[str, list[float]] = {name: [] for name in plans if name != "static"}
    for bw in gbytes_per_s:
        h = replace(hw, intra=replace(hw.intra, bytes_per_s=bw * 1e9))
        base = step_time(plans["static"], shape, h, setup.pp, setup.recompute)["step_s"]
        for name in out:
            plan = plans[name]
            if name == "dynamic":
                cost = CostModel(shape, h, shape.layers // setup.pp, setup.recompute)
                plan = schedule_dynamic(plan.lengths, plan.n_ranks, plan.cap, min_cp, cost=cost)
            out[name].append(base / step_time(plan, shape, h, setup.pp, setup.recompute)["step_s"])
    return out


def _histogram(values) -> dict[int, int]:
    out: dict[int, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return dict(sorted(out.items()))
