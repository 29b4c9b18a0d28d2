"""Vocabulary parallelism's cost model: every pass as kernels, each timed by the GPU's efficiency model, summed per
stage.

For settings the CPU machines cannot hold (PP = 8, V = 256k, sequences of 4096): ``pass_ops`` writes each pass
of the baseline layout (embedding on stage 0, head on stage p-1) and of vocabulary parallelism (S, T and the
input layer on every rank; ``toolkit.pipeline.vocab_parallel``) as ``toolkit.runtime.efficiency.Kernel``s of the
model (``toolkit.models.catalog``); ``op_time`` times them on a cluster's GPU at its achieved rates (the one
efficiency model the emulated cluster uses too); ``stage_costs`` gives per-stage seconds of one micro-batch, the
simulator's input (``vocab_parallel.simulate_layouts``), with the collectives the vocabulary passes wait on on
the link the p stages span. A simulation input, not a measurement.
"""
from __future__ import annotations

import dataclasses

from toolkit.models.catalog import ModelSpec, Workload, gpt
from toolkit.runtime.cluster import Cluster, Link, cluster
from toolkit.runtime.efficiency import PEAK, Kernel, attention, gemm, kernel_seconds, memory

__all__ = ["Workload", "gpt", "from_rates", "pass_ops", "op_time", "stage_costs", "stage_flops", "stage_link"]


def from_rates(name: str, matmul_flops: float, mem_bw: float, op_overhead_s: float, link_bytes_per_s: float,
               link_latency_s: float = 10e-6) -> Cluster:
    """A machine described by what it achieves (a CPU calibrated by micro-benchmarks), as the cluster this model
    reads: a GPU of ``matmul_flops`` FLOP/s and ``mem_bw`` bytes/s, every kernel reaching them (``PEAK``) with
    ``op_overhead_s`` of fixed cost, and an intra link of ``link_bytes_per_s``; its other parts are the
    a100-ib200 preset's, which this model does not read."""
    base = cluster("a100-ib200")
    gpu = dataclasses.replace(base.gpu, name=name, bf16_flops=matmul_flops, hbm_bytes_per_s=mem_bw, sms=1,
                              efficiency=dataclasses.replace(PEAK, kernel_min_s=op_overhead_s),
                              source="achieved rates (calibrated or assumed), not a datasheet")
    return cluster(base, name=name, gpu=gpu, intra=Link(f"{name}'s link", link_bytes_per_s, link_latency_s,
                                                        "assumed"))


def pass_ops(w: Workload, p: int, elem: int = 2, logit_elem: int = 4) -> dict[str, list[Kernel]]:
    """Every pass of the two layouts as kernels, for one micro-batch of ``w`` (``elem`` bytes per activation and
    weight, ``logit_elem`` per logit: the softmax runs in fp32).

    layer_f/layer_b: one transformer layer (``catalog.layer_kernels``: flash attention, causal).
    embed_f/embed_b, head_f/head_b: the whole vocabulary on one stage (baseline).
    input_f/input_b, s1/s2, t1/t2: one rank's share under vocabulary parallelism (s2/t2 = Algorithm 2).
    """
    from toolkit.models.catalog import layer_kernels
    m: ModelSpec = w.model
    N, D, V = w.micro_batch * w.seq_len, m.hidden, m.vocab
    Vp, e, le = V // p, elem, logit_elem
    return {
        "layer_f": layer_kernels(m, w.micro_batch, w.seq_len, elem=e),
        "layer_b": layer_kernels(m, w.micro_batch, w.seq_len, backward=True, elem=e),
        "embed_f": [memory(3 * N * D * e)], "embed_b": [memory(3 * N * D * e)],
        "head_f": [memory(2 * N * D * e), gemm(N, V, D, e), memory(4 * N * V * le)],  # ln_f, logits, softmax
        "head_b": [memory(3 * N * V * le), gemm(N, D, V, e), gemm(D, V, N, e), memory(4 * N * D * e)],
        "input_f": [memory(4 * N * D * e)], "input_b": [memory(3 * N * D * e)],
        "s1": [gemm(N, Vp, D, e), memory(4 * N * Vp * le)],
        "s2": [gemm(N, Vp, D, e), memory(4 * N * Vp * le), gemm(N, D, Vp, e), memory(2 * N * D * e)],
        "t1": [memory(3 * N * Vp * le), gemm(D, Vp, N, e), gemm(N, D, Vp, e)],
        "t2": [memory(3 * N * Vp * le), gemm(D, Vp, N, e)],
    }


