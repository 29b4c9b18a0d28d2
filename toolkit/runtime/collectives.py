"""How long a collective takes, as NCCL's tuning model reckons it: per protocol a latency and a bandwidth, the
fastest wins, and the group's placement on nodes decides the link.

NCCL times every (algorithm, protocol) pair of a collective and picks the fastest (``src/graph/tuning.cc``,
``ncclTopoTuneModel`` and ``ncclTopoGetAlgoTime``; ``torch/_inductor/comm_analysis.py`` mirrors it in Python)::

    time = latency(protocol) + steps · hop(protocol) + (wire + fill · min(wire, fill_bytes)) / bandwidth(protocol)

    steps    all_reduce 2(n−1), all_gather / reduce_scatter / broadcast / all_to_all n−1, a send 1 (ring steps)
    LL       small messages: a flag per 8 bytes, the lowest latency, a fraction of the bandwidth
    LL128    mid-size: a flag per 128 bytes
    Simple   large messages: the full bandwidth, the highest latency
    NVLS     all_reduce through NVLink SHARP (the NVSwitch reduces, Hopper): one step, more bandwidth

Wire bytes are what ``toolkit.runtime.ledger`` counts (nccl-tests' bus-bandwidth convention), so the bandwidths
are nccl-tests' ``busbw``. Each protocol's figures in a preset are fitted to published nccl-tests tables
(``data/published/collectives.csv``; ``tests/test_calibration.py`` checks every row), not NCCL's own constants,
which rank choices well but do not reproduce measured times.

Across nodes the link is the network, driven by every NIC the group has on a node (rail-optimised: one NIC per
GPU; NCCL spreads its channels over them)::

    ring (all_gather, reduce_scatter, ...)   bus bandwidth = min(intra, NICs used per node x one NIC's)
    all_reduce (NCCL's tree / NVLS tree)     reduce-scatter inside each node, all-reduce of 1/k of the data
                                             across nodes on each GPU's NIC, all-gather inside: bus bandwidth
                                             = min(intra all_reduce, (n−1)/n · nodes/(nodes−1) · NICs used ·
                                             one NIC's)
    all_to_all                               the share bound for other nodes crosses the NICs: (n−k)/(n−1)
    a send                                   one NIC
  with k ranks of the group on a node and NICs used = min(k, the node's NICs).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

RING_STEPS = {"all_reduce": lambda n: 2 * (n - 1), "barrier": lambda n: 2 * (n - 1), "send": lambda n: 1,
              "isend": lambda n: 1}
"""Ring steps of an op of a group of n (the rest: n − 1)."""

OP_CLASS = {"all_gather_into_tensor": "all_gather", "all_gather": "all_gather", "all_gather_single": "all_gather",
            "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter": "reduce_scatter",
            "reduce_scatter_single": "reduce_scatter", "all_to_all_single": "all_to_all", "all_to_all": "all_to_all",
            "alltoall": "all_to_all", "isend": "send", "send": "send", "sendrecv": "send", "barrier": "all_reduce",
            "broadcast": "all_gather", "reduce": "reduce_scatter", "all_reduce": "all_reduce"}
"""The collective each ledger op is timed as (a broadcast as a ring all-gather, a reduce as a reduce-scatter, a
barrier as an all-reduce of nothing)."""


@dataclass(frozen=True)
class Protocol:
    """One way NCCL moves bytes on a link: its latency per call, per ring step, and its bus bandwidth."""

    name: str
    bytes_per_s: float
    latency_s: float
    hop_s: float = 0.0
    ops: tuple[str, ...] = ()
    """The collectives it serves (``OP_CLASS`` values); empty: all."""
    fill: float = 0.0
    fill_bytes: float = 0.0
    """The pipeline's fill: NCCL cuts a message into chunks that flow through the steps; until the chunks reach
    their largest size (a message of ``fill_bytes``) the pipeline's ramp costs ``fill`` x the bytes again."""

    def seconds(self, op: str, n: int, wire_bytes: float) -> float | None:
        if self.ops and op not in self.ops:
            return None
        steps = RING_STEPS.get(op, lambda m: m - 1)(n)
        return (self.latency_s + steps * self.hop_s
                + (wire_bytes + self.fill * min(wire_bytes, self.fill_bytes)) / self.bytes_per_s)


