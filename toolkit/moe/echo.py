"""ECHO: elastic cloning of hot experts onto spare slots of under-loaded ranks (Megatron-LM draft PR #2368).

With skewed routing one rank's experts get most of the tokens; every other rank waits for it. ECHO gives each
rank a few empty expert *slots*; each step it copies the hottest experts into slots of the idle ranks and sends
part of their tokens there. Per MoE layer, per step, on every rank of the ep group::

    router ─► expert ids [T,K] ─► bincount ─► all_gather ─► counts [R, E] (the same on every rank)
                                                                 │
    plan_clones (greedy, pure, integer arithmetic: the same plan everywhere)
      load of rank r      L_r = Σ_{e home on r} Σ_src counts[src, e]          avg = ceil(Σ L / R)
      spare capacity      cap_r = max(avg - L_r, 0)   (ranks with a free slot)
      per-expert spill    on an over-loaded rank, experts sorted by load (ascending): the cumulative load
                          beyond avg, differenced: the largest experts spill, the small ones stay home
      assignment          spills (descending) and capacities (descending) laid end to end on one line;
                          each overlap [spill of e] ∩ [capacity of r] = one clone of e on r with that many tokens
      slots               one expert per spare slot: a rank keeps its largest overlaps; clones beyond
                          ``max_clones`` or below ``min_tokens`` are reclaimed (their tokens stay home)
                                                                 │
    copy the weights      home rank ─► all_to_all of flat expert parameters ─► clone slot (a leaf: the clone's
                          gradient collects there; ``Echo.reduce_grads`` after the backward sends it home with one
                          more all_to_all and adds it to the expert's ``.grad``)
    place the tokens      each source rank splits its pairs of expert e in proportion to the plan: home keeps
                          keep_e, clone j takes a_j of the expert's pairs, so source s sends about
                          c_s·a_j / Σc of its c_s pairs to clone j (``proportional_split``: exact totals)
    dispatch / experts / combine      the ordinary ``TokenDispatcher`` with the clone slots filled

Why proportionally: the plan fixes how many pairs each place computes, so the ranks' loads are the same however
the pairs are picked; the split decides who sends them. Cut from the expert's pairs numbered globally in source
order, the home expert would keep the first sources' pairs and a clone take whole sources' (one rank sending all
of its pairs of e to one clone, another none); split per source, every source sends each place its share.

Cost model (labelled as such wherever shown): step ≈ A · max_rank_tokens + B · clones + C — the busiest
rank's expert work, what each clone adds, and a fixed per-step cost. Each clone moves its weights out and its
gradient back (3·h·h_ff·b per clone for a SwiGLU expert; 2·h·h_ff + h_ff + h parameters for the tiny GPT's GELU
MLP). ``clone_break_even`` is the same trade at a real expert's size: the clone's bytes on a link against the
expert work of the pairs it takes off the busiest rank.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from toolkit.runtime import compat
from toolkit.runtime.spread import t_975


# ---- routing to plan for --------------------------------------------------------------------------------------
def zipf_routing(tokens: int, n_expert: int, top_k: int, s: float = 1.2, seed: int = 0,
                 order: torch.Tensor | None = None) -> torch.Tensor:
    """Expert ids [tokens, top_k]: each token picks ``top_k`` distinct experts, drawn without replacement with
    probability ∝ (popularity rank)^-s (Zipf). ``order[i]`` is the expert with popularity rank i (default:
    expert i, so the hottest experts share rank 0, the worst placement)."""
    for name, value in (("tokens", tokens), ("n_expert", n_expert), ("top_k", top_k)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if top_k > n_expert:
        raise ValueError(f"top_k={top_k} must be <= n_expert={n_expert}")
    if not s >= 0:
        raise ValueError(f"s={s!r}: the Zipf exponent must be >= 0")
    probs = torch.arange(1, n_expert + 1, dtype=torch.float64) ** -float(s)
    gen = torch.Generator().manual_seed(seed)
    ranked = torch.multinomial(probs.expand(tokens, n_expert), top_k, replacement=False, generator=gen)
    return ranked if order is None else order[ranked]


def expert_counts(ids: torch.Tensor, n_expert: int) -> torch.Tensor:
    """[n_expert] (token, expert) pairs per expert of one rank's ids [T,K]."""
    return torch.bincount(ids.reshape(-1), minlength=n_expert)


