"""Dynamic context parallelism: per micro-batch, a CP size for each sequence from its length, and CP groups of
equal work across the DP×CP ranks (the algorithm of Megatron Core's ``DefaultDynamicCPScheduler``).

**Static CP** gives every sequence the CP size the longest one needs and packs sequences, in data order, into each
DP replica's micro-batches up to cp·cap tokens. Short sequences are split cp ways all the same (their K/V go
round the ring), and two replicas' packs of equal length can hold very different attention work (∝ L²)::

    static cp = 2, dp = 2, cap = 512 tokens per rank    one micro-batch          work per rank  Σ L²/cp
      ranks 0-1   [ 620 | 300 | 100 ]        1020 tokens                           242 k
      ranks 2-3   [ 440 | 420 | 80 | 60 ]    1000 tokens                           190 k   <- waits for 0-1

**Dynamic CP** gives each sequence the smallest power of two that fits it under the per-rank cap,
cp(L) = max(min_cp, 2^ceil(log2(L / cap))), and packs CP groups of equal work L²/cp::

    dynamic, the same ranks and cap                 one micro-batch
      ranks 0-1   [ 620 ]                           cp 2 (620 > 512)                     192 k
      rank 2      [ 440 ]                           cp 1: no ring at all                 194 k
      rank 3      [ 420 | 80 ]                      cp 1                                 183 k
      (300, 100 and 60 wait for the next micro-batch)

One micro-batch (``_next_micro_batch``):
  1. sort what is left by length, longest first, and cut it into k buckets of about equal work (10 % slack),
     k = the number of distinct CP sizes among the sequences;
  2. take the head of the first bucket that can be placed: on a new group (the lowest free aligned block of
     ranks) while one is free -- a fresh group has no work yet, so it is the least loaded -- otherwise into the
     least loaded existing group of its CP size whose tokens per rank stay within the cap;
  3. once a sequence with a smaller CP size than the first one is placed, stop as soon as every rank's work is
     within 5 % of the busiest (``delta``); the rest waits for the next micro-batch;
  4. ranks still empty: double the smallest group (its sequences then use twice the CP size) until none is.

Groups are aligned blocks of ranks, [k·s, (k+1)·s) for size s, so the process groups are built once, for every
power of two, before training (``prebuilt_groups``). ``reroute`` then sends every rank the shards of the
sequences its groups hold, for all micro-batches of the step, with one ``all_to_all_single``.
"""
from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections import deque
from itertools import accumulate
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .ring_attention import CPLayout, is_power_of_two, ring_bytes, sample_parts

__all__ = ["cp_size_for", "work", "Group", "MicroBatch", "Plan", "schedule_static", "schedule_dynamic",
           "prebuilt_groups", "reroute", "pad_length"]


def _need_power_of_two(name: str, value) -> None:
    if not is_power_of_two(value):
        raise ValueError(f"{name}={value!r} must be a power of two (1, 2, 4, 8, ...)")


def cp_size_for(length: int, cap: int, min_cp: int = 1, max_cp: int | None = None) -> int:
    """The CP size a sequence of ``length`` tokens needs so that no rank holds more than ``cap`` of them:
    ``max(min_cp, 2^ceil(log2(length / cap)))``. ValueError when it exceeds ``max_cp``."""
    raw = 1 if length <= cap else 2 ** math.ceil(math.log2(length / cap))
    size = max(min_cp, raw)
    if max_cp is not None and size > max_cp:
        raise ValueError(f"a sequence of {length} tokens needs cp={size} > max_cp={max_cp} at cap={cap} tokens per "
                         f"rank: it is longer than the CP cap max_cp*cap = {max_cp * cap}")
    return size


def work(length: int, cp: int) -> float:
    """The scheduler's work estimate of one sequence on each of its ``cp`` ranks: L²/cp (attention's quadratic
    term; Megatron's ``dcp_get_total_workload``)."""
    return length * length / cp