def op_time(ops: list[Kernel], hw: Cluster) -> float:
    """Seconds of a list of kernels on ``hw``'s GPU, each at its achieved rate (``toolkit.runtime.efficiency``:
    the GEMM's shape, attention, HBM; the kernel's fixed cost)."""
    g = hw.gpu
    return sum(kernel_seconds(k, g.bf16_flops, g.hbm_bytes_per_s, g.sms, g.efficiency) for k in ops)


def stage_link(hw: Cluster, p: int) -> Link:
    """The link the collectives among the ``p`` stages take: inside a node if they fit in one."""
    return hw.intra if p <= hw.gpus_per_node else hw.inter


def stage_costs(w: Workload, p: int, hw: Cluster, layout: str, algorithm: int = 2, elem: int = 2) -> list[dict[str, float]]:
    """Per-stage seconds of one micro-batch on ``hw``: F and B (transformer layers plus whatever
    vocabulary work the layout puts inside them), S and T (vocabulary passes, 0 for the baseline), and the comm
    latencies the vocabulary passes wait on (broadcast of X, C0, dX; input all-reduce and dE broadcast).

    ``layout``: ``"baseline"`` (embedding on stage 0, head + loss on stage p-1) or ``"vocab"``.
    """
    if layout not in ("baseline", "vocab"):
        raise ValueError(f"layout={layout!r}; allowed: 'baseline', 'vocab'")
    if w.layers % p:
        raise ValueError(f"the model's {w.layers} layers must be divisible by the {p} stages")
    ops = pass_ops(w, p, elem)
    t = {k: op_time(v, hw) for k, v in ops.items()}
    link = stage_link(hw, p)
    per = w.layers // p
    N, D, e = w.micro_batch * w.seq_len, w.hidden, elem
    ring = 2 * (p - 1) / p
    out = []
    for r in range(p):
        f, b = per * t["layer_f"], per * t["layer_b"]
        row = {"F": f, "B": b, "S": 0.0, "T": 0.0}
        if layout == "baseline":
            if r == 0:
                row["F"] += t["embed_f"]
                row["B"] += t["embed_b"]
            if r == p - 1:
                row["F"] += t["head_f"]
                row["B"] += t["head_b"]
        else:
            row["S"] = t[f"s{algorithm}"] + t["input_f"]  # the input layer's partial embedding rides with S
            row["T"] = t[f"t{algorithm}"] + t["input_b"]
            row["bcast_x"] = link.seconds(N * D * e)
            row["c0"] = 3 * link.seconds(N * 4 * ring)
            row["dx"] = link.seconds(N * D * e * ring)
            row["input"] = link.seconds(N * D * e * ring) + link.seconds(N * D * e)
        out.append(row)
    return out


def stage_flops(w: Workload, p: int, layout: str, algorithm: int = 2) -> list[float]:
    """Training FLOPs (forward + backward) of each stage for one micro-batch."""
    ops = pass_ops(w, p)
    fl = {k: sum(op.flops for op in v) for k, v in ops.items()}
    per = w.layers // p
    out = []
    for r in range(p):
        x = per * (fl["layer_f"] + fl["layer_b"])
        if layout == "baseline":
            x += (fl["embed_f"] + fl["embed_b"]) * (r == 0) + (fl["head_f"] + fl["head_b"]) * (r == p - 1)
        else:
            x += fl[f"s{algorithm}"] + fl[f"t{algorithm}"] + fl["input_f"] + fl["input_b"]
        out.append(x)
    return out
