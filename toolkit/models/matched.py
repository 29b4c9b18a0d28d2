"""The workload-matched mode's arithmetic: the factors that time a toy's ops as a real model's.

A toy op and its real counterpart are each summed up as ``{"gemm_flops", "wire_bytes"}``; the emulator's
``scaled(flops=, bytes=)`` then counts the toy's FLOPs and bytes as the real one's (``matched_scales``). GEMMs
grow as M·K·N and activations as M·K, so their quotient moves the compute-to-communication balance from the
toy's to the real workload's. The real side comes from ``toolkit.models.catalog`` (SwiGLU counted: three
matrices); the toy GPT's MLP is a plain two-matrix GELU (``gated=False``).

Where the proportions differ (attention, which grows as s²·d, against the GEMMs' s·d²; the kernel counts and the
fixed costs, which do not scale), a matched toy is an approximation; timing the real shapes is exact.
"""
from __future__ import annotations

from .catalog import ModelSpec


def layer_op(spec: ModelSpec, tokens: int, tp: int = 1, elem: int = 2) -> dict[str, float]:
    """One of ``spec``'s layers on ``tokens`` tokens (one rank of ``tp``): ``gemm_flops`` of its forward GEMMs
    (the active experts' for an MoE) and ``wire_bytes`` of the activation a pipeline stage hands on."""
    return {"gemm_flops": spec.layer_gemm_flops(tokens, tp), "wire_bytes": float(tokens * spec.hidden * elem)}


def dense_layer_op(tokens: int, hidden: int, ffn: int, elem: int = 2, gated: bool = False) -> dict[str, float]:
    """A dense layer of width ``hidden`` and MLP ``ffn`` (the toy's: ``gated=False``, two matrices), forward:
    2·M·(4·D² + m·D·F) with m = 2 or 3, and the activation it hands on, M·D·elem."""
    mlp = (3 if gated else 2) * hidden * ffn
    return {"gemm_flops": 2.0 * tokens * (4 * hidden * hidden + mlp), "wire_bytes": float(tokens * hidden * elem)}


def tp_mlp_op(tokens: int, hidden: int, ffn: int, tp: int, elem: int = 2, gated: bool = False) -> dict[str, float]:
    """fc1's all-gather + GEMM on one rank of a sequence-parallel TP group: ``gemm_flops`` = 2·M·D·F'/tp with
    F' = F, or 2F for a gated MLP whose gate and up projections are one fused GEMM; ``wire_bytes`` =
    (tp−1)/tp·M·D·elem (fc2's GEMM + reduce-scatter moves the same bytes)."""
    width = 2 * ffn if gated else ffn
    return {"gemm_flops": 2.0 * tokens * hidden * width / tp, "wire_bytes": (tp - 1) / tp * tokens * hidden * elem}


def moe_layer_op(tokens: int, hidden: int, ffn: int, top_k: int, ep: int, elem: int = 2,
                 gated: bool = False) -> dict[str, float]:
    """One rank's MoE layer under expert parallelism over ``ep`` ranks, its ``tokens`` balanced: ``gemm_flops``
    of the experts it runs (each routed token: 2·m·D·F, m = 2 or 3 matrices) and ``wire_bytes`` of one dispatch
    all-to-all ((ep−1)/ep of its ``tokens · top_k`` rows of D leave the rank; the combine moves as many back)."""
    matrices = 3 if gated else 2
    return {"gemm_flops": 2.0 * matrices * tokens * top_k * hidden * ffn,
            "wire_bytes": (ep - 1) / ep * tokens * top_k * hidden * elem}


def spec_moe_op(spec: ModelSpec, tokens: int, ep: int, elem: int = 2) -> dict[str, float]:
    """``moe_layer_op`` of ``spec``'s MoE layer."""
    return moe_layer_op(tokens, spec.hidden, spec.ffn, spec.top_k, ep, elem, spec.gated)


def dp_grad_op(params: float, tokens: int, elem: int = 2) -> dict[str, float]:
    """One data-parallel rank's backward and the gradient its all-reduce carries: ``gemm_flops`` = 4·Ψ·tokens (dX
    and dW, twice the forward's 2·Ψ·tokens) and ``wire_bytes`` = Ψ·elem (the gradient; a ring all-reduce sends
    2(n−1)/n of it, the same factor for a toy and its real model)."""
    return {"gemm_flops": 4.0 * params * tokens, "wire_bytes": float(params * elem)}


def matched_scales(toy: dict[str, float], real: dict[str, float]) -> dict[str, float]:
    """The emulator's ``scaled(flops=, bytes=)`` factors that time a toy op as its real counterpart: real / toy
    GEMM FLOPs and real / toy activation bytes."""
    return {"flops": real["gemm_flops"] / toy["gemm_flops"], "bytes": real["wire_bytes"] / toy["wire_bytes"]}


def dp_phase_scales(toy_params: float, toy_step_flops: float, toy_tokens: int, toy_hidden: int,
                    real: ModelSpec, tokens: int | None = None) -> dict[str, dict[str, float]]:
    """``scaled(...)`` factors that time a data-parallel toy step as ``real``'s on ``tokens`` tokens per rank (one
    sequence of its own length by default), for its two kinds of ops. ``"compute"``, the forward and backward:
    FLOPs so that the toy's (``toy_step_flops``, as the emulator counted them) count 6·Ψ·T, bytes as its
    activations (T·hidden against the toy's ``toy_tokens · toy_hidden``). ``"gradient"``, every op that walks the
    gradient once or a few times (its sync, a compressor's codec, the optimizer): FLOPs and bytes both x Ψ / toy
    parameters."""
    t = tokens or real.seq_len
    grad = real.params() / toy_params
    return {"compute": {"flops": 6 * real.params() * t / toy_step_flops,
                        "bytes": t * real.hidden / (toy_tokens * toy_hidden)},
            "gradient": {"flops": grad, "bytes": grad}}


def op_times(op: dict[str, float], cluster, link: str = "intra") -> dict[str, float]:
    """One op on a ``toolkit.runtime.cluster.Cluster``: its GEMM at the GPU's plateau (a shape-less GEMM: the
    efficiency model's ``gemm``) plus the kernel's fixed cost, one point-to-point transfer of its bytes on
    ``link`` (its fastest protocol), and their ratio (> 1: the GEMM is long enough to hide the transfer)."""
    from toolkit.runtime.efficiency import Kernel, kernel_seconds
    g = cluster.gpu
    gemm = kernel_seconds(Kernel("gemm", op["gemm_flops"], 0.0), g.bf16_flops, g.hbm_bytes_per_s, g.sms, g.efficiency)
    comm = getattr(cluster, link).seconds(op["wire_bytes"])
    return {"gemm_s": gemm, "comm_s": comm, "ratio": gemm / comm}
