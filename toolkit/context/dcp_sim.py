"""A cost model of static vs dynamic CP at the seed's scale -- a *simulation*: every number it gives rests on the
cluster it is given (``CLUSTER``: the h100-ib400 preset with an assumed ring hop) and on the assumed kernel
efficiencies (``Efficiency``), and is labelled "simulated" wherever it is shown.

The blog's setting: Llama-13B, pipeline 8 stages (PP8) x 8 DP·CP ranks per stage (64 GPUs), global batch 2048
sequences, full recompute; static CP8 (the CP size the longest sequence needs) against the dynamic scheduler.

Per micro-batch, per pipeline stage, for each CP group (c ranks, T tokens per rank, A = Σ L²/c over its
sequences; every rank of a group does the same work)::

    linear      2·T·(2·d² + 2·d·d_kv + 3·d·d_ff) / (peak · gemm)      QKV + output projection, SwiGLU MLP
    attention   2·d·A / (peak · attention)                            causal QKᵀ and PV (half the square each)
    ring hop    α + 2·T·d_kv·b / β                                    K and V of one rank's tokens, on the link
                                                                      the CP group spans (intra-node up to
                                                                      gpus_per_node ranks, else inter-node)
    exposed     (c-1) · max(0, hop - attention/c)                     each hop hides behind 1/c of the attention

    forward  F = layers/stage · (linear + attention + exposed)
    backward B = layers/stage · (2·(linear + attention) + exposed with 2x bytes per hop and one more hop
                                 (dK/dV going home))  +  F again with full recompute

A stage's time for a micro-batch is its slowest group's (groups of the same micro-batch finish together before
the next starts: with dynamic CP the groups change every micro-batch). The pipeline is then 1F1B over PP
stages with these unequal micro-batches, timed by ``toolkit.pipeline.simulate``. Static CP with DP > 1 runs
its replicas as independent pipelines (the step waits for the slowest); with DP = 1 there is one.

Not modelled: embedding and output layer (the same for both), DP gradient all-reduce (the same), kernel
efficiency falling on small chunks (which would favour dynamic CP further), the scheduler's own time
(Megatron runs it asynchronously), memory.
"""
from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, replace
from functools import lru_cache

from toolkit.pipeline.schedule import one_f_one_b
from toolkit.pipeline.simulate import simulate
from toolkit.runtime.cluster import Cluster, Link, cluster

from .dynamic_cp import Plan, cp_size_for, pad_length, schedule_dynamic, schedule_static


