"""What compressing data-parallel traffic saves at a scale the laptop cannot run: a cost model (lessons 05, 06).

A job of ``gpus`` = dp·tp·pp GPUs; each GPU holds Ψ' = Ψ/(tp·pp) of the model's parameters and, every step,
computes, then synchronises its gradients with its dp peers. Per GPU and per step::

    step     = compute + DP traffic + codec + optimizer        (nothing overlapped: the lessons' runs overlap nothing)
    compute  = the GPU's kernels for this replica's tokens per step, at their achieved rates (bubble left out;
               ``toolkit.models.catalog.train_seconds``)
    traffic  = Σ over calls of NCCL's time for the call        (toolkit.runtime.collectives.group_seconds: its op,
                                                                bytes and the ranks of the group it spans)
      plain all-reduce        1 call      2(dp−1)/dp · Ψ' · g
      PowerSGD at rank r      3 calls     2(dp−1)/dp · g · (vectors | Σ n·r | Σ m·r)   over this GPU's matrices
      sharded, baseline       RS  intra (L−1)/L · Ψ' · g,  inter (A−1)/A · Ψ'/L · g;  AG (dp−1)/dp · Ψ' · 2
      SDP4Bit                 RS  intra (L−1)/L · Ψ' · (1 + 4/g8),  inter (A−1)/A · Ψ'/L · (1/2 + 4/g4);
                              AG  (dp−1)/dp · Ψ' · (1/2 + 4/gw)
    codec, optimizer = seconds per element of Ψ' (the codec: each scheme's own), measured on the emulated cluster
               in the workload-matched mode

g: bytes per gradient element on the wire (2: bf16, as the emulated cluster times it; Megatron-LM reduces bf16
models' gradients in fp32, g = 4). L: ranks of one DP group per node (Megatron places tp innermost, then dp),
A = dp / L nodes; a DP group of one node rides the intra link, else the all-reduce and the all-gather ride the
inter-node one. A GPU's matrices: a Llama-style layer's (q, k, v, o, gate, up, down), split by tp (column-parallel
on their rows, row-parallel on their columns), L/pp layers of them, and the embeddings (Ψ minus the layers) as
matrices of width ``hidden``; norms and biases are vectors (sent whole).

This is an extrapolation: each number it gives is labelled so where shown. Its traffic uses the emulated cluster's
link model, and the tests check it, at the lessons' own size, against the link time their emulated runs measured.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable

from toolkit.comm.edgc import step_elements
from toolkit.comm.sdp4bit import SDPConfig
from toolkit.models.catalog import Workload, train_seconds
from toolkit.runtime.collectives import group_seconds
from toolkit.runtime.cluster import Cluster, Link


@dataclass(frozen=True)
class Layout:
    """How a job sits on the cluster: ``gpus`` = dp · tp · pp, and the tokens one data-parallel replica
    processes per optimizer step."""

    gpus: int
    tp: int
    pp: int
    tokens: int

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    def check(self, hw: Cluster) -> "Layout":
        for name in ("gpus", "tp", "pp", "tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Layout {name}={v!r} is not allowed; allowed: an int >= 1")
        if self.gpus % (self.tp * self.pp):
            raise ValueError(f"Layout tp·pp = {self.tp * self.pp} must divide gpus={self.gpus}")
        if self.tp > hw.gpus_per_node:
            raise ValueError(f"Layout tp={self.tp} exceeds the {hw.gpus_per_node} GPUs of one node")
        return self

    def per_node(self, hw: Cluster) -> int:
        """L: ranks of one DP group on each node (``hw.ranks_per_node`` GPUs of a node in use, all if None)."""
        return max(1, min(self.dp, (hw.ranks_per_node or hw.gpus_per_node) // self.tp))

    def dp_link(self, hw: Cluster) -> Link:
        """The link a DP collective over all dp ranks rides."""
        return hw.intra if self.per_node(hw) >= self.dp else hw.inter


def gpu_matrices(w: Workload, tp: int, pp: int) -> tuple[list[tuple[int, int]], int]:
    """(matrix shapes, vector elements) one GPU holds (see the module docstring)."""
    m = w.model
    h, f = m.hidden, m.ffn
    columns = [(h, h), (m.kv_dim, h), (m.kv_dim, h)] + [(f, h)] * (m.mlp_matrices - 1)  # q, k, v; gate, up (or fc1)
    rows = [(h, h), (h, f)]  # o, down (or fc2)
    layer = [(n // tp, k) for n, k in columns] + [(n, k // tp) for n, k in rows]
    vectors = 2 * h  # two norms per layer
    per_layer = sum(n * k for n, k in layer) * tp + vectors
    rest = max(w.params - w.layers * per_layer, 0)  # embeddings and head (and an MoE's other experts)
    layers = w.layers // pp
    shapes = layer * layers + ([(int(rest / (h * tp * pp)), h)] if rest else [])
    return shapes, vectors * layers


def allreduce_bytes(elements: float, dp: int, g: float) -> float:
    """Bytes one rank sends in a ring all-reduce of ``elements`` (the ledger's convention)."""
    return 2 * (dp - 1) / dp * elements * g


@dataclass(frozen=True)
class Call:
    """One collective of a DP step: its op, the bytes one rank sends, and its group (``n`` ranks ``stride``
    apart in the job's rank order)."""

    op: str
    bytes: float
    n: int
    stride: int


def traffic_s(calls: list[Call], hw: Cluster) -> float:
    """Seconds on the wire of a sequence of calls, one after the other, each at NCCL's time on ``hw``."""
    return sum(group_seconds(hw, c.op, c.n, c.bytes, c.stride) for c in calls if c.bytes > 0)


def compute_s(w: Workload, lay: Layout, hw: Cluster) -> float:
    """One replica's forward and backward on one of its GPUs: its share of the model's kernels for the replica's
    ``lay.tokens`` tokens per step, in sequences of ``w.seq_len``, at the GPU's achieved rates."""
    return train_seconds(w.model, hw.gpu, lay.tokens / w.seq_len, w.seq_len, lay.tp, lay.pp)["total"]


def dp_calls(scheme: str, w: Workload, lay: Layout, hw: Cluster, rank: int | None = None, g: float = 2.0,
             sdp: SDPConfig = SDPConfig()) -> list[Call]:
    """Every DP call of one step on one GPU, for ``scheme``: "allreduce", "powersgd" (at ``rank``), "sharded"
    (bf16 weights, gradients at ``g`` bytes) or "sdp4bit". Megatron's placement: tp innermost, then dp."""
    dp, tp = lay.dp, lay.tp
    elements = w.params / (lay.tp * lay.pp)
    if dp == 1:
        return []
    if scheme == "allreduce":
        return [Call("all_reduce", allreduce_bytes(elements, dp, g), dp, tp)]
    if scheme == "powersgd":
        if rank is None:
            raise ValueError("scheme='powersgd' needs the rank")
        shapes, vectors = gpu_matrices(w, lay.tp, lay.pp)
        unc, p, q = step_elements(shapes, rank)
        return [Call("all_reduce", allreduce_bytes(e, dp, g), dp, tp) for e in (unc + vectors, p, q)]
    L = lay.per_node(hw)
    A = dp // L
    if scheme == "sharded":
        return [Call("reduce_scatter", (L - 1) / L * elements * g, L, tp),
                Call("reduce_scatter", (A - 1) / A * elements / L * g, A, tp * L),
                Call("all_gather", (dp - 1) / dp * elements * 2, dp, tp)]
    if scheme == "sdp4bit":
        intra = sdp.intra_bits / 8 + 4 / sdp.intra_group
        inter = sdp.inter_bits / 8 + 4 / sdp.inter_group
        weights = 4 / 8 + 4 / sdp.weight_group
        return [Call("reduce_scatter", (L - 1) / L * elements * intra, L, tp),
                Call("reduce_scatter", (A - 1) / A * elements / L * inter, A, tp * L),
                Call("all_gather", (dp - 1) / dp * elements * weights, dp, tp)]
    raise ValueError(f"scheme={scheme!r} is not allowed; allowed: allreduce, powersgd, sharded, sdp4bit")


def step(scheme: str, w: Workload, lay: Layout, hw: Cluster, codec: float, rank: int | None = None,
         g: float = 2.0, optimizer: float = 0.0, compute: float | None = None) -> dict[str, float]:
    """Seconds of one step of ``scheme`` on one GPU, by term: ``compute_s`` (``compute`` if given, else
    ``compute_s(...)``), ``traffic_s``, ``codec_s`` and ``optimizer_s`` (``codec`` and ``optimizer``: seconds per
    element of Ψ'), ``sync_s`` = traffic + codec, and ``step_s``, their sum."""
    lay.check(hw)
    for name, v in (("codec", codec), ("optimizer", optimizer)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{name} (seconds per element) must be a finite number >= 0, got {v!r}")
    elements = w.params / (lay.tp * lay.pp)
    out = {"compute_s": compute_s(w, lay, hw) if compute is None else compute,
           "traffic_s": traffic_s(dp_calls(scheme, w, lay, hw, rank, g), hw),
           "codec_s": codec * elements, "optimizer_s": optimizer * elements}
    out["sync_s"] = out["traffic_s"] + out["codec_s"]
    out["step_s"] = out["compute_s"] + out["sync_s"] + out["optimizer_s"]
    return out


def with_inter(hw: Cluster, bytes_per_s: float) -> Cluster:
    """``hw`` with its inter-node link at ``bytes_per_s`` per GPU (its α kept)."""
    return dataclasses.replace(hw, inter=dataclasses.replace(hw.inter, bytes_per_s=bytes_per_s,
                                                             name=f"{bytes_per_s / 1e9:g} GB/s inter-node"))


def inter_bandwidth_for(speedup: float, ratio: Callable[[Cluster], float], hw: Cluster, low: float = 1e8,
                        high: float = 1e13) -> float | None:
    """The inter-node bytes/s per GPU at which ``ratio(cluster)`` (a baseline's step time over a technique's, on
    ``hw`` with only its inter link changed; it falls as the link gets faster) equals ``speedup``: bisection on a
    log scale between ``low`` and ``high``. None when no bandwidth in between reaches it."""
    if not ratio(with_inter(hw, low)) >= speedup:
        return None
    if ratio(with_inter(hw, high)) >= speedup:
        return high
    for _ in range(60):
        mid = math.sqrt(low * high)
        low, high = (mid, high) if ratio(with_inter(hw, mid)) >= speedup else (low, mid)
    return low
