"""Vocabulary parallelism's cost model: every pass as (FLOPs, bytes) ops, a roofline per op, summed per stage.

For settings the CPU machines cannot hold (PP = 8, V = 256k, sequences of 4096): ``pass_ops`` writes each pass
of the baseline layout (embedding on stage 0, head on stage p-1) and of vocabulary parallelism (S, T and the
input layer on every rank; ``toolkit.pipeline.vocab_parallel``) as ops; ``op_time`` bounds each op by compute
or memory on a cluster's GPU (``toolkit.runtime.cluster``: its bf16 peak, HBM bandwidth and launch cost) at
the fractions of those peaks its kernels reach (``Efficiency``, an assumption); ``stage_costs`` gives per-stage
seconds of one micro-batch, the simulator's input (``vocab_parallel.simulate_layouts``), with the collectives
the vocabulary passes wait on at α + bytes/β of the link the p stages span. A simulation input, not a
measurement.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from toolkit.runtime.cluster import Cluster, Link, cluster


@dataclass(frozen=True)
class Efficiency:
    """The fractions of the GPU's peaks its kernels reach: assumptions of this model, not hardware."""

    matmul: float = 0.70
    """Of the dense bf16 peak, on matmuls."""
    hbm: float = 0.80
    """Of the HBM bandwidth, on elementwise ops."""

    def __post_init__(self):
        for name in ("matmul", "hbm"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1:
                raise ValueError(f"Efficiency {name}={v!r} is not allowed; allowed: a fraction in (0, 1]")


ACHIEVED = Efficiency(matmul=1.0, hbm=1.0)
"""For a machine whose figures are already achieved rates (``from_rates``)."""


def from_rates(name: str, matmul_flops: float, mem_bw: float, op_overhead_s: float, link_bytes_per_s: float,
               link_latency_s: float = 10e-6) -> Cluster:
    """A machine described by what it achieves (a CPU calibrated by micro-benchmarks), as the cluster this model
    reads: a GPU of ``matmul_flops`` FLOP/s and ``mem_bw`` bytes/s with ``op_overhead_s`` per op, and an intra
    link of ``link_bytes_per_s``; its other parts are the a100-ib200 preset's, which this model does not read.
    Use it with ``ACHIEVED``."""
    base = cluster("a100-ib200")
    gpu = dataclasses.replace(base.gpu, name=name, bf16_flops=matmul_flops, hbm_bytes_per_s=mem_bw,
                              launch_s=op_overhead_s, source="achieved rates (calibrated or assumed), not a datasheet")
    return cluster(base, name=name, gpu=gpu, intra=Link(f"{name}'s link", link_bytes_per_s, link_latency_s,
                                                        "assumed"))


@dataclass(frozen=True)
class Workload:
    """One micro-batch through a GPT: the sizes the cost model needs."""

    n_layer: int
    d_model: int
    d_ff: int
    vocab_size: int
    seq_len: int
    micro_batch: int = 1
    act_bytes: int = 2  # bf16 activations and weights (4 on this CPU: fp32)
    logit_bytes: int = 4  # the softmax runs in fp32

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.seq_len

    def params(self) -> int:
        D = self.d_model
        layer = 4 * D * D + 2 * D * self.d_ff + 4 * D + self.d_ff + D + 4 * D  # weights, biases, 2 LayerNorms
        return self.n_layer * layer + 2 * self.vocab_size * D + self.seq_len * D + 2 * D  # untied in/out tables


def _mm(M: int, K: int, N: int, e: int) -> tuple[float, float]:
    """(FLOPs, bytes) of [M,K] @ [K,N]."""
    return 2.0 * M * K * N, float(M * K + K * N + M * N) * e


def _ew(elements: int, passes: float, e: int) -> tuple[float, float]:
    """(FLOPs, bytes) of an elementwise op touching ``elements`` ``passes`` times (reads + writes)."""
    return float(elements) * passes, float(elements) * passes * e


def pass_ops(w: Workload, p: int) -> dict[str, list[tuple[float, float]]]:
    """Every pass of the two layouts as a list of (FLOPs, bytes) ops, for one micro-batch.

    layer_f/layer_b: one transformer layer (attention counted as flash: causal pairs, no score matrix).
    embed_f/embed_b, head_f/head_b: the whole vocabulary on one stage (baseline).
    input_f/input_b, s1/s2, t1/t2: one rank's share under vocabulary parallelism (s2/t2 = Algorithm 2).
    """
    N, D, Fd, V, e, le = w.tokens, w.d_model, w.d_ff, w.vocab_size, w.act_bytes, w.logit_bytes
    Vp = V // p
    pairs = w.micro_batch * w.seq_len * (w.seq_len + 1) / 2
    attn_f = (4.0 * D * pairs, 4.0 * N * D * e)
    layer_f = [_ew(N * D, 2, e), _mm(N, D, 3 * D, e), attn_f, _mm(N, D, D, e), _ew(N * D, 3, e),
               _ew(N * D, 2, e), _mm(N, D, Fd, e), _ew(N * Fd, 2, e), _mm(N, Fd, D, e), _ew(N * D, 3, e)]
    layer_b = []
    for (M, K, Nn) in ((N, D, 3 * D), (N, D, D), (N, D, Fd), (N, Fd, D)):
        layer_b += [_mm(M, Nn, K, e), _mm(Nn, M, K, e)]  # dX and dW
    layer_b += [(2.5 * attn_f[0], 2.5 * attn_f[1]), _ew(N * D, 4, e), _ew(N * D, 4, e), _ew(N * Fd, 3, e),
                _ew(N * D, 6, e)]
    head_f = [_ew(N * D, 2, e), _mm(N, D, V, e), _ew(N * V, 4, le)]  # ln_f, logits, max/exp/sum/log-softmax
    head_b = [_ew(N * V, 3, le), _mm(N, V, D, e), _mm(V, N, D, e), _ew(N * D, 4, e)]
    return {
        "layer_f": layer_f, "layer_b": layer_b,
        "embed_f": [_ew(N * D, 3, e)], "embed_b": [_ew(N * D, 3, e)],
        "head_f": head_f, "head_b": head_b,
        "input_f": [_ew(N * D, 4, e)], "input_b": [_ew(N * D, 3, e)],
        "s1": [_mm(N, D, Vp, e), _ew(N * Vp, 4, le)],
        "s2": [_mm(N, D, Vp, e), _ew(N * Vp, 4, le), _mm(N, Vp, D, e), _ew(N * D, 2, e)],
        "t1": [_ew(N * Vp, 3, le), _mm(Vp, N, D, e), _mm(N, Vp, D, e)],
        "t2": [_ew(N * Vp, 3, le), _mm(Vp, N, D, e)],
    }


def op_time(ops: list[tuple[float, float]], hw: Cluster, eff: Efficiency = Efficiency()) -> float:
    """Seconds of a list of ops on ``hw``'s GPU: each op bound by compute or by memory (roofline) at the
    achieved fractions ``eff`` of the peaks, plus a kernel launch."""
    flops, hbm = hw.gpu.bf16_flops * eff.matmul, hw.gpu.hbm_bytes_per_s * eff.hbm
    return sum(max(f / flops, b / hbm) + hw.gpu.launch_s for f, b in ops)


def stage_link(hw: Cluster, p: int) -> Link:
    """The link the collectives among the ``p`` stages take: inside a node if they fit in one."""
    return hw.intra if p <= hw.gpus_per_node else hw.inter


def stage_costs(w: Workload, p: int, hw: Cluster, layout: str, algorithm: int = 2,
                eff: Efficiency = Efficiency()) -> list[dict[str, float]]:
    """Per-stage seconds of one micro-batch on ``hw`` at ``eff``: F and B (transformer layers plus whatever
    vocabulary work the layout puts inside them), S and T (vocabulary passes, 0 for the baseline), and the comm
    latencies the vocabulary passes wait on (broadcast of X, C0, dX; input all-reduce and dE broadcast).

    ``layout``: ``"baseline"`` (embedding on stage 0, head + loss on stage p-1) or ``"vocab"``.
    """
    if layout not in ("baseline", "vocab"):
        raise ValueError(f"layout={layout!r}; allowed: 'baseline', 'vocab'")
    if w.n_layer % p:
        raise ValueError(f"n_layer={w.n_layer} must be divisible by the {p} stages")
    ops = pass_ops(w, p)
    t = {k: op_time(v, hw, eff) for k, v in ops.items()}
    link = stage_link(hw, p)
    per = w.n_layer // p
    N, D, e = w.tokens, w.d_model, w.act_bytes
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
    fl = {k: sum(f for f, _ in v) for k, v in ops.items()}
    per = w.n_layer // p
    out = []
    for r in range(p):
        x = per * (fl["layer_f"] + fl["layer_b"])
        if layout == "baseline":
            x += (fl["embed_f"] + fl["embed_b"]) * (r == 0) + (fl["head_f"] + fl["head_b"]) * (r == p - 1)
        else:
            x += fl[f"s{algorithm}"] + fl[f"t{algorithm}"] + fl["input_f"] + fl["input_b"]
        out.append(x)
    return out
