"""DeepEP-style dispatch and combine on top of ``toolkit.moe``: what DeepEP adds over a plain all-to-all.

DeepEP (deepseek-ai/DeepEP) moves MoE tokens between GPUs with its own kernels. Four of its ideas, written
with torch.distributed collectives so they run (and can be counted) on any backend::

    (a) layout        topk_idx [T,K] ─► tokens per rank [R], per node [N], per expert [E], token-in-rank [T,R]
                      (``dispatch_layout`` in ``dispatcher.py``; ``layout_brute_force`` here is the check)

    (b) dedup         plain all-to-all: one row per (token, expert)    T·K rows        = T·K·H·b bytes
                      DeepEP:           one row per (token, rank)      Σ_t |ranks(t)|  rows, gate weights beside
                      (``TokenDispatcher(dedup=True)``; the expert side weights its pairs and sums per row)

    (c) two hops      node A: rank a0 a1            node B: rank b0 b1
                      token on a0 with experts on b0 and b1:
                        hop 1 (inter-node, "RDMA"):  a0 ──────────────► b0      once per remote node:
                                                                                Σ_t |nodes(t) \\ own| rows
                        hop 2 (intra-node, "NVLink"):                 b0 ──► b1  fan-out inside the node
                      combine reverses it: b1 ──► b0 (b0 adds its node's partial sums) ──────► a0
                      (``TwoHop``: the rdma group holds the ranks with the same local index on every node,
                      the nvl group the ranks of one node; each hop is one all_to_all_single)

    (d) low latency   receive buffer fixed in advance: [local experts, max_tokens · R, H] + counts [local experts]
                      no count exchange before the data (one latency less); ``return_recv_hook=True`` issues
                      the transfer and returns a hook that completes it later, so compute runs in between
                      (``LowLatency``; emulated with an async all_to_all_single of the padded buffer: DeepEP's
                      RDMA puts write only the real tokens into their slots)

                      why only this mode can be captured in a CUDA graph: normal mode (``TokenDispatcher``)
                        counts ─► all_gather ─► host reads them ─► allocate recv [Σ counts, H] ─► all_to_all
                                                └ a host sync: the host waits for the device, and the buffer's
                                                  size changes from step to step: a graph replays fixed shapes
                      low latency: recv [local, R·max_tokens, H] fixed; counts travel beside the data, read on
                      the device only: no host sync, the same shapes every step (``toolkit.graphs.audit`` checks)

    (e) fp8 / int8 dispatch with one fp32 scale per token per 128 channels, bf16 combine: the codecs of
        ``TokenDispatcher`` (``Codec("fp8")``, ``combine_codec="bf16"``), also on both hops and the fixed buffers.

Invariant of every path: identity experts and weights summing to one give back the input (exactly, for
tokens and weights with few mantissa bits, see ``dyadic``); Σ received counts = Σ tokens per expert.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Callable

import torch
import torch.distributed as dist

from toolkit.runtime.grid import node_groups

from .dispatcher import Codec, Layout, all_to_all, as_codec


# ---- (a) layout, the brute-force check --------------------------------------------------------------------------
def layout_brute_force(ids: torch.Tensor, n_slots: int, n_ranks: int, ranks_per_node: int) -> Layout:
    """The layout of slot ids [T,K] by plain Python loops over tokens and their experts."""
    per_rank, T = n_slots // n_ranks, ids.shape[0]
    in_rank = [[False] * n_ranks for _ in range(T)]
    per_expert = [0] * n_slots
    for t, row in enumerate(ids.tolist()):
        for e in row:
            per_expert[e] += 1
            in_rank[t][e // per_rank] = True
    in_node = [[any(in_rank[t][n * ranks_per_node:(n + 1) * ranks_per_node]) for n in range(n_ranks // ranks_per_node)]
               for t in range(T)]
    count = lambda table, n: torch.tensor([sum(row[i] for row in table) for i in range(n)])
    return Layout(count(in_rank, n_ranks), torch.tensor(per_expert), torch.tensor(in_rank, dtype=torch.bool),
                  count(in_node, n_ranks // ranks_per_node), torch.tensor(in_node, dtype=torch.bool))


def dyadic(weights: torch.Tensor, bits: int = 8) -> torch.Tensor:
    """Gate weights rounded to multiples of 2^-bits, each row summing to exactly 1 (the largest absorbs the rest).

    With tokens of at most 24 - bits - 1 mantissa bits (bf16 values: 8) every partial sum of w·x is exact
    in fp32, whatever the order: the round trip through any dispatcher returns the input bit for bit."""
    q = torch.round(weights * 2 ** bits) / 2 ** bits
    top = q.argmax(-1, keepdim=True)
    return q.scatter_add(-1, top, 1 - q.sum(-1, keepdim=True))


def node_limited_route(logits: torch.Tensor, top_k: int, experts_per_node: int, max_nodes: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's node-limited routing: keep the ``max_nodes`` nodes with the highest sum of their top
    ``top_k / max_nodes`` expert scores, then take the top-k experts among them. Weights renormalized to 1."""
    T, E = logits.shape
    probs = logits.softmax(-1)
    per_node = probs.view(T, E // experts_per_node, experts_per_node)
    node_score = per_node.topk(max(1, top_k // max_nodes), -1).values.sum(-1)  # [T, nodes]
    nodes = node_score.topk(max_nodes, -1).indices
    allowed = torch.zeros_like(node_score, dtype=torch.bool).scatter_(1, nodes, True)
    masked = torch.where(allowed.repeat_interleave(experts_per_node, 1), probs, torch.zeros(()))
    weights, ids = masked.topk(top_k, -1)
    return weights / weights.sum(-1, keepdim=True), ids


def _pairs(ids: torch.Tensor, rank: int, per_rank: int, w: torch.Tensor):
    """Received rows with their top-k slot ids [R,K] -> (row, local slot, weight) of the pairs on ``rank``,
    slot-major then row order."""
    row, k = (ids // per_rank == rank).nonzero(as_tuple=True)
    slot = ids[row, k] % per_rank
    order = slot.argsort(stable=True)
    return row[order], slot[order], w[row[order], k[order]]


def _splits_back(in_splits: list[int], group, device=None) -> list[int]:
    """Rows each peer will send me, from the rows I send each peer (a tiny all-to-all of counts)."""
    mine = torch.tensor(in_splits, dtype=torch.int64, device=device)
    theirs = torch.empty_like(mine)
    dist.all_to_all_single(theirs, mine, group=group)
    return theirs.tolist()


# ---- (c) two-hop forwarding over (emulated) nodes ---------------------------------------------------------------
@dataclass
class TwoHopHandle:
    """What the combine needs to retrace the two hops."""
    T: int
    tok1: torch.Tensor  # [rows1] token of each hop-1 row (sorted by node)
    splits1: tuple[list[int], list[int]]
    row2: torch.Tensor  # [rows2] hop-1 received row of each hop-2 row (sorted by local rank)
    splits2: tuple[list[int], list[int]]
    n_recv1: int
    pair_row: torch.Tensor  # [P] hop-2 received row of each expert pair
    pair_w: torch.Tensor
    recv_counts: list[int]


class TwoHop:
    """DeepEP's internode dispatch on ``ranks_per_node``-rank (emulated) nodes of the world group.

    Build it on every rank (it creates the process groups). ``phase(name)`` wraps "hop1", "hop2", "meta",
    "counts" and the combine's "combine_hop2", "combine_hop1" (e.g. ``lambda n: ledger.tag(f"two_hop/{n}")``).
    """

    def __init__(self, n_slots: int, ranks_per_node: int, codec: "str | Codec" = "none",
                 combine_codec: "str | Codec" = "none", block: int = 128):
        R, rank = dist.get_world_size(), dist.get_rank()
        if ranks_per_node < 1 or R % ranks_per_node or R // ranks_per_node < 2:
            raise ValueError(f"ranks_per_node={ranks_per_node} must divide world_size={R} into >= 2 nodes")
        if n_slots % R:
            raise ValueError(f"n_slots={n_slots} experts must be divisible by the expert-parallel size ep={R}")
        topo = node_groups(ranks_per_node)  # NVLink inside a node, one RDMA rail across nodes
        self.R, self.rank, self.rpn, self.nodes = R, rank, ranks_per_node, topo.nodes
        self.node, self.local_rank, self.per_rank, self.n_slots = topo.node, topo.local_rank, n_slots // R, n_slots
        self.codec, self.combine_codec = as_codec(codec, block), as_codec(combine_codec, block)
        self.nvl, self.rdma = topo.intra, topo.inter
        self.phase: Callable[[str], contextlib.AbstractContextManager] = lambda name: contextlib.nullcontext()

    def dispatch(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
                 ) -> tuple[torch.Tensor, TwoHopHandle]:
        """Tokens x [T,H] with slot ids and weights [T,K] -> (expert input [P,H] slot-major, handle)."""
        T, K = ids.shape
        meta = torch.cat([weights, ids.to(weights.dtype)], 1)  # [T, 2K] travels beside each row
        node_of = ids // (self.per_rank * self.rpn)
        in_node = torch.zeros(T, self.nodes, dtype=torch.bool, device=x.device).scatter_(1, node_of, True)
        node1, tok1 = in_node.t().nonzero(as_tuple=True)  # hop-1 rows: (node, token), node-major
        s1 = torch.bincount(node1, minlength=self.nodes).tolist()
        with self.phase("counts"):
            r1 = _splits_back(s1, self.rdma, x.device)
        wire = self.codec.encode(x[tok1])  # encoded once at the source, forwarded as bytes
        with self.phase("hop1"):
            got1 = all_to_all(wire, s1, r1, self.rdma)
        with self.phase("meta"):
            meta1 = all_to_all(meta[tok1], s1, r1, self.rdma)
        ids1 = meta1[:, K:].long()  # the proxy fans each row out to the ranks of its node that need it
        mine = ids1 // self.per_rank // self.rpn == self.node
        local_of = torch.where(mine, ids1 // self.per_rank % self.rpn, self.rpn)
        in_local = torch.zeros(ids1.shape[0], self.rpn + 1, dtype=torch.bool, device=x.device
                               ).scatter_(1, local_of, True)[:, :self.rpn]
        dst2, row2 = in_local.t().nonzero(as_tuple=True)
        s2 = torch.bincount(dst2, minlength=self.rpn).tolist()
        with self.phase("counts"):
            r2 = _splits_back(s2, self.nvl, x.device)
        with self.phase("hop2"):
            got2 = all_to_all(got1[row2], s2, r2, self.nvl)
        with self.phase("meta"):
            meta2 = all_to_all(meta1[row2], s2, r2, self.nvl)
        x2 = self.codec.decode(got2, x.shape[1], x.dtype)
        pair_row, slot, pair_w = _pairs(meta2[:, K:].long(), self.rank, self.per_rank, meta2[:, :K])
        counts = torch.bincount(slot, minlength=self.per_rank).tolist()
        handle = TwoHopHandle(T, tok1, (s1, r1), row2, (s2, r2), got1.shape[0], pair_row, pair_w, counts)
        return x2[pair_row], handle

    def combine(self, y: torch.Tensor, h: TwoHopHandle) -> torch.Tensor:
        """Expert outputs [P,H] -> [T,H]: weighted sum on the expert rank, the node's partial sums added on the
        proxy, the nodes' sums added on the source."""
        H = y.shape[1]
        rows2 = y.new_zeros((sum(h.splits2[1]), H)).index_add(0, h.pair_row, y * h.pair_w[:, None].to(y.dtype))
        with self.phase("combine_hop2"):
            back2 = all_to_all(rows2, h.splits2[1], h.splits2[0], self.nvl, self.combine_codec, self.combine_codec)
        rows1 = y.new_zeros((h.n_recv1, H)).index_add(0, h.row2, back2)
        with self.phase("combine_hop1"):
            back1 = all_to_all(rows1, h.splits1[1], h.splits1[0], self.rdma, self.combine_codec, self.combine_codec)
        return y.new_zeros((h.T, H)).index_add(0, h.tok1, back1)


# ---- (d) low-latency mode: fixed receive buffers and a receive hook -------------------------------------------
def _unchecked(codec):
    """``codec`` without its NaN/Inf check (a ``Codec``; another object as it is)."""
    return replace(codec, check_finite=False) if isinstance(codec, Codec) else codec


@dataclass
class LowLatencyHandle:
    T: int
    slot_of_pair: torch.Tensor  # [T*K] destination slot
    pos_of_pair: torch.Tensor  # [T*K] row inside that slot's block from this rank
    weights: torch.Tensor  # [T,K]
    recv_per_src: torch.Tensor | None = None  # [R, local] rows each source wrote into each local expert's buffer


class LowLatency:
    """DeepEP's low-latency dispatch/combine: every local expert owns a receive buffer of ``max_tokens`` rows
    per source rank, so nothing needs to be agreed before the data moves.

    ``dispatch`` returns (recv_x [local, R·max_tokens, H], recv_count [local], handle, hook): with
    ``return_recv_hook=True`` the transfer is only issued and recv_x/recv_count are filled when ``hook()``
    is called; otherwise the hook has already run. ``phase(name)`` wraps "encode" (the padded send buffer
    laid out and encoded, no transfer), "dispatch", "counts" and "combine". Source rank s's rows for local
    expert j sit at recv_x[j, s·max_tokens : s·max_tokens + handle.recv_per_src[s, j]]; the rest is padding.
    """

    def __init__(self, n_slots: int, max_tokens: int, group=None, codec: "str | Codec" = "none",
                 combine_codec: "str | Codec" = "none", block: int = 128):
        self.group, self.R, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        if n_slots % self.R:
            raise ValueError(f"n_slots={n_slots} experts must be divisible by the expert-parallel size ep={self.R}")
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens={max_tokens!r} must be an int >= 1 (tokens per rank the buffers hold)")
        self.n_slots, self.local, self.M = n_slots, n_slots // self.R, max_tokens
        # nothing here makes the host wait for the device (DeepEP's kernels check nothing either): NaN tokens
        # travel as NaN rows, and the whole round trip can be captured in a CUDA graph
        self.codec, self.combine_codec = (_unchecked(as_codec(c, block)) for c in (codec, combine_codec))
        self.phase: Callable[[str], contextlib.AbstractContextManager] = lambda name: contextlib.nullcontext()

    def buffer_rows(self) -> int:
        """Rows of one rank's send (= receive) buffer: R · local · max_tokens."""
        return self.R * self.local * self.M

    def dispatch(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, return_recv_hook: bool = False):
        T, H = x.shape
        if T > self.M:
            raise ValueError(f"{T} tokens on rank {self.rank} exceed max_tokens={self.M}: the fixed buffers hold "
                             f"max_tokens rows per source rank per expert; raise max_tokens")
        with self.phase("encode"):  # lay the pairs out in the padded send buffer and encode it (no transfer)
            flat = ids.reshape(-1).long()
            order = flat.argsort(stable=True)  # position of each pair among this rank's pairs for its slot
            counts = torch.zeros(self.n_slots, dtype=torch.long, device=flat.device).scatter_add_(
                0, flat, torch.ones_like(flat))  # not bincount: its output size depends on the data (a host sync)
            pos = torch.empty_like(flat)
            start = torch.cumsum(counts, 0) - counts
            pos[order] = torch.arange(flat.numel(), device=flat.device) - start[flat[order]]
            send = x.new_zeros((self.n_slots * self.M, H))  # [R(dst), local, M] rows
            send[flat * self.M + pos] = x.repeat_interleave(ids.shape[1], 0)
            wire = self.codec.encode(send)
        recv = wire.new_empty(wire.shape)
        recv_counts = torch.empty_like(counts)
        with self.phase("dispatch"):
            work = dist.all_to_all_single(recv, wire, group=self.group, async_op=True)
        with self.phase("counts"):
            work_counts = dist.all_to_all_single(recv_counts, counts, group=self.group, async_op=True)
        handle = LowLatencyHandle(T, flat, pos, weights)
        out = {}

        def hook():
            work.wait()
            work_counts.wait()
            got = self.codec.decode(recv, H, x.dtype).view(self.R, self.local, self.M, H)
            out["x"] = got.transpose(0, 1).reshape(self.local, self.R * self.M, H)
            handle.recv_per_src = recv_counts.view(self.R, self.local)
            out["count"] = handle.recv_per_src.sum(0)
            return out["x"], out["count"]
        if not return_recv_hook:
            hook()
            return out["x"], out["count"], handle, lambda: (out["x"], out["count"])
        return None, None, handle, hook

    def combine(self, y: torch.Tensor, handle: LowLatencyHandle, return_recv_hook: bool = False):
        """Expert outputs in the receive layout [local, R·max_tokens, H] -> [T,H] (weighted sum over top-k)."""
        H = y.shape[-1]
        send = y.view(self.local, self.R, self.M, H).transpose(0, 1).reshape(-1, H)
        wire = self.combine_codec.encode(send)
        recv = wire.new_empty(wire.shape)
        with self.phase("combine"):
            work = dist.all_to_all_single(recv, wire, group=self.group, async_op=True)

        def hook() -> torch.Tensor:
            work.wait()
            rows = self.combine_codec.decode(recv, H, y.dtype)[handle.slot_of_pair * self.M + handle.pos_of_pair]
            K = handle.weights.shape[1]
            return (rows.view(handle.T, K, H) * handle.weights[..., None].to(rows.dtype)).sum(1)
        return hook if return_recv_hook else hook()

