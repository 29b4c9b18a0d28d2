"""SDP4Bit: 4-bit communication for sharded data parallelism (Jia et al., NeurIPS 2024).

Sharded data parallelism (ZeRO / Megatron's distributed optimizer): the flat parameter vector
[N] is cut into W shards; rank r owns shard r, its fp32 master copy and its Adam moments, and
every rank keeps a full replica of the weights for forward and backward. Each step moves the
gradients in (reduce-scatter) and the weights out (all-gather); SDP4Bit makes both 4-bit::

    replica W [N] ─► forward/backward ─► g [N]
      (b) gradients, reduce-scatter  ─► mean of shard r [N/W]
            bf16:    reduce-scatter inside the node, then across nodes (bf16 on the wire)
            TLq-HS:  H32 ─► 8-bit SR ─► all-to-all inside the node ─► dequant, sum ─► 4-bit SR
                     ─► all-to-all across nodes ─► dequant, sum ─► H32/32 (once, after every sum) ─► /W
      AdamW on the fp32 master shard
      (a) weights, all-gather        ─► every rank's replica
            bf16:    all-gather the bf16 weights
            qWD:     Δ = master − W[shard] ─► 4-bit RTN, groups of 2048 ─► all-gather int4 + scales
                     ─► every rank (the owner too): W = bf16(W + deq(Δ))   (replicas stay bitwise equal;
                        the error is not lost: it is part of the next step's Δ)
            direct4: all-gather 4-bit weights themselves (the ablation the paper shows diverging)

Two-level layout, nodes A × L ranks per node, rank (a, l) = a·L + l owns shard a·L + l::

    g [N] ─view─► [A, L, S] ─transpose─► [L, A, S]   row l: the A shards the ranks with local index l own
    intra all-to-all (8-bit, L ranks of node a): rank (a,l) receives row l from its node peers, sums  ─► [A, S]
    inter all-to-all (4-bit, the A ranks with local index l): rank (a,l) receives piece a, sums       ─► [S]

Bytes per rank with N elements (fp32 scales, groups g): bf16 reduce-scatter 2N·(W−1)/W; TLq
intra N·(L−1)/L·(1 + 4/g8), inter (N/L)·(A−1)/A·(1/2 + 4/g4); weight all-gather bf16 2N·(W−1)/W,
qWD N·(W−1)/W·(1/2 + 4/2048).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from toolkit.quant import Quantized, all_finite, dequantize_blockwise, hadamard32, quantize_blockwise
from toolkit.runtime import compat
from toolkit.runtime.grid import Topology, node_groups

WEIGHT_MODES = ("bf16", "qwd", "direct4", "fp32")
GRAD_MODES = ("bf16", "tlq", "fp32")


# ---- nodes emulated with process subgroups -----------------------------------------------------------

def check_topology(world_size: int, nodes: int) -> int:
    """Ranks per node; ValueError unless ``nodes`` divides ``world_size``."""
    if not isinstance(nodes, int) or isinstance(nodes, bool) or nodes < 1:
        raise ValueError(f"nodes must be a positive int, got {nodes!r}")
    if world_size % nodes:
        raise ValueError(f"nodes={nodes} must divide world_size={world_size} (emulated nodes hold equal numbers of "
                         f"ranks: e.g. 2 nodes x 2 on 4 ranks, 2 nodes x 1 on 2 ranks)")
    return world_size // nodes


def make_topology(nodes: int, ledger=None) -> Topology:
    """Build (collectively) the intra-node and inter-node groups of ``nodes`` emulated nodes
    (``toolkit.runtime.grid.node_groups``); label them in ``ledger``."""
    return node_groups(check_topology(dist.get_world_size(), nodes), ledger)


# ---- what goes on the wire ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Codec:
    """Block-wise integer codes + fp32 scales, packed per destination into one uint8 row.

    ``bits=None`` sends the fp32 values themselves (quantization off).
    """

    bits: int | None = 4
    block: int = 128
    stochastic: bool = False

    def encode(self, x: torch.Tensor, seed: int = 0) -> torch.Tensor:
        """x [D, M] (one row per destination) -> uint8 [D, bytes per row]."""
        d = x.shape[0]
        if self.bits is None:
            return x.contiguous().view(torch.uint8).view(d, -1)
        if x.shape[1] % self.block:
            raise ValueError(f"row length {x.shape[1]} must be a multiple of block={self.block}")
        q = quantize_blockwise(x, bits=self.bits, block=self.block, stochastic=self.stochastic, seed=seed)
        return torch.cat([q.payload.view(torch.uint8).view(d, -1), q.scales.view(torch.uint8).view(d, -1)], dim=1)

    def decode(self, buf: torch.Tensor, m: int) -> torch.Tensor:
        """uint8 [D, bytes per row] -> float32 [D, m]."""
        d = buf.shape[0]
        if self.bits is None:
            return buf.contiguous().view(torch.float32).view(d, m)
        pb = m // 2 if self.bits == 4 else m
        payload = buf[:, :pb].reshape(-1)
        q = Quantized(payload if self.bits == 4 else payload.view(torch.int8),
                      buf[:, pb:].contiguous().view(torch.float32).reshape(-1), self.bits, self.block,
                      torch.Size([d * m]), "int4" if self.bits == 4 else "int8")
        return dequantize_blockwise(q).view(d, m)

    def row_bytes(self, m: int) -> int:
        if self.bits is None:
            return 4 * m
        return m * self.bits // 8 + 4 * (m // self.block)


def _all_to_all(rows: torch.Tensor, group) -> torch.Tensor:
    """Row i goes to the i-th rank of ``group``; row j of the result came from its j-th rank."""
    out = torch.empty_like(rows)
    dist.all_to_all_single(out, rows, group=group)
    return out


# ---- (b) gradients: reduce-scatter -----------------------------------------------------------------------

def two_level_layout(g: torch.Tensor, topo: Topology) -> torch.Tensor:
    """g [N] -> [L, A, S]: row l holds the shards owned by the ranks with local index l."""
    return g.view(topo.nodes, topo.local, -1).transpose(0, 1).contiguous()


def reduce_scatter_tlq(g: torch.Tensor, topo: Topology, intra: Codec = Codec(8, 128, True),
                       inter: Codec = Codec(4, 128, True), hadamard: bool = True, seed: int = 0) -> torch.Tensor:
    """TLq-HS: the mean over all ranks of this rank's shard of ``g`` [N] -> [N/W] (see the module docstring).

    ``seed`` must differ per rank and per step, so rounding errors are independent and average out.
    """
    x = two_level_layout(g, topo)  # [L, A, S]
    L, A, S = x.shape
    if hadamard:  # rotate every run of 32 elements; blocks never straddle two shards (S % 32 == 0)
        x = hadamard32(x)
    if L > 1:  # inside the node: 8 bits; the sum stays in the rotated domain
        x = intra.decode(_all_to_all(intra.encode(x.view(L, A * S), seed), topo.intra), A * S).sum(0)
    x = x.reshape(A, S)
    if A > 1:  # across nodes: 4 bits, only N/L elements per rank
        x = inter.decode(_all_to_all(inter.encode(x, seed + 1), topo.inter), S).sum(0)
    x = x.reshape(S)
    if hadamard:  # H·H = 32·I and every step above is linear: one inverse, after all the sums
        x = hadamard32(x, inverse=True)
    return x / (L * A)


def reduce_scatter_bf16(g: torch.Tensor, topo: Topology) -> torch.Tensor:
    """Baseline: the same two-level shard layout, bf16 on the wire (and in the sums), result in fp32."""
    x = two_level_layout(g, topo).to(torch.bfloat16)  # [L, A, S]
    L, A, S = x.shape
    if L > 1:
        out = x.new_empty(A * S)
        compat.reduce_scatter_single(out, x.view(-1), group=topo.intra)
        x = out
    x = x.reshape(-1)
    if A > 1:
        out = x.new_empty(S)
        compat.reduce_scatter_single(out, x, group=topo.inter)
        x = out
    return x.float() / (L * A)


def reduce_scatter_fp32(g: torch.Tensor, group=None) -> torch.Tensor:
    """Reference: torch's flat reduce-scatter in fp32, then the mean (rank r gets shard r)."""
    world = dist.get_world_size(group)
    out = g.new_empty(g.numel() // world)
    compat.reduce_scatter_single(out, g, group=group)
    return out / world


# ---- (a) weights: all-gather -----------------------------------------------------------------------------

def all_gather_qwd(replica: torch.Tensor, master: torch.Tensor, codec: Codec = Codec(4, 2048, False),
                   round_to: torch.dtype | None = torch.bfloat16, group=None) -> torch.Tensor:
    """qWD: all-gather the quantized difference between each owner's master shard and the replica.

    Every rank, the owner included, applies the same dequantized differences, so the replicas stay
    bitwise identical; ``round_to`` is the dtype the replica is kept in (None: fp32).
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    S = master.numel()
    delta = master.detach() - replica[rank * S:(rank + 1) * S]  # [S]
    mine = codec.encode(delta.view(1, S))  # [1, bytes]
    rows = mine.new_empty(world, mine.shape[1])
    compat.all_gather_single(rows, mine, group=group)
    replica += codec.decode(rows, S).view(-1)
    if round_to is not None:
        replica.copy_(replica.to(round_to))
    return replica


def all_gather_direct(replica: torch.Tensor, master: torch.Tensor, codec: Codec | None = None,
                      round_to: torch.dtype | None = torch.bfloat16, group=None) -> torch.Tensor:
    """The weights themselves: bf16 (``codec=None``, ``round_to=bf16``: the baseline), fp32, or quantized."""
    world, S = dist.get_world_size(group), master.numel()
    if codec is None:
        wire = master.detach().to(round_to or torch.float32)
        out = wire.new_empty(world * S)
        compat.all_gather_single(out, wire, group=group)
        return replica.copy_(out)
    mine = codec.encode(master.detach().view(1, S))
    rows = mine.new_empty(world, mine.shape[1])
    compat.all_gather_single(rows, mine, group=group)
    replica.copy_(codec.decode(rows, S).view(-1))
    if round_to is not None:
        replica.copy_(replica.to(round_to))
    return replica


# ---- the sharded data-parallel optimizer -----------------------------------------------------------------

@dataclass
class SDPConfig:
    weights: str = "qwd"
    """"bf16" (baseline), "qwd" (4-bit weight differences), "direct4" (4-bit weights), "fp32"."""
    grads: str = "tlq"
    """"bf16" (baseline), "tlq" (two-level 8/4-bit), "fp32"."""
    hadamard: bool = True
    nodes: int = 2
    weight_group: int = 2048
    intra_bits: int = 8
    intra_group: int = 128
    inter_bits: int = 4
    inter_group: int = 128
    seed: int = 0

    def validate(self, world_size: int) -> "SDPConfig":
        if self.weights not in WEIGHT_MODES:
            raise ValueError(f"weights={self.weights!r} is not allowed; allowed: {WEIGHT_MODES}")
        if self.grads not in GRAD_MODES:
            raise ValueError(f"grads={self.grads!r} is not allowed; allowed: {GRAD_MODES}")
        check_topology(world_size, self.nodes)
        for name in ("weight_group", "intra_group", "inter_group"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 32 or v % 32:
                raise ValueError(f"{name} must be a positive multiple of 32 (the Hadamard block), got {v!r}")
        for name in ("intra_bits", "inter_bits"):
            if getattr(self, name) not in (4, 8):
                raise ValueError(f"{name} must be 4 or 8, got {getattr(self, name)!r}")
        return self

    def shard_multiple(self) -> int:
        """Every shard is a whole number of quantization groups (hence of Hadamard blocks)."""
        return max(self.weight_group, self.intra_group, self.inter_group)


class ShardedDP:
    """ZeRO-style data parallelism over one flat buffer, with SDP4Bit's communication.

    The model's parameters become views into ``self.replica`` [N_pad]; their ``.grad`` views into
    ``self.grad``. After ``backward()`` call ``step(i)``: reduce-scatter, AdamW on this rank's fp32
    master shard, all-gather.
    """

    def __init__(self, model: torch.nn.Module, cfg: SDPConfig, topo: Topology, lr: float,
                 betas: tuple[float, float] = (0.9, 0.95), weight_decay: float = 0.0):
        world, rank = dist.get_world_size(), dist.get_rank()
        self.cfg, self.topo, self.rank, self.world = cfg.validate(world), topo, rank, world
        self.params = list(model.parameters())
        n = sum(p.numel() for p in self.params)
        unit = world * cfg.shard_multiple()
        self.numel, self.padded = n, -(-n // unit) * unit
        device = self.params[0].device
        self.replica = torch.zeros(self.padded, device=device)
        self.grad = torch.zeros(self.padded, device=device)
        o = 0
        for p in self.params:  # parameters and grads become views of the flat buffers
            self.replica[o:o + p.numel()].copy_(p.detach().reshape(-1))
            p.data = self.replica[o:o + p.numel()].view_as(p)
            p.grad = self.grad[o:o + p.numel()].view_as(p)
            o += p.numel()
        S = self.padded // world
        self.master = torch.nn.Parameter(self.replica[rank * S:(rank + 1) * S].clone())  # fp32, exact init
        self.opt = torch.optim.AdamW([self.master], lr=lr, betas=betas, weight_decay=weight_decay)
        if cfg.weights in ("bf16", "qwd"):  # the replica lives in bf16 (fp32 storage, bf16 values)
            self.replica.copy_(self.replica.bfloat16())
        elif cfg.weights == "direct4":  # the forward only ever sees 4-bit weights
            self.gather_weights()

    @property
    def shard(self) -> slice:
        S = self.padded // self.world
        return slice(self.rank * S, (self.rank + 1) * S)

    def zero_grad(self) -> None:
        self.grad.zero_()

    def reduce_scatter(self, step: int) -> torch.Tensor:
        """The mean gradient of this rank's shard [N_pad / W], by the configured path."""
        cfg = self.cfg
        if not all_finite(self.grad):
            raise ValueError("gradient holds NaN/Inf values; refusing to quantize and reduce it")
        if cfg.grads == "fp32":
            return reduce_scatter_fp32(self.grad)
        if cfg.grads == "bf16":
            return reduce_scatter_bf16(self.grad, self.topo)
        seed = ((cfg.seed * 1_000_003 + step) * self.world + self.rank) * 2  # distinct per rank, step, phase
        return reduce_scatter_tlq(self.grad, self.topo, Codec(cfg.intra_bits, cfg.intra_group, True),
                                  Codec(cfg.inter_bits, cfg.inter_group, True), cfg.hadamard, seed)

    def apply(self, shard_grad: torch.Tensor) -> None:
        """AdamW on this rank's fp32 master shard."""
        self.master.grad = shard_grad
        self.opt.step()

    def gather_weights(self) -> None:
        """Bring every rank's replica up to date with every owner's master shard, by the configured path."""
        cfg = self.cfg
        if cfg.weights == "qwd":
            all_gather_qwd(self.replica, self.master, Codec(4, cfg.weight_group, False))
        elif cfg.weights == "direct4":
            all_gather_direct(self.replica, self.master, Codec(4, cfg.weight_group, False))
        else:
            all_gather_direct(self.replica, self.master, None, torch.bfloat16 if cfg.weights == "bf16" else None)

    def step(self, step: int) -> torch.Tensor:
        """Reduce-scatter, optimizer step on the master shard, all-gather; returns the gradient shard."""
        shard_grad = self.reduce_scatter(step)
        self.apply(shard_grad)
        self.gather_weights()
        return shard_grad