def op_class(op: str) -> str:
    """The collective a ledger op (``all_gather_into_tensor``, ``isend``, ...) is timed as."""
    if op not in OP_CLASS:
        raise ValueError(f"no collective model for op {op!r}; known: {sorted(OP_CLASS)}")
    return OP_CLASS[op]


def placement(ranks, world_size: int, cluster) -> tuple[int, int, int]:
    """(ranks, nodes, ranks per node at most) of a group of global ``ranks`` on ``cluster``."""
    ranks = sorted(set(ranks))
    per_node: dict[int, int] = {}
    for r in ranks:
        node = cluster.node_of(r, world_size)
        per_node[node] = per_node.get(node, 0) + 1
    return len(ranks), len(per_node), max(per_node.values())


def fastest(link, op: str, n: int, wire_bytes: float, scale: float = 1.0) -> tuple[float, str]:
    """(seconds, protocol name) of the fastest protocol of ``link`` for ``op`` among ``n`` ranks, its bandwidths
    times ``scale``."""
    best = (float("inf"), "")
    for p in link.all_protocols():
        p = p if scale == 1.0 else dataclasses.replace(p, bytes_per_s=p.bytes_per_s * scale)
        t = p.seconds(op, n, wire_bytes)
        if t is not None and t < best[0]:
            best = (t, p.name)
    return best


def seconds(cluster, op: str, ranks, world_size: int, wire_bytes: float) -> tuple[float, str, object]:
    """(seconds, protocol, link) of one collective (or send) of ``wire_bytes`` among global ``ranks``."""
    kind = op_class(op)
    n, nodes, k = placement(ranks, world_size, cluster)
    if n <= 1:
        return 0.0, "", cluster.intra
    if nodes == 1:
        t, proto = fastest(cluster.intra, kind, n, wire_bytes)
        return t, proto, cluster.intra
    nic = cluster.inter
    nics = min(k, cluster.nics)
    intra_bw = cluster.intra.bytes_per_s
    if kind == "send":
        return (*fastest(nic, kind, n, wire_bytes), nic)
    if kind == "all_to_all":  # the bytes bound for other nodes leave through this rank's share of the NICs
        t, proto = fastest(nic, kind, n, wire_bytes * (n - k) / (n - 1), scale=nics / k)
        return max(t, wire_bytes / intra_bw), proto, nic
    ring = fastest(nic, kind, n, wire_bytes, scale=min(intra_bw / nic.bytes_per_s, nics))
    if kind != "all_reduce":
        return (*ring, nic)
    # the hierarchical all-reduce: inside each node at its fastest, 1/k of the data across nodes on each NIC
    intra_ar = max(p.bytes_per_s for p in cluster.intra.all_protocols() if not p.ops or "all_reduce" in p.ops)
    across, proto = fastest(nic, kind, nodes, wire_bytes, scale=(n - 1) / n * nodes / (nodes - 1) * nics)
    inside = fastest(cluster.intra, kind, k, 0.0)[0] if k > 1 else 0.0
    tree = max(across, wire_bytes / intra_ar + inside) if k > 1 else across
    return (ring[0], ring[1], nic) if ring[0] <= tree else (tree, f"tree {proto}", nic)


def transfer(cluster, op: str, ranks, world_size: int, wire_bytes: float):
    """(seconds, link) of a transfer the emulated cluster queues (``seconds`` without the protocol)."""
    t, _, link = seconds(cluster, op, ranks, world_size, wire_bytes)
    return t, link


def group_seconds(cluster, op: str, n: int, wire_bytes: float, stride: int = 1) -> float:
    """One collective among ``n`` GPUs ``stride`` apart (a TP group: 1; a DP group: tp·pp), the job's ranks
    filling nodes of ``cluster.ranks_per_node`` (all of a node's GPUs when None) in rank order: a placement's
    model, no launch needed."""
    if n <= 1:
        return 0.0
    world = n * stride
    per = min(world, cluster.ranks_per_node or cluster.gpus_per_node)
    placed = dataclasses.replace(cluster, ranks_per_node=per)
    return seconds(placed, op, range(0, world, stride), world, wire_bytes)[0]
