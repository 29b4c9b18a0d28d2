"""A memory and communication model for choosing DP / TP / PP / ZeRO — a cost model, not a measurement.

Per GPU, for a dense decoder with Ψ parameters, L layers, hidden h, a heads, sequence s,
micro-batch b, m micro-batches per step, on N = dp·tp·pp GPUs (bytes, bf16 compute, fp32 Adam)::

    weights      2Ψ/(tp·pp)          / dp if ZeRO-3
    grads        2Ψ/(tp·pp)          / dp if ZeRO-2 or 3
    optimizer   12Ψ/(tp·pp)          / dp if ZeRO-1, 2 or 3      (fp32 master + m + v)
    activations  s·b·h·(34 + 5·a·s/h)/tp per layer (Korthikanti et al. 2022, TP with sequence parallel),
                 x L/pp layers x pp in-flight micro-batches on the first stage of 1F1B
                 (2·s·b·h per layer with full recompute)

    time = compute / (1 - bubble) + exposed communication
      compute   = 6Ψ·tokens / (N · peak_flops · mfu)        (x 4/3 with full recompute)
      bubble    = (pp-1)/(m+pp-1)                           (1F1B)
      TP comm   = 4 all-reduces of s·b·h·2 bytes per layer per micro-batch (fwd+bwd), on the intra-node link
      DP comm   = gradient all-reduce 2(dp-1)/dp · 2Ψ/(tp·pp) bytes (ZeRO-3: x1.5), on the inter-node link
                  when dp spans nodes; a fraction ``dp_overlap`` hides behind backward
      PP comm   = 2·m·s·b·h·2 bytes per stage boundary, latency-bound, ignored in time

``validate_memory_model`` checks the parameter/gradient/optimizer formulas against the bytes
measured by the ZeRO run of lesson 00 (fp32 weights there: 4+4+8 bytes per parameter).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class Workload:
    """The model and batch to place."""
    params: float = 7e9
    """Ψ, total parameters."""
    layers: int = 32
    hidden: int = 4096
    heads: int = 32
    seq_len: int = 4096
    micro_batch: int = 1
    global_batch: int = 512
    """Sequences per optimizer step (= dp · micro_batch · micro-batches)."""
    recompute: bool = False
    """Full activation recomputation."""


@dataclass
class Cluster:
    """The hardware."""
    gpus: int = 64
    gpus_per_node: int = 8
    memory_gb: float = 80.0
    peak_tflops: float = 989.0
    """Dense bf16 peak per GPU (H100 SXM)."""
    mfu: float = 0.45
    """Achieved fraction of peak for compute."""
    intra_gbps: float = 450.0
    """Per-GPU intra-node bus bandwidth in GB/s (NVLink)."""
    inter_gbps: float = 50.0
    """Per-GPU inter-node bandwidth in GB/s (400 Gb/s NIC)."""
    dp_overlap: float = 0.7
    """Fraction of the DP all-reduce hidden behind backward."""


def memory_per_gpu(w: Workload, dp: int, tp: int, pp: int, zero: int, bytes_weight: int = 2, bytes_grad: int = 2,
                   bytes_optim: int = 12) -> dict[str, float]:
    """Bytes per GPU by category (see the module docstring)."""
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero={zero} is not allowed; allowed: 0, 1, 2, 3")
    shard = w.params / (tp * pp)
    act_layer = (2 * w.seq_len * w.micro_batch * w.hidden if w.recompute else
                 w.seq_len * w.micro_batch * w.hidden * (34 + 5 * w.heads * w.seq_len / w.hidden) / tp)
    return {"weights": bytes_weight * shard / (dp if zero >= 3 else 1),
            "grads": bytes_grad * shard / (dp if zero >= 2 else 1),
            "optimizer": bytes_optim * shard / (dp if zero >= 1 else 1),
            "activations": act_layer * (w.layers / pp) * pp}


def step_time(w: Workload, c: Cluster, dp: int, tp: int, pp: int, zero: int) -> dict[str, float]:
    """Seconds per optimizer step split into compute, bubble, exposed TP and exposed DP communication."""
    micro_batches = max(w.global_batch // (dp * w.micro_batch), 1)
    tokens = w.global_batch * w.seq_len
    compute = 6 * w.params * tokens * (4 / 3 if w.recompute else 1) / (c.gpus * c.peak_tflops * 1e12 * c.mfu)
    bubble = (pp - 1) / (micro_batches + pp - 1)
    tp_link = c.intra_gbps if tp <= c.gpus_per_node else c.inter_gbps
    tp_bytes = 4 * (w.layers / pp) * micro_batches * w.seq_len * w.micro_batch * w.hidden * 2 * 2 * (tp - 1) / tp
    tp_comm = tp_bytes / (tp_link * 1e9) if tp > 1 else 0.0
    dp_link = c.intra_gbps if dp * tp * pp <= c.gpus_per_node else c.inter_gbps
    dp_bytes = 2 * (dp - 1) / dp * 2 * w.params / (tp * pp) * (1.5 if zero == 3 else 1.0)
    dp_comm = dp_bytes / (dp_link * 1e9) * (1 - c.dp_overlap) if dp > 1 else 0.0
    busy = compute + tp_comm
    return {"compute": compute, "bubble": busy / (1 - bubble) - busy, "tp_comm": tp_comm, "dp_comm": dp_comm,
            "total": busy / (1 - bubble) + dp_comm, "micro_batches": micro_batches}


def plan(w: Workload, c: Cluster) -> list[dict]:
    """Every (dp, tp, pp, zero) that fits, fastest first; configurations that do not fit come last."""
    if c.gpus < 1 or c.gpus_per_node < 1:
        raise ValueError("gpus and gpus_per_node must be >= 1")
    rows = []
    for tp in (t for t in (1, 2, 4, 8, 16) if t <= c.gpus and w.heads % t == 0):
        for pp in (p for p in (1, 2, 4, 8, 16, 32) if p <= w.layers and w.layers % p == 0):
            if c.gpus % (tp * pp):
                continue
            dp = c.gpus // (tp * pp)
            if w.global_batch % (dp * w.micro_batch):
                continue
            for zero in (0, 1, 2, 3):
                mem = memory_per_gpu(w, dp, tp, pp, zero)
                t = step_time(w, c, dp, tp, pp, zero)
                total_gb = sum(mem.values()) / 1e9
                rows.append({"dp": dp, "tp": tp, "pp": pp, "zero": zero, "memory_gb": total_gb,
                             "fits": total_gb <= c.memory_gb * 0.9, "step_s": t["total"],
                             "tokens_per_s": w.global_batch * w.seq_len / t["total"],
                             **{f"mem_{k}_gb": v / 1e9 for k, v in mem.items()},
                             **{f"t_{k}_s": v for k, v in t.items() if k != "total"}})
    return sorted(rows, key=lambda r: (not r["fits"], r["step_s"]))


def validate_memory_model(n_params: int, dp: int, measured: dict[str, dict[str, int]]) -> list[dict]:
    """Compare the model's bytes (fp32 weights and grads, AdamW m+v: 4/4/8 bytes) with measured bytes per rank.

    ``measured`` maps a variant name (``ddp``, ``zero1``, ``zero2``, ``zero3``) to bytes by category
    (``params``, ``grads``, ``optim``). Padding of flat shards makes the measurement slightly larger.
    """
    w = Workload(params=n_params)
    rows = []
    for variant, got in measured.items():
        zero = 0 if variant == "ddp" else int(variant[-1])
        want = memory_per_gpu(w, dp, 1, 1, zero, bytes_weight=4, bytes_grad=4, bytes_optim=8)
        for ours, theirs in (("weights", "params"), ("grads", "grads"), ("optimizer", "optim")):
            rows.append({"variant": variant, "category": ours, "model_bytes": want[ours],
                         "measured_bytes": got.get(theirs, 0),
                         "ratio": got.get(theirs, 0) / want[ours] if want[ours] else None})
    return rows


def as_dicts(w: Workload, c: Cluster) -> dict:
    return {"workload": asdict(w), "cluster": asdict(c)}