# ---- the greedy planner (pure) ----------------------------------------------------------------------------------
@dataclass
class Clone:
    expert: int
    """The expert copied."""
    rank: int
    """The rank hosting the copy."""
    slot: int
    """Its local spare slot on that rank (numbered after the rank's home experts: local, local+1, ...)."""
    tokens: int
    """(token, expert) pairs it takes over from the home expert."""


@dataclass
class ClonePlan:
    """What :func:`plan_clones` decided (integers only: identical on every rank)."""

    counts: list[list[int]]
    """[R][E] pairs each rank routes to each expert (the all-gathered input)."""
    local: int
    """Home experts per rank (expert e lives on rank e // local)."""
    spare_slots: int
    """Spare slots per rank."""
    avg: int
    """ceil(total pairs / R): the load every rank should carry."""
    load_before: list[int]
    """[R] pairs on each rank with every expert at home."""
    capacity: list[int]
    """[R] max(avg - L_r, 0) for ranks with a spare slot, else 0."""
    spill: list[int]
    """[E] pairs of each expert beyond what its rank should carry."""
    clones: list[Clone] = field(default_factory=list)
    """The clones kept, sorted by (rank, slot)."""
    reclaimed: list[Clone] = field(default_factory=list)
    """Overlaps the assignment found but dropped (no free slot, ``max_clones``, ``min_tokens``)."""

    @property
    def n_expert(self) -> int:
        return len(self.counts[0])

    @property
    def load_per_expert(self) -> list[int]:
        return [sum(row[e] for row in self.counts) for e in range(self.n_expert)]

    @property
    def keep(self) -> list[int]:
        """[E] pairs each expert keeps at home."""
        keep = self.load_per_expert
        for c in self.clones:
            keep[c.expert] -= c.tokens
        return keep

    @property
    def load_after(self) -> list[int]:
        """[R] pairs on each rank after cloning."""
        R = len(self.counts)
        keep, loads = self.keep, [0] * R
        for e, k in enumerate(keep):
            loads[e // self.local] += k
        for c in self.clones:
            loads[c.rank] += c.tokens
        return loads

    def ratio(self, loads: list[int]) -> float:
        """max / mean of rank loads (1.0 when perfectly balanced; 0 pairs: 1.0)."""
        total = sum(loads)
        return max(loads) * len(loads) / total if total else 1.0

    def split(self, expert: int) -> list[list[int]]:
        """[R][1 + clones of ``expert``]: pairs each source rank sends to the home expert, then to each of its
        clones in (rank, slot) order, in proportion to the plan (``proportional_split``)."""
        shares = [self.keep[expert]] + [c.tokens for c in self.clones if c.expert == expert]
        return proportional_split([row[expert] for row in self.counts], shares)

    def to_dict(self) -> dict:
        return {"avg": self.avg, "load_before": self.load_before, "load_after": self.load_after,
                "ratio_before": self.ratio(self.load_before), "ratio_after": self.ratio(self.load_after),
                "capacity": self.capacity, "spill": self.spill, "keep": self.keep,
                "clones": [vars(c) for c in self.clones], "reclaimed": [vars(c) for c in self.reclaimed]}


def plan_clones(counts: "torch.Tensor | list[list[int]]", local: int, spare_slots: int,
                max_clones: int | None = None, min_tokens: int = 1) -> ClonePlan:
    """The greedy ECHO plan from all-gathered counts [R, E] (see the module docstring).

    Args:
        counts: pairs each rank routes to each expert; E = R * local.
        local: home experts per rank.
        spare_slots: empty slots per rank that can host one clone each.
        max_clones: most clones in total (None: as many as slots allow).
        min_tokens: clones that would take fewer pairs are reclaimed (a copy that costs more than it buys).
    """
    counts = [[int(v) for v in row] for row in (counts.tolist() if isinstance(counts, torch.Tensor) else counts)]
    R = len(counts)
    if R < 1 or any(len(row) != R * local for row in counts) or local < 1:
        raise ValueError(f"counts must be [ranks, ranks * local] = [{R}, {R * local}] with local={local} >= 1, "
                         f"got rows of {sorted({len(row) for row in counts})}")
    if any(v < 0 for row in counts for v in row):
        raise ValueError("counts must be >= 0")
    if not isinstance(spare_slots, int) or spare_slots < 0:
        raise ValueError(f"spare_slots={spare_slots!r} must be an int >= 0")
    if max_clones is not None and (not isinstance(max_clones, int) or max_clones < 0):
        raise ValueError(f"max_clones={max_clones!r} must be None or an int >= 0")
    if not isinstance(min_tokens, int) or min_tokens < 1:
        raise ValueError(f"min_tokens={min_tokens!r} must be an int >= 1")
    E = R * local
    per_expert = [sum(row[e] for row in counts) for e in range(E)]
    load = [sum(per_expert[r * local:(r + 1) * local]) for r in range(R)]
    avg = -(-sum(load) // R)  # ceil: Σ capacity >= Σ spill
    capacity = [max(avg - L, 0) if spare_slots else 0 for L in load]
    spill = [0] * E
    for r in range(R):
        if load[r] <= avg:
            continue
        mine = sorted(range(r * local, (r + 1) * local), key=lambda e: (per_expert[e], e))
        cum, before = 0, 0
        for e in mine:
            cum += per_expert[e]
            over = max(cum - avg, 0)
            spill[e], before = over - before, over
    plan = ClonePlan(counts, local, spare_slots, avg, load, capacity, spill)
    # interval assignment: spills and capacities, each sorted descending, laid end to end
    spills = sorted((e for e in range(E) if spill[e]), key=lambda e: (-spill[e], e))
    hosts = sorted((r for r in range(R) if capacity[r]), key=lambda r: (-capacity[r], r))
    overlaps, s0, i, j, c0 = [], 0, 0, 0, 0
    while i < len(spills) and j < len(hosts):
        e, r = spills[i], hosts[j]
        s1, c1 = s0 + spill[e], c0 + capacity[r]
        amount = min(s1, c1) - max(s0, c0)
        if amount > 0:
            overlaps.append(Clone(e, r, -1, amount))
        if s1 <= c1:
            i, s0 = i + 1, s1
        else:
            j, c0 = j + 1, c1
    # one expert per slot: keep each rank's largest overlaps, then the largest overall, then drop small ones
    kept, per_rank = [], [0] * R
    for c in sorted(overlaps, key=lambda c: (-c.tokens, c.rank, c.expert)):
        ok = (c.tokens >= min_tokens and per_rank[c.rank] < spare_slots
              and (max_clones is None or len(kept) < max_clones))
        (kept if ok else plan.reclaimed).append(c)
        per_rank[c.rank] += ok
    kept.sort(key=lambda c: (c.rank, c.expert))
    for r in range(R):
        for n, c in enumerate(c for c in kept if c.rank == r):
            c.slot = local + n
    plan.clones = kept
    return plan


def check_plan(plan: ClonePlan) -> dict[str, bool]:
    """The plan's invariants: each expert gives away at most its spill, each rank takes at most its capacity,
    one expert per slot and at most ``spare_slots`` per rank, no clone on its expert's home rank, pairs conserved."""
    R, E = len(plan.counts), plan.n_expert
    given = [sum(c.tokens for c in plan.clones if c.expert == e) for e in range(E)]
    taken = [sum(c.tokens for c in plan.clones if c.rank == r) for r in range(R)]
    slots = [(c.rank, c.slot) for c in plan.clones]
    return {"within_spill": all(g <= s for g, s in zip(given, plan.spill)),
            "within_capacity": all(t <= c for t, c in zip(taken, plan.capacity)),
            "one_expert_per_slot": len(set(slots)) == len(slots)
            and all(plan.local <= s < plan.local + plan.spare_slots for _, s in slots),
            "not_on_home_rank": all(c.expert // plan.local != c.rank for c in plan.clones),
            "pairs_conserved": sum(plan.load_after) == sum(plan.load_before)}


# ---- from expert ids to slot ids ---------------------------------------------------------------------------------
def proportional_split(per_source: list[int], shares: list[int]) -> list[list[int]]:
    """[S][J]: how many of each source's ``per_source[s]`` pairs go to each place j, which takes ``shares[j]`` pairs
    (Σ shares = Σ per_source), every source split in proportion to the shares. Place by place, each takes its
    share of every source's remaining pairs, rounded cumulatively over the sources so that it gets exactly
    ``shares[j]``; the last takes what remains. Row and column sums are exact, every entry within a few pairs of
    ``per_source[s] · shares[j] / Σ per_source`` (the test measures the bound); integers only, the same everywhere."""
    if sum(shares) != sum(per_source) or min(shares + per_source, default=0) < 0:
        raise ValueError(f"shares {shares} must be >= 0 and sum to the pairs {sum(per_source)} of per_source")
    remaining, left = list(per_source), sum(per_source)
    out = [[0] * len(shares) for _ in per_source]
    for j, share in enumerate(shares):
        before = cumulative = 0
        for src, r in enumerate(remaining):
            cumulative += r
            cut = (2 * cumulative * share + left) // (2 * left) if left else 0  # round(cumulative · share / left)
            out[src][j], before = cut - before, cut
        remaining = [r - row[j] for r, row in zip(remaining, out)]
        left -= share
    return out


def assign_slots(ids: torch.Tensor, plan: ClonePlan, rank: int) -> torch.Tensor:
    """This rank's expert ids [T,K] -> slot ids [T,K] (rank-major slots, ``local + spare_slots`` per rank).

    For an expert with clones, this rank's share of each place is its row of ``plan.split(e)``: its pairs of e,
    in (token, k) order, go first to the home slot, then to the clones in (rank, slot) order, that many each."""
    per_rank = plan.local + plan.spare_slots
    flat = ids.reshape(-1).long()
    home = (flat // plan.local) * per_rank + flat % plan.local
    if not plan.clones:
        return home.view_as(ids)
    counts = torch.bincount(flat, minlength=plan.n_expert)
    order = flat.argsort(stable=True)  # by expert, then (token, k)
    position = torch.empty_like(flat)  # index of each pair among this rank's pairs of its expert
    position[order] = torch.arange(flat.numel(), device=ids.device) - (torch.cumsum(counts, 0) - counts)[flat[order]]
    slot = home.clone()
    for e in sorted({c.expert for c in plan.clones}):
        mine = plan.split(e)[rank]
        lo = mine[0]  # the first ones stay home
        for c, n in zip((c for c in plan.clones if c.expert == e), mine[1:]):
            slot[(flat == e) & (position >= lo) & (position < lo + n)] = c.rank * per_rank + c.slot
            lo += n
    return slot.view_as(ids)


# ---- cost model ----------------------------------------------------------------------------------------------------
def fit_cost_model(max_rank_tokens: list[float], clones: list[float], seconds: list[float]) -> dict:
    """Least squares of step seconds ≈ A · max_rank_tokens + B · clones + C (a cost model, not a measurement):
    A the seconds per (token, expert) pair on the busiest rank, B what each clone adds to the timed clock, C the
    fixed per-step cost. With the busiest rank's main-thread CPU time as ``seconds`` (lesson 15), B is the CPU-side
    overhead per clone: gloo moves the bytes on its own threads, so the transfers are not in it.

    Returns A, B, C, the prediction for each input, ``rank`` (of the design matrix; < 3: the terms cannot be told
    apart), ``corr`` (the correlation of max_rank_tokens with clones: near ±1 the fit cannot separate A from B),
    ``A_se``, ``B_se``, ``C_se`` (standard errors; None without a residual degree of freedom), ``dof`` and ``t95``
    (Student's t at 97.5 % for that many degrees of freedom: coefficient ± t95 · se is its 95 % interval)."""
    if not len(max_rank_tokens) == len(clones) == len(seconds) or len(seconds) < 3:
        raise ValueError("need at least 3 points (A, B and C), the same number of each")
    X = torch.tensor([[m, c, 1.0] for m, c in zip(max_rank_tokens, clones)], dtype=torch.float64)
    y = torch.tensor(seconds, dtype=torch.float64)[:, None]
    sol = torch.linalg.lstsq(X, y, driver="gelsd")
    coef, rank = sol.solution[:, 0], int(sol.rank)
    n = len(seconds)
    se = [None] * 3
    if rank == 3 and n > 3:
        rss = float(((X @ coef - y[:, 0]) ** 2).sum())
        se = (torch.linalg.inv(X.T @ X).diagonal() * rss / (n - 3)).sqrt().tolist()
    m, c = X[:, 0], X[:, 1]
    dm, dc = m - m.mean(), c - c.mean()
    denom = float((dm.square().sum() * dc.square().sum()).sqrt())
    A, B, C = (float(v) for v in coef)
    return {"A": A, "B": B, "C": C, "predicted": (X @ coef).tolist(), "rank": rank,
            "corr": float((dm * dc).sum()) / denom if denom else float("nan"),
            "A_se": se[0], "B_se": se[1], "C_se": se[2], "dof": n - 3, "t95": t_975(n - 3) if n > 3 else None}


def expert_param_count(hidden: int, ffn: int, gated: bool = False, bias: bool = True) -> int:
    """Parameters of one expert: gated (SwiGLU, 3·h·h_ff) or the tiny GPT's GELU MLP (2·h·h_ff + h_ff + h)."""
    return 3 * hidden * ffn if gated else 2 * hidden * ffn + (ffn + hidden if bias else 0)


def expert_flops_per_pair(hidden: int, ffn: int, gated: bool = False) -> int:
    """Forward FLOPs one (token, expert) pair costs its expert: 2·h·h_ff per GEMM, 3 GEMMs gated, 2 otherwise
    (the backward costs twice that)."""
    return 2 * (3 if gated else 2) * hidden * ffn


def clone_break_even(hidden: int, ffn: int, link, gpu, gated: bool = True, elem: int = 2) -> dict[str, float]:
    """A cost model of one clone at a real expert's size (``link``, ``gpu``: a ``toolkit.runtime.cluster`` Link and
    GPU). It costs its weights out and its gradient back, ``2 · (α + P·elem / β)``, neither hidden behind compute;
    each pair it takes off the busiest rank saves that rank the pair's expert work, forward and backward
    (``3 · expert_flops_per_pair`` at the plateau its GEMMs reach: ``gpu.efficiency.gemm`` of the peak). Break-even: ``clone_s / pair_s`` pairs; ``rows``: the clone's
    bytes counted in token rows of ``hidden`` (what the same bytes would carry in a dispatch)."""
    params = expert_param_count(hidden, ffn, gated, bias=False)
    clone_s = 2 * link.seconds(params * elem)
    pair_s = 3 * expert_flops_per_pair(hidden, ffn, gated) / (gpu.bf16_flops * gpu.efficiency.gemm)
    return {"params": params, "bytes": params * elem, "clone_s": clone_s, "pair_s": pair_s,
            "break_even_pairs": clone_s / pair_s, "rows": params / hidden}


# ---- the runtime: clones in the spare slots of an ExpertParallelMoE ---------------------------------------------------
class ClonedExpert(nn.Module):
    """A copy of a home expert whose parameters are views of one received row: the forward is the home expert's
    module called with these parameters (``torch.func.functional_call``), so the gradients land in the row."""

    def __init__(self, template: nn.Module, flat: torch.Tensor, expert: int):
        super().__init__()
        object.__setattr__(self, "template", template)  # not a submodule: its own parameters are not the clone's
        self.expert = expert
        names = [n for n, _ in template.named_parameters()]
        shapes = [p.shape for _, p in template.named_parameters()]
        self.params = dict(zip(names, (v.view(s) for v, s in zip(flat.split([s.numel() for s in shapes]), shapes))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(self.template, self.params, (x,))


def flat_params(module: nn.Module) -> torch.Tensor:
    """A module's parameters as one flat vector (a copy)."""
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


class Echo:
    """ECHO for one :class:`~toolkit.moe.layer.ExpertParallelMoE` (built with ``spare_slots >= 1``): installs itself
    as the layer's ``place`` hook, so every forward plans clones, copies the weights and places the tokens; after
    the backward, :meth:`reduce_grads` sends each clone's gradient home and adds it to the expert's ``.grad``::

        forward   counts ─► all_gather ─► plan_clones ─► all_to_all(home weights ─► clone slots) ─► slot ids
        backward  (autograd) clone gradients collect in ``received.grad``, one row per clone
        reduce    all_to_all(clone gradients ─► home ranks) ─► expert.grad += Σ its clones' gradients

    Collective: every rank of the layer's group runs the forward and ``reduce_grads``. ``enabled=False`` keeps every
    token at home (the same count exchange, no clones). After each forward: ``last_plan`` (:class:`ClonePlan`),
    ``received`` (the clones' weights here, a leaf); after ``reduce_grads``: ``clone_grads`` (the gradients of
    this rank's experts' clones, one row per clone, in ``sent_to`` order)."""

    def __init__(self, layer: nn.Module, max_clones: int | None = None, min_tokens: int = 1, enabled: bool = True):
        spare = layer.slots_per_rank - layer.local
        if spare < 1:
            raise ValueError("ECHO needs spare expert slots: build the layer with ExpertParallelMoE(..., spare_slots=1) "
                             "or more")
        self.layer, self.spare, self.max_clones, self.min_tokens, self.enabled = layer, spare, max_clones, min_tokens, enabled
        self.group = layer.dispatcher.group
        self.ep, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        self.phase = lambda name: contextlib.nullcontext()
        """``phase(name)`` wraps the count exchange ("echo_counts"), the weight copy ("echo_weights") and the
        gradient return ("echo_grads"), e.g. ``lambda name: ctx.ledger.tag(name)``."""
        self.last_plan: ClonePlan | None = None
        self.sent_to: list[Clone] = []
        self._into: list[Clone] = []
        self.received: torch.Tensor | None = None
        self.clone_grads: torch.Tensor | None = None
        layer.place = self

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        layer, E = self.layer, self.layer.n_expert
        flat = ids.reshape(-1)
        bad = bool(((flat < 0) | (flat >= E)).any())
        mine = torch.cat([torch.bincount(flat.clamp(0, E - 1), minlength=E), torch.tensor([int(bad)], device=ids.device)])
        every = torch.empty(self.ep * (E + 1), dtype=mine.dtype, device=ids.device)
        with self.phase("echo_counts"):
            compat.all_gather_single(every, mine, group=self.group)
        every = every.view(self.ep, E + 1)
        if int(every[:, E].sum()):  # an id out of range somewhere: the dispatcher's plan raises it on every rank
            self.last_plan = None
            self._fill([])
            return layer.home_slots(ids)
        plan = plan_clones(every[:, :E], layer.local, self.spare, self.max_clones if self.enabled else 0,
                           self.min_tokens)
        self.last_plan = plan
        self._fill(plan.clones)
        return assign_slots(ids, plan, self.rank)

    def _splits(self) -> tuple[list[int], list[int]]:
        local = self.layer.local
        return ([sum(c.rank == r for c in self.sent_to) for r in range(self.ep)],
                [sum(c.expert // local == r for c in self._into) for r in range(self.ep)])

    def _fill(self, clones: list[Clone]) -> None:
        """Copy each cloned expert's weights from its home rank into its slot (one all-to-all of flat rows)."""
        from .dispatcher import all_to_all
        layer, local = self.layer, self.layer.local
        for s in range(local, layer.slots_per_rank):
            layer.set_slot(s, None)
        self.received = self.clone_grads = None
        self.sent_to = [c for c in clones if c.expert // local == self.rank]  # sorted by (destination rank, slot)
        self._into = sorted((c for c in clones if c.rank == self.rank), key=lambda c: (c.expert // local, c.slot))
        if not clones:
            return
        template = layer.experts[0]
        P = sum(p.numel() for p in template.parameters())
        rows = (torch.stack([flat_params(layer.experts[c.expert % local]) for c in self.sent_to]) if self.sent_to
                else torch.zeros(0, P, device=next(template.parameters()).device))
        with self.phase("echo_weights"):
            got = all_to_all(rows, *self._splits(), self.group)
        self.received = got.requires_grad_()
        for c, row in zip(self._into, self.received):
            layer.set_slot(c.slot, ClonedExpert(template, row, c.expert))

    def reduce_grads(self) -> None:
        """After the backward: each clone's gradient goes home and is added to its expert's ``.grad``
        (collective; nothing to do when the plan made no clones)."""
        from .dispatcher import all_to_all
        if self.received is None:
            return
        local = self.layer.local
        grads = self.received.grad if self.received.grad is not None else torch.zeros_like(self.received)
        in_splits, out_splits = self._splits()
        with self.phase("echo_grads"):
            back = all_to_all(grads, out_splits, in_splits, self.group)  # rows in ``sent_to`` order
        for c, g in zip(self.sent_to, back):
            offset = 0
            for p in self.layer.experts[c.expert % local].parameters():
                piece = g[offset:offset + p.numel()].view_as(p)
                p.grad = piece.clone() if p.grad is None else p.grad.add_(piece)
                offset += p.numel()
        self.clone_grads = back


def enable_echo(model: nn.Module, **kwargs) -> list[Echo]:
    """:class:`Echo` on every ExpertParallelMoE of ``model`` (built by ``expert_parallel(model, spare_slots=...)``)."""
    from .layer import ExpertParallelMoE
    return [Echo(m, **kwargs) for m in model.modules() if isinstance(m, ExpertParallelMoE)]