@dataclass(frozen=True)
class ModelShape:
    """Transformer sizes the cost model needs."""

    name: str
    n_layer: int
    d_model: int
    n_head: int
    d_ff: int
    n_kv_head: int
    vocab: int
    elem_bytes: int = 2

    @property
    def d_kv(self) -> int:
        return self.n_kv_head * (self.d_model // self.n_head)


LLAMA_13B = ModelShape("Llama-13B", n_layer=40, d_model=5120, n_head=40, d_ff=13824, n_kv_head=40, vocab=32000)


@dataclass(frozen=True)
class Efficiency:
    """The fractions of the GPU's dense bf16 peak the kernels reach: assumptions of this model, not hardware.
    Change them and the simulated speed-ups change."""

    gemm: float = 0.60
    """Of the linear layers' GEMMs."""
    attention: float = 0.45
    """Of the attention kernels."""

    def __post_init__(self):
        for name in ("gemm", "attention"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1:
                raise ValueError(f"Efficiency {name}={v!r} is not allowed; allowed: a fraction in (0, 1]")


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


def group_times(tokens: int, attn_work: float, cp: int, layers: int, shape: ModelShape, hw: Cluster,
                recompute: bool = True, eff: Efficiency = Efficiency()) -> dict[str, float]:
    """Forward and backward seconds of one CP group on one stage (see the module docstring), and their parts."""
    d, dkv, peak = shape.d_model, shape.d_kv, hw.gpu.bf16_flops
    link = hw.intra if cp <= hw.gpus_per_node else hw.inter
    linear = 2 * tokens * (2 * d * d + 2 * d * dkv + 3 * d * shape.d_ff) / (peak * eff.gemm)
    attention = 2 * d * attn_work / (peak * eff.attention)
    hop = link.seconds(2 * tokens * dkv * shape.elem_bytes)
    exposed_f = (cp - 1) * max(0.0, hop - attention / cp) if cp > 1 else 0.0
    hop_b = link.latency_s + 2 * (hop - link.latency_s)  # K/V and dK/dV in flight together
    exposed_b = ((cp - 1) * max(0.0, hop_b - 2 * attention / cp) + hop) if cp > 1 else 0.0
    fwd = layers * (linear + attention + exposed_f)
    bwd = layers * (2 * (linear + attention) + exposed_b) + (fwd if recompute else 0.0)
    compute = layers * (linear + attention) * (4 if recompute else 3)
    return {"F": fwd, "B": bwd, "compute": compute, "exposed_comm": fwd + bwd - compute}


def _stage_costs(plan: Plan, groups_of, shape: ModelShape, hw: Cluster, pp: int, recompute: bool, eff: Efficiency):
    layers = shape.n_layer // pp
    out = []
    for mb in plan.micro_batches:
        times = []
        for g in groups_of(mb):
            if not g.samples:
                continue
            tokens = sum(plan.lengths[s] for s in g.samples) // g.size
            attn = sum(plan.lengths[s] ** 2 for s in g.samples) / g.size
            times.append(group_times(tokens, attn, g.size, layers, shape, hw, recompute, eff))
        if times:
            out.append(max(times, key=lambda t: t["F"] + t["B"]))
    return out


@lru_cache(maxsize=32)
def _one_f_one_b(pp: int, m: int):
    return one_f_one_b(pp, m)


def step_time(plan: Plan, shape: ModelShape, hw: Cluster, pp: int, recompute: bool = True,
              eff: Efficiency = Efficiency()) -> dict:
    """Simulated seconds of one training step of ``plan`` on ``pp`` pipeline stages: 1F1B with each micro-batch's
    slowest group as its stage time; static plans with several replicas run them as independent pipelines."""
    if plan.kind == "static":
        starts = sorted({g.start for g in plan.micro_batches[0].groups})
        pipelines = [(lambda mb, a=a: [g for g in mb.groups if g.start == a]) for a in starts]
    else:
        pipelines = [lambda mb: mb.groups]
    results = []
    for groups_of in pipelines:
        costs = _stage_costs(plan, groups_of, shape, hw, pp, recompute, eff)
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


def model_flops(lengths: list[int], shape: ModelShape) -> float:
    """Model FLOPs of one step over sequences of ``lengths`` (forward + backward = 3x forward; no recompute,
    the usual MFU convention): per layer 2·L·(linear params) + 2·d·L² (causal attention), plus the output layer."""
    d, dkv = shape.d_model, shape.d_kv
    per_token = shape.n_layer * 2 * (2 * d * d + 2 * d * dkv + 3 * d * shape.d_ff) + 2 * d * shape.vocab
    return 3 * sum(per_token * n + shape.n_layer * 2 * d * n * n for n in lengths)


def plans_for(lengths: list[int], setup: Setup = Setup(), min_cp: int = 1) -> dict[str, Plan]:
    """The three plans ``compare`` times: static CP (the size the longest sequence needs, dp = dcp / cp), the
    toolkit's dynamic scheduler, and Megatron's rules as they are (``refill=False, max_imbalance=None``)."""
    padded = [pad_length(n, 2 * setup.dcp) for n in lengths]
    static_cp = cp_size_for(max(padded), setup.cap, min_cp, setup.dcp)
    return {"static": schedule_static(padded, setup.dcp, static_cp, setup.cap),
            "dynamic-megatron": schedule_dynamic(padded, setup.dcp, setup.cap, min_cp, refill=False,
                                                 max_imbalance=None),
            "dynamic": schedule_dynamic(padded, setup.dcp, setup.cap, min_cp)}


def compare(lengths: list[int], setup: Setup = Setup(), shape: ModelShape = LLAMA_13B, hw: Cluster = CLUSTER,
            min_cp: int = 1, plans: dict[str, Plan] | None = None, eff: Efficiency = Efficiency()) -> dict:
    """Static CP against dynamic CP (``plans_for``) on one global batch of ``lengths``: simulated step times, their
    parts, speed-ups over static and model TFLOPS/GPU. Pass ``plans`` to reuse them (e.g. across ``hw``)."""
    plans = plans or plans_for(lengths, setup, min_cp)
    flops = model_flops(lengths, shape)
    gpus = setup.pp * setup.dcp
    out = {"static_cp": plans["static"].micro_batches[0].groups[0].size, "gpus": gpus, "setup": asdict(setup),
           "hardware": hw.to_dict(), "efficiency": asdict(eff), "model": asdict(shape), "runs": {}}
    for name, plan in plans.items():
        plan.check()
        sim = step_time(plan, shape, hw, setup.pp, setup.recompute, eff)
        balance = plan.balance()
        out["runs"][name] = {**sim, "tflops_per_gpu": flops / sim["step_s"] / gpus / 1e12,
                             "micro_batches": len(plan.micro_batches), "balance_max": max(balance),
                             "balance_mean": sum(balance) / len(balance),
                             "cp_sizes": _histogram(plan.cp_sizes().values())}
    base = out["runs"]["static"]["step_s"]
    for run in out["runs"].values():
        run["speedup_vs_static"] = base / run["step_s"]
    return out


def bandwidth_sweep(plans: dict[str, Plan], gbytes_per_s: list[float], setup: Setup = Setup(),
                    shape: ModelShape = LLAMA_13B, hw: Cluster = CLUSTER,
                    eff: Efficiency = Efficiency()) -> dict[str, list[float]]:
    """Simulated speed-up of each dynamic plan over the static one for each ring link bandwidth (GB/s: the
    intra link's ``bytes_per_s`` replaced)."""
    out: dict[str, list[float]] = {name: [] for name in plans if name != "static"}
    for bw in gbytes_per_s:
        h = replace(hw, intra=replace(hw.intra, bytes_per_s=bw * 1e9))
        base = step_time(plans["static"], shape, h, setup.pp, setup.recompute, eff)["step_s"]
        for name in out:
            out[name].append(base / step_time(plans[name], shape, h, setup.pp, setup.recompute, eff)["step_s"])
    return out


def _histogram(values) -> dict[int, int]:
    out: dict[int, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return dict(sorted(out.items()))
