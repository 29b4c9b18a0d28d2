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
      rank 3      [ 420 ]                           cp 1                                 176 k
      (300, 100, 80 and 60 wait for the next micro-batch)

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

**The toolkit's two steps** (``schedule_dynamic(..., cost=)``; without a cost model, Megatron's rules as they
are). Work L²/cp is not time: a sequence spread over more ranks also sends its K/V round a longer ring. Given a
``GroupCost`` -- a group's modelled seconds from its tokens per rank, its work per rank and its CP size, ring
hops included (``dcp_sim.CostModel``) -- the scheduler keeps a clock per rank: a group starts once all its
ranks are free and ends its modelled time later, and the step so far ends with the latest clock. Then:

  5. refill: where Megatron closes the micro-batch because the next sequence fits nowhere, keep placing the
     longest one that fits, into a group of its CP size or larger that still ends no later than the
     micro-batch's last group (work that would otherwise wait, at no cost to the step so far);
  6. merge: while joining the group that ends last with its buddy block (the aligned block twice its size;
     its sequences then run at twice the CP size) makes the micro-batch end earlier, join them::

        ranks 0-3, cap 64    [ 64 ] [ 8 ] [ 8 ] [ 8 ]      rank 0 holds 64x the work of the others
        merge 0-1            [ 64 8 : cp 2 ] [ 8 ] [ 8 ]   half the work, plus a ring hop per step:
                                                           kept only if the modelled time goes down

  7. both are greedy, each micro-batch judged as it is built: a merge that ends one micro-batch sooner can
     still delay a later one. So the plan they build is kept only if its modelled step, rank clocks through
     every micro-batch (``modelled_step``), is shorter than Megatron's plan's; otherwise Megatron's plan it is.

Neither step looks at the balance of work: a merge that the ring would make slower is not made, however
unequal the work stays.
"""
from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections import deque
from itertools import accumulate
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from .ring_attention import CPLayout, is_power_of_two, ring_bytes, sample_parts

__all__ = ["cp_size_for", "work", "Group", "MicroBatch", "Plan", "GroupCost", "schedule_static", "schedule_dynamic",
           "greedy_micro_batches", "group_time", "micro_batch_time", "advance", "modelled_step", "merge_buddies",
           "prebuilt_groups", "reroute", "pad_length"]

GroupCost = Callable[[float, float, int], float]
"""A CP group's modelled seconds: ``cost(tokens per rank, work per rank Σ L²/cp, cp)``, ring hops included.
It must grow with the tokens and the work (the refill step searches on that)."""


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


def schedule_static(lengths, n_ranks: int, cp: int, cap: int, order: str = "data") -> Plan:
    """Static CP: one CP size ``cp`` for every sequence, dp = n_ranks / cp replicas; sequences are packed into
    packs of at most cp·cap tokens, pack i·dp + d going to replica d (Megatron's ``DpBalancedScheduler``; when
    the pack count is not a multiple of dp, single sequences are split off the last packs, and a replica with
    nothing left idles). ``order``: "data" packs them as they come; "length" sorts them longest first, so that
    a micro-batch's replicas get packs of alike work and the micro-batches change gradually (the packing half of
    what dynamic CP does, without its per-sequence CP size: the ablation of ``dcp_sim.compare``)."""
    _need_power_of_two("cp", cp)
    if n_ranks % cp:
        raise ValueError(f"cp={cp} must divide the number of ranks {n_ranks}")
    if order not in ("data", "length"):
        raise ValueError(f"order={order!r} is not allowed; allowed: 'data', 'length'")
    lengths = _check_lengths(lengths, cp * cap, f"cp*cap = {cp}*{cap}")
    ids = sorted(range(len(lengths)), key=lambda s: (-lengths[s], s)) if order == "length" else range(len(lengths))
    dp, packs, cur, total = n_ranks // cp, [], [], 0
    for s in ids:
        if cur and total + lengths[s] > cp * cap:
            packs.append(cur)
            cur, total = [], 0
        cur.append(s)
        total += lengths[s]
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
    return Plan("static" if order == "data" else "static-sorted", lengths, n_ranks, cap, mbs)


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


def group_time(group: Group, lengths: list[int], cost: GroupCost) -> float:
    """The modelled seconds of ``group`` (its sequences at its CP size); 0 for an empty group."""
    if not group.samples:
        return 0.0
    tokens = sum(lengths[s] for s in group.samples) / group.size
    return cost(tokens, sum(lengths[s] ** 2 for s in group.samples) / group.size, group.size)


def micro_batch_time(mb: MicroBatch, lengths: list[int], cost: GroupCost, clock: list[float] | None = None) -> float:
    """When a micro-batch's last group ends, in modelled seconds: each group starts once its ranks are free
    (``clock``: when each rank finished the micro-batches before; None: all at 0) and takes ``group_time``."""
    return max(_start(g, clock) + group_time(g, lengths, cost) for g in mb.groups)


def _start(group: Group, clock: list[float] | None) -> float:
    return max(clock[r] for r in group.ranks) if clock is not None else 0.0


def advance(clock: list[float], mb: MicroBatch, lengths: list[int], cost: GroupCost) -> None:
    """Move the rank clocks past ``mb``: every rank of a group ends when the group does."""
    for g in mb.groups:
        end = _start(g, clock) + group_time(g, lengths, cost)
        for r in g.ranks:
            clock[r] = end


def modelled_step(plan: "Plan", cost: GroupCost) -> float:
    """A plan's modelled step time: rank clocks (``advance``) through its micro-batches, the latest at the end."""
    clock = [0.0] * plan.n_ranks
    for mb in plan.micro_batches:
        advance(clock, mb, plan.lengths, cost)
    return max(clock)