def pad_length(length: int, multiple: int) -> int:
    """``length`` rounded up to a multiple of ``multiple`` (sequences are padded to 2·max_cp so that any CP size
    up to max_cp can cut them into 2·cp equal chunks)."""
    return -(-length // multiple) * multiple


@dataclass
class Group:
    """Ranks that run some sequences together as one CP group: an aligned block ``[start, start + size)``."""

    size: int
    start: int
    samples: list[int] = field(default_factory=list)

    @property
    def ranks(self) -> list[int]:
        return list(range(self.start, self.start + self.size))


@dataclass
class MicroBatch:
    groups: list[Group]

    def group_of(self, rank: int) -> Group | None:
        return next((g for g in self.groups if g.start <= rank < g.start + g.size), None)


@dataclass
class Plan:
    """A step's schedule: for each micro-batch, the CP groups (rank blocks) and the sample ids each runs."""

    kind: str
    lengths: list[int]
    n_ranks: int
    cap: int
    micro_batches: list[MicroBatch]

    def work(self, i: int) -> list[float]:
        """Work Σ L²/cp of each rank in micro-batch ``i``."""
        out = [0.0] * self.n_ranks
        for g in self.micro_batches[i].groups:
            w = sum(work(self.lengths[s], g.size) for s in g.samples)
            for r in g.ranks:
                out[r] = w
        return out

    def tokens(self, i: int) -> list[int]:
        """Tokens each rank holds in micro-batch ``i``."""
        out = [0] * self.n_ranks
        for g in self.micro_batches[i].groups:
            for r in g.ranks:
                out[r] = sum(self.lengths[s] for s in g.samples) // g.size
        return out

    def balance(self) -> list[float]:
        """max/mean of the per-rank work of every micro-batch (1.0 = perfectly balanced)."""
        out = []
        for i in range(len(self.micro_batches)):
            w = self.work(i)
            out.append(max(w) / (sum(w) / len(w)) if sum(w) else 1.0)
        return out

    def cp_sizes(self) -> dict[int, int]:
        """The CP size each sample runs with."""
        return {s: g.size for mb in self.micro_batches for g in mb.groups for s in g.samples}

    def ring_bytes(self, d_kv: int, elem_bytes: int, n_layer: int) -> list[dict[str, int]]:
        """Closed-form ring attention bytes each rank sends over the step (all micro-batches, all layers)."""
        out = [{"forward": 0, "backward": 0} for _ in range(self.n_ranks)]
        for mb in self.micro_batches:
            for g in mb.groups:
                per = ring_bytes(sum(self.lengths[s] for s in g.samples) // g.size, d_kv, g.size, elem_bytes)
                for r in g.ranks:
                    for k in out[r]:
                        out[r][k] += n_layer * per[k]
        return out

    def check(self) -> None:
        """Raise AssertionError unless: every sample is scheduled exactly once; group sizes are powers of two on
        aligned, disjoint blocks of ranks; tokens per rank stay within the cap; every sample cuts into 2·cp chunks."""
        seen = sorted(s for mb in self.micro_batches for g in mb.groups for s in g.samples)
        assert seen == list(range(len(self.lengths))), "every sample must be scheduled exactly once"
        for i, mb in enumerate(self.micro_batches):
            used: set[int] = set()
            for g in mb.groups:
                assert is_power_of_two(g.size) and g.start % g.size == 0, f"mb {i}: group {g} is not an aligned block"
                assert 0 <= g.start and g.start + g.size <= self.n_ranks, f"mb {i}: group {g} outside the ranks"
                assert not used & set(g.ranks), f"mb {i}: groups overlap at {used & set(g.ranks)}"
                used |= set(g.ranks)
                for s in g.samples:
                    assert g.size == 1 or self.lengths[s] % (2 * g.size) == 0, \
                        f"sample {s} does not cut 2*{g.size} ways"
            assert max(self.tokens(i)) <= self.cap, f"mb {i}: {max(self.tokens(i))} tokens on a rank > cap {self.cap}"

    def to_json(self) -> dict:
        return {"kind": self.kind, "lengths": self.lengths, "n_ranks": self.n_ranks, "cap": self.cap,
                "micro_batches": [[{"size": g.size, "start": g.start, "samples": g.samples} for g in mb.groups]
                                  for mb in self.micro_batches]}

    @classmethod
    def from_json(cls, d: dict) -> "Plan":
        return cls(d["kind"], d["lengths"], d["n_ranks"], d["cap"],
                   [MicroBatch([Group(g["size"], g["start"], list(g["samples"])) for g in mb])
                    for mb in d["micro_batches"]])


def _check_lengths(lengths, limit: int, why: str) -> list[int]:
    lengths = [int(x) for x in lengths]
    for i, length in enumerate(lengths):
        if length < 1:
            raise ValueError(f"sample {i} has length {length}; sequences must have at least one token")
        if length > limit:
            raise ValueError(f"sample {i} has {length} tokens, longer than the CP cap {why} = {limit}")
    return lengths


def schedule_static(lengths, n_ranks: int, cp: int, cap: int) -> Plan:
    """Static CP: one CP size ``cp`` for every sequence, dp = n_ranks / cp replicas; sequences are packed in data
    order into packs of at most cp·cap tokens, pack i·dp + d going to replica d (Megatron's
    ``DpBalancedScheduler``; when the pack count is not a multiple of dp, single sequences are split off the
    last packs, and a replica with nothing left idles)."""
    _need_power_of_two("cp", cp)
    if n_ranks % cp:
        raise ValueError(f"cp={cp} must divide the number of ranks {n_ranks}")
    lengths = _check_lengths(lengths, cp * cap, f"cp*cap = {cp}*{cap}")
    dp, packs, cur, total = n_ranks // cp, [], [], 0
    for s, length in enumerate(lengths):
        if cur and total + length > cp * cap:
            packs.append(cur)
            cur, total = [], 0
        cur.append(s)
        total += length
    packs.append(cur)
    i = len(packs) - 1
    while len(packs) % dp and i >= 0:  # move single sequences off the end of the last packs
        if len(packs[i]) > 1:
            packs.append([packs[i].pop()])
        else:
            i -= 1
    while len(packs) % dp:
        packs.append([])
    mbs = [MicroBatch([Group(cp, d * cp, packs[i * dp + d]) for d in range(dp)]) for i in range(len(packs) // dp)]
    return Plan("static", lengths, n_ranks, cap, mbs)


def _buckets(ids: list[int], need: dict[int, int], wk: dict[int, float], slack: float) -> list[deque]:
    """Cut ``ids`` (longest first) into k consecutive runs of about equal work, k = distinct CP sizes among them:
    a run closes before the sequence that would take it past (1 + slack) x total/k, or when only as many
    sequences are left as runs still to fill."""
    n, k = len(ids), len(set(map(need.__getitem__, ids)))
    prefix = [0.0, *accumulate(map(wk.__getitem__, ids))]
    target = prefix[-1] / k * (1 + slack)
    buckets, a = [], 0
    while a < n:
        by_work = bisect_right(prefix, prefix[a] + target) - 1  # the run a..by_work-1 stays within the target
        by_count = n - (k - len(buckets) - 1)  # leave one sequence for each run still to fill
        e = n if len(buckets) == k - 1 else max(a + 1, min(by_work, by_count))
        buckets.append(deque(ids[a:e]))
        a = e
    return buckets


def _free_block(taken: list[bool], size: int) -> int | None:
    """Start of the lowest aligned block of ``size`` free ranks, or None."""
    for start in range(0, len(taken) - size + 1, size):
        if not any(taken[start:start + size]):
            return start
    return None


def _refill(buckets: list[deque], groups: list[Group], tokens: dict, load: list[float], lengths: list[int],
            cap: int):
    """The longest remaining sequence that fits, within the cap, into a group of its CP size or larger without
    raising the busiest rank's work, and the least loaded such group; None if there is none."""
    top = max(load)
    room = {id(g): min((cap - tokens[id(g)]) * g.size, math.sqrt(max(top - load[g.start], 0.0) * g.size))
            for g in groups}  # the longest sequence each group can still take: L/size tokens, L²/size work
    best = max(room.values(), default=0)
    flat = [s for b in buckets for s in b]  # longest first: the buckets are consecutive runs of one sorted list
    i = bisect_left(flat, -best, key=lambda s: -lengths[s])
    if i == len(flat):
        return None
    s = flat[i]
    for bucket in buckets:
        if i < len(bucket):
            return bucket, s, min((g for g in groups if lengths[s] <= room[id(g)]), key=lambda g: load[g.start])
        i -= len(bucket)


def _merge_buddies(groups: list[Group], lengths: list[int], n_ranks: int, max_imbalance: float) -> list[Group]:
    """While the busiest group's work per rank exceeds ``max_imbalance`` x the mean, merge it with its buddy
    block (the aligned block twice its size): its sequences then use twice the CP size, and the two halves'
    work is averaged."""
    while True:
        per_rank = {id(g): sum(lengths[s] ** 2 for s in g.samples) / g.size for g in groups}
        mean = sum(per_rank[id(g)] * g.size for g in groups) / n_ranks
        busiest = max(groups, key=lambda g: per_rank[id(g)])
        if per_rank[id(busiest)] <= max_imbalance * mean or busiest.size >= n_ranks:
            return groups
        size = 2 * busiest.size
        start = busiest.start // size * size
        inside = [g for g in groups if start <= g.start < start + size]
        merged = Group(size, start, [s for g in inside for s in g.samples])
        groups = sorted([g for g in groups if g not in inside] + [merged], key=lambda g: g.start)


def _next_micro_batch(ids: list[int], lengths: list[int], need: dict[int, int], wk: dict[int, float], n_ranks: int,
                      cap: int, delta: float, slack: float, refill: bool,
                      max_imbalance: float | None) -> tuple[MicroBatch, list[int]]:
    buckets = _buckets(ids, need, wk, slack)
    groups: list[Group] = []
    tokens: dict[int, int] = {}  # per group: tokens on each of its ranks
    taken, load = [False] * n_ranks, [0.0] * n_ranks
    first, check_balance = None, False
    while any(buckets):
        group = None
        for bucket in buckets:  # the head of the first bucket that can be placed
            if bucket and (any(g.size == need[bucket[0]] for g in groups)
                           or _free_block(taken, need[bucket[0]]) is not None):
                s = bucket[0]
                break
        else:
            bucket = None
        if bucket is not None:
            start = _free_block(taken, need[s])
            if start is not None:  # a new group: no work yet, so less loaded than any existing one
                group = Group(need[s], start)
                groups.append(group)
                tokens[id(group)] = 0
                taken[start:start + group.size] = [True] * group.size
            else:  # the least loaded group of its size with room for it
                fits = [g for g in groups if g.size == need[s] and tokens[id(g)] + lengths[s] // g.size <= cap]
                group = min(fits, key=lambda g: load[g.start]) if fits else None
        if group is None:  # Megatron ends the micro-batch here; refill tops up the groups below the busiest
            found = _refill(buckets, groups, tokens, load, lengths, cap) if refill else None
            if found is None:
                break
            bucket, s, group = found
        bucket.remove(s)
        group.samples.append(s)
        tokens[id(group)] += lengths[s] // group.size
        for r in group.ranks:
            load[r] += work(lengths[s], group.size)
        first = group.size if first is None else first
        check_balance = check_balance or group.size < first
        if check_balance and any(buckets) and max(load) - min(load) <= delta * max(load):
            break
    leftovers = [s for b in buckets for s in b]  # still longest first
    sizes = [g.size for g in groups]
    assert sizes == sorted(sizes, reverse=True), f"groups were opened out of size order: {sizes}"
    while sum(g.size for g in groups) < n_ranks:  # empty ranks: double the first smallest group
        smallest = min(g.size for g in groups)
        groups[sizes.index(smallest)].size = min(2 * smallest, n_ranks)
        sizes = [g.size for g in groups]
        start = 0
        for g in groups:  # re-lay the blocks: sizes are non-increasing, so every block stays aligned
            g.start, start = start, start + g.size
    if max_imbalance is not None:
        groups = _merge_buddies(groups, lengths, n_ranks, max_imbalance)
    return MicroBatch(groups), leftovers


def schedule_dynamic(lengths, n_ranks: int, cap: int, min_cp: int = 1, delta: float = 0.05, slack: float = 0.10,
                     refill: bool = True, max_imbalance: float | None = 1.1) -> Plan:
    """Dynamic CP over ``n_ranks`` DP×CP ranks (a power of two): micro-batches of CP groups of about equal work.

    Each sequence gets CP size ``cp_size_for(L, cap, min_cp)``, or more where its group is doubled (empty ranks)
    or merged (see below). ``delta``: a micro-batch closes once its ranks' work is within this fraction of the
    busiest; ``slack``: bucket overshoot. With ``refill=False, max_imbalance=None`` this is Megatron's algorithm;
    the toolkit adds two steps, both off by those values:

    - ``refill``: where Megatron closes a micro-batch because the next sequence fits nowhere, keep placing the
      longest sequence that fits (into a group of its CP size or larger) without raising the busiest rank's work;
    - ``max_imbalance``: a micro-batch still less balanced than max/mean = this merges its busiest group with the
      neighbouring block (twice the CP size for those sequences: more ring traffic, less work per rank).

    Sequences must be padded so that any CP size up to n_ranks cuts them into 2·cp chunks
    (``pad_length(L, 2 * n_ranks)``) for the plan to run with ring attention.
    """
    _need_power_of_two("n_ranks (DP*CP)", n_ranks)
    _need_power_of_two("min_cp", min_cp)
    if min_cp > n_ranks:
        raise ValueError(f"min_cp={min_cp} must be <= the number of ranks {n_ranks}")
    if max_imbalance is not None and not max_imbalance >= 1:
        raise ValueError(f"max_imbalance={max_imbalance} must be >= 1 (or None)")
    lengths = _check_lengths(lengths, n_ranks * cap, f"n_ranks*cap = {n_ranks}*{cap}")
    need = {s: cp_size_for(length, cap, min_cp, n_ranks) for s, length in enumerate(lengths)}
    wk = {s: work(length, need[s]) for s, length in enumerate(lengths)}
    remaining = sorted(range(len(lengths)), key=lambda s: (-lengths[s], s))
    mbs = []
    while remaining:
        mb, remaining = _next_micro_batch(remaining, lengths, need, wk, n_ranks, cap, delta, slack, refill,
                                          max_imbalance)
        mbs.append(mb)
    kind = "dynamic" if refill or max_imbalance is not None else "dynamic-megatron"
    return Plan(kind, lengths, n_ranks, cap, mbs)


# ---- on the ranks ---------------------------------------------------------------------------------------------
def prebuilt_groups(world_size: int) -> dict[tuple[int, int], object]:
    """Process groups for every aligned block of every power-of-two size >= 2: ``{(size, start): group}``.
    Collective: every rank calls it, once, before training (new groups per micro-batch would be far too slow)."""
    groups, size = {}, 2
    while size <= world_size:
        for start in range(0, world_size - size + 1, size):
            groups[(size, start)] = dist.new_group(list(range(start, start + size)))
        size *= 2
    return groups


def reroute(plan: Plan, owner: list[int], samples: dict[int, torch.Tensor], rank: int, group=None) -> list[dict]:
    """Send every rank the shards of the sequences its groups hold, all micro-batches at once, with one
    ``all_to_all_single`` over ``group`` (the DP×CP ranks; WORLD by default).

    ``owner[s]``: the rank that loaded sample s; ``samples``: this rank's own samples ``{s: tensor [L_s, C]}``
    (C columns, e.g. input token and target; all on one device, where the results go). Only the shard a rank
    needs travels (chunks j and 2cp-1-j; Megatron sends whole samples and slices on arrival). Returns, per
    micro-batch, this rank's ``rows`` ``[T, C]`` in ``CPLayout`` local order, ``positions`` in their sequences,
    the ``layout``, the group ``key`` (size, start) and the rank's index ``j`` in it.
    """
    n = plan.n_ranks
    send: list[list[torch.Tensor]] = [[] for _ in range(n)]
    for mb in plan.micro_batches:
        for g in mb.groups:
            for j, dest in enumerate(g.ranks):
                for s in g.samples:
                    if owner[s] == rank:
                        a, b = sample_parts(plan.lengths[s], g.size, j)
                        send[dest] += [samples[s][a.start:a.stop], samples[s][b.start:b.stop]]
    some = next(iter(samples.values()), torch.empty(0, 2, dtype=torch.long))
    width, dtype, device = some.shape[1], some.dtype, some.device
    flat = [torch.cat(parts) if parts else torch.empty(0, width, dtype=dtype, device=device) for parts in send]
    expect: list[list[tuple[int, int]]] = [[] for _ in range(n)]  # per source: (micro-batch, sample) in send order
    for i, mb in enumerate(plan.micro_batches):
        g = mb.group_of(rank)
        for s in g.samples:
            expect[owner[s]].append((i, s))
    mine = [g_.group_of(rank) for g_ in plan.micro_batches]
    rows_of = {(i, s): plan.lengths[s] // mine[i].size for src in expect for i, s in src}
    recv_splits = [sum(rows_of[x] for x in src) for src in expect]
    out = torch.empty(sum(recv_splits), width, dtype=dtype, device=device)
    dist.all_to_all_single(out, torch.cat(flat), recv_splits, [len(f) for f in flat], group=group)
    got, cursor = {}, 0
    for src in expect:
        for key in src:
            got[key] = out[cursor:cursor + rows_of[key]]
            cursor += rows_of[key]
    result = []
    for i, g in enumerate(mine):
        j = g.ranks.index(rank)
        halves = [got[(i, s)] for s in g.samples]
        cut = [len(h) // 2 if g.size > 1 else len(h) for h in halves]
        rows = torch.cat([h[:c] for h, c in zip(halves, cut)] + [h[c:] for h, c in zip(halves, cut)])
        layout = CPLayout([plan.lengths[s] for s in g.samples], g.size)
        result.append({"rows": rows, "positions": layout.coords(j, device)[1], "layout": layout,
                       "key": (g.size, g.start), "j": j, "samples": list(g.samples)})
    return result