def _refill(buckets: list[deque], groups: list[Group], tokens: dict, lengths: list[int], need: dict[int, int],
            cap: int, cost: GroupCost, clock: list[float]):
    """The longest remaining sequence that some group of its CP size or larger can take within the cap and
    without ending after the micro-batch's last group, and the earliest-ending such group; None if none."""
    top = micro_batch_time(MicroBatch(groups), lengths, cost, clock)
    flat = [s for b in buckets for s in b]  # longest first: the buckets are consecutive runs of one sorted list
    start = {id(g): _start(g, clock) for g in groups}
    square = {id(g): sum(lengths[s] ** 2 for s in g.samples) for g in groups}

    def fits(s: int, g: Group) -> bool:
        size, n = g.size, lengths[s]
        return (need[s] <= size and tokens[id(g)] + n // size <= cap
                and start[id(g)] + cost(tokens[id(g)] + n / size, (square[id(g)] + n * n) / size, size) <= top)

    # per group, the first (longest) sequence it takes: a shorter one fits wherever a longer one does
    first = {id(g): bisect_left(range(len(flat)), True, key=lambda i, g=g: fits(flat[i], g)) for g in groups}
    i = min(first.values())
    if i == len(flat):
        return None
    s = flat[i]
    group = min((g for g in groups if first[id(g)] == i), key=lambda g: _start(g, clock) + group_time(g, lengths, cost))
    for bucket in buckets:
        if i < len(bucket):
            return bucket, s, group
        i -= len(bucket)


def merge_buddies(mb: MicroBatch, lengths: list[int], n_ranks: int, cost: GroupCost,
                  clock: list[float] | None = None) -> MicroBatch:
    """While joining the group that ends last with its buddy block (the aligned block twice its size: every group
    inside it; their sequences then use twice the CP size, with a longer ring) makes the micro-batch end sooner
    (``micro_batch_time`` from the rank ``clock``), join them. A merge that would not pay -- the ring's extra hops
    cost more than the halved work saves -- is not made, however unequal the work stays."""
    groups = list(mb.groups)
    while True:
        times = [_start(g, clock) + group_time(g, lengths, cost) for g in groups]
        slowest = groups[times.index(max(times))]
        if slowest.size >= n_ranks:
            return MicroBatch(groups)
        size = 2 * slowest.size
        start = slowest.start // size * size
        inside = [g for g in groups if start <= g.start < start + size]
        merged = Group(size, start, [s for g in inside for s in g.samples])
        candidate = sorted([g for g in groups if g not in inside] + [merged], key=lambda g: g.start)
        if micro_batch_time(MicroBatch(candidate), lengths, cost, clock) >= max(times):
            return MicroBatch(groups)
        groups = candidate


def _next_micro_batch(ids: list[int], lengths: list[int], need: dict[int, int], wk: dict[int, float], n_ranks: int,
                      cap: int, delta: float, slack: float, cost: GroupCost | None,
                      clock: list[float]) -> tuple[MicroBatch, list[int]]:
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
        if group is None:  # Megatron ends the micro-batch here; refill tops up groups that end before the last
            found = _refill(buckets, groups, tokens, lengths, need, cap, cost, clock) if cost is not None else None
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
    mb = MicroBatch(groups)
    return (merge_buddies(mb, lengths, n_ranks, cost, clock) if cost is not None else mb), leftovers


def schedule_dynamic(lengths, n_ranks: int, cap: int, min_cp: int = 1, delta: float = 0.05, slack: float = 0.10,
                     cost: GroupCost | None = None) -> Plan:
    """Dynamic CP over ``n_ranks`` DP×CP ranks (a power of two): micro-batches of CP groups of about equal work.

    Each sequence gets CP size ``cp_size_for(L, cap, min_cp)``, or more where its group is doubled (empty ranks)
    or merged (see below). ``delta``: a micro-batch closes once its ranks' work is within this fraction of the
    busiest; ``slack``: bucket overshoot. Without ``cost`` this is Megatron's algorithm. With a ``GroupCost``
    (a group's modelled seconds, ring included) the toolkit adds two steps, each taken only where the model says
    it pays (the module docstring, steps 5 and 6):

    - refill: where Megatron closes a micro-batch because the next sequence fits nowhere, keep placing the
      longest sequence that fits (into a group of its CP size or larger) where its group still ends no later
      than the micro-batch's last (rank clocks: a group starts once its ranks are free);
    - merge: join the group that ends last with its buddy block (twice the CP size for those sequences: more
      ring traffic, less work per rank) while that makes the micro-batch end sooner (``merge_buddies``);
    - and the plan these steps build is kept only if its modelled step (``modelled_step``) is shorter than
      Megatron's plan's; otherwise Megatron's micro-batches are returned (as kind "dynamic").

    Sequences must be padded so that any CP size up to n_ranks cuts them into 2·cp chunks
    (``pad_length(L, 2 * n_ranks)``) for the plan to run with ring attention.
    """
    _need_power_of_two("n_ranks (DP*CP)", n_ranks)
    _need_power_of_two("min_cp", min_cp)
    if min_cp > n_ranks:
        raise ValueError(f"min_cp={min_cp} must be <= the number of ranks {n_ranks}")
    if cost is not None and not callable(cost):
        raise ValueError(f"cost={cost!r} must be a GroupCost: a callable (tokens per rank, work per rank, cp) -> "
                         f"seconds, or None for Megatron's rules")
    lengths = _check_lengths(lengths, n_ranks * cap, f"n_ranks*cap = {n_ranks}*{cap}")
    megatron = Plan("dynamic-megatron", lengths, n_ranks, cap,
                    greedy_micro_batches(lengths, n_ranks, cap, min_cp, delta, slack))
    if cost is None:
        return megatron
    greedy = Plan("dynamic", lengths, n_ranks, cap,
                  greedy_micro_batches(lengths, n_ranks, cap, min_cp, delta, slack, cost))
    if modelled_step(greedy, cost) < modelled_step(megatron, cost):
        return greedy
    return Plan("dynamic", lengths, n_ranks, cap, megatron.micro_batches)  # step 7: the greedy steps did not pay


def greedy_micro_batches(lengths: list[int], n_ranks: int, cap: int, min_cp: int = 1, delta: float = 0.05,
                         slack: float = 0.10, cost: GroupCost | None = None) -> list[MicroBatch]:
    """Micro-batches until every sequence is placed, longest first: Megatron's rules, and with ``cost`` the
    refill and merge steps, each micro-batch judged as it is built on rank clocks that it then moves on
    (steps 1-6 of the module docstring; ``schedule_dynamic`` adds step 7). Lengths as checked by it."""
    need = {s: cp_size_for(length, cap, min_cp, n_ranks) for s, length in enumerate(lengths)}
    wk = {s: work(length, need[s]) for s, length in enumerate(lengths)}
    remaining = sorted(range(len(lengths)), key=lambda s: (-lengths[s], s))
    mbs, clock = [], [0.0] * n_ranks
    while remaining:
        mb, remaining = _next_micro_batch(remaining, lengths, need, wk, n_ranks, cap, delta, slack, cost, clock)
        mbs.append(mb)
        if cost is not None:
            advance(clock, mb, lengths, cost)
    return mbs


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
