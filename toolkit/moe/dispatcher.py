"""The token dispatcher for expert parallelism: how tokens reach experts on other ranks, and come back.

Each of the ``ep`` ranks of a process group owns ``S = n_slots / ep`` expert *slots* (slot s lives on rank
s // S). A router picks top-k experts per token; a placement maps them to slots (by default expert e sits in
slot e; a placement hook can send some tokens to a clone of a hot expert instead). Per MoE layer::

    rank r                                                                          rank j (owns slots jS..jS+S-1)
    x [T,H] ─ router ─► weights, slot ids [T,K]
                 │
      plan       ├─ layout: pairs per slot, rows per rank, token-in-rank mask  (dispatch_layout)
    (collective) ├─ all_gather of the count vectors [R, n_slots + R + flags]: every rank learns what every
                 │  rank sends and receives, and every rank raises the same ValueError for a bad input
                 │  (index out of range, NaN router weights, NaN tokens under a quantized codec, capacity)
                 ▼
      permute    rows sorted by destination rank, then slot, then token        (dedup: one row per (token, rank))
      dispatch   codec.encode ─► all_to_all_single(in_splits ─► out_splits) ─► codec.decode ────────►  rows
                                                                                                        │ source-major
                                                                          regroup by local slot (stable) ▼
                                                                          expert input [P,H] = slot-major,
                                                                          then source rank, then token order
                                                                                        │
                                                                          local experts (one per slot)
                                                                                        │
      combine    ◄──────────── all_to_all_single (combine codec, e.g. bf16 or none) ◄──┘  (dedup: weighted sum
                                                                                         per row on rank j)
      unpermute  y[t] = Σ_k weight[t,k] · expert_k(x[t])  (index_add over the pairs; dropped pairs add nothing)

Autograd runs through both all-to-alls: the backward of dispatch is an all-to-all the other way (a combine
without the weights) and the backward of combine is a dispatch. Quantized codecs are straight-through: the
gradient travels in the combine codec. Every all-to-all can be issued asynchronously: ``dispatch(...,
async_op=True)`` returns a :class:`Pending` whose ``wait()`` finishes the receive, so another micro-batch
can compute in between; the backward transfers are issued in one autograd node and completed in the next,
so autograd runs whatever else is ready in between.

Receive order is deterministic (slot, source rank, token order), so outputs and gradients do not depend on
timing. ``dedup=True`` sends a token once per destination *rank* however many of its experts live there
(DeepEP's dispatch), with the gate weights beside it; the expert side applies them and sums per row.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from toolkit.comm import quant_a2a
from toolkit.quant import all_finite
from toolkit.runtime import compat
from toolkit.runtime.opcost import host_read

CODECS = quant_a2a.MODES  # "none" (the tensor as it is), "bf16", "int8", "int4", "fp8" (e4m3 bits as uint8)
OVERFLOW = ("error", "drop")


# ---- payload codec ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Codec:
    """How a token row travels: ``mode`` in :data:`CODECS`; quantized modes keep one fp32 scale per token
    per ``block`` channels (``toolkit.comm.quant_a2a`` is the wire format). Any object with these three
    methods can stand in for it."""

    mode: str = "none"
    block: int = 128
    check_finite: bool = True
    """Quantized modes refuse NaN/Inf tokens (the host reads a flag: a sync). ``LowLatency`` turns it off."""

    def __post_init__(self):
        if self.mode not in CODECS:
            raise ValueError(f"codec={self.mode!r} is not allowed; allowed: {CODECS}")
        if not isinstance(self.block, int) or isinstance(self.block, bool) or self.block < 2 or self.block % 2:
            raise ValueError(f"block={self.block!r} must be an even int >= 2 (channels per fp32 scale)")

    @property
    def quantized(self) -> bool:
        return self.mode in ("int8", "int4", "fp8")

    def row_bytes(self, hidden: int, dtype: torch.dtype = torch.float32) -> int:
        """Bytes one token row occupies on the wire."""
        return quant_a2a.wire_bytes_per_token(self.mode, hidden, self.block, dtype)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens [T,H] -> wire rows [T, cols] (uint8 for quantized modes)."""
        return quant_a2a.encode(x, self.mode, self.block, self.check_finite)

    def decode(self, wire: torch.Tensor, hidden: int, dtype: torch.dtype) -> torch.Tensor:
        """Wire rows [R, cols] -> tokens [R, hidden] of ``dtype``."""
        return quant_a2a.decode(wire, self.mode, hidden, dtype, self.block)


def as_codec(codec: "str | Codec", block: int = 128) -> Codec:
    return Codec(codec, block) if isinstance(codec, str) else codec


# ---- router and layout --------------------------------------------------------------------------------------
def route(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k softmax gate (the tiny GPT's ``Router``): weights [T,K] summing to 1 and expert ids [T,K].

    Raises ValueError for top_k outside 1..n_expert and for NaN/Inf logits (local check; inside a layer
    the dispatcher's plan catches NaN weights on every rank at once)."""
    n_expert = logits.shape[-1]
    if not isinstance(top_k, int) or not 1 <= top_k <= n_expert:
        raise ValueError(f"top_k={top_k!r} must be in 1..n_expert={n_expert}")
    if not bool(torch.isfinite(logits).all()):
        raise ValueError(f"router logits hold {int(torch.isnan(logits).sum())} NaN and "
                         f"{int(torch.isinf(logits).sum())} Inf values; the gate cannot rank experts")
    weights, ids = logits.softmax(dim=-1).topk(top_k, dim=-1)
    return weights / weights.sum(-1, keepdim=True), ids


@dataclass
class Layout:
    """DeepEP's ``get_dispatch_layout``: what one rank's routing sends where."""

    tokens_per_rank: torch.Tensor
    """[R] tokens with at least one (kept) expert on each rank (a token counts once per rank)."""
    tokens_per_expert: torch.Tensor
    """[n_slots] (token, expert) pairs per slot."""
    token_in_rank: torch.Tensor
    """[T,R] bool: token t goes to rank r."""
    tokens_per_node: torch.Tensor | None = None
    """[nodes] tokens going to each node (with ``ranks_per_node``)."""
    token_in_node: torch.Tensor | None = None
    """[T,nodes] bool."""


def dispatch_layout(ids: torch.Tensor, n_slots: int, n_ranks: int, ranks_per_node: int | None = None,
                    keep: torch.Tensor | None = None) -> Layout:
    """The layout of slot ids [T,K] (``keep`` [T,K] bool masks dropped pairs), vectorized."""
    per_rank = n_slots // n_ranks
    keep = torch.ones_like(ids, dtype=torch.bool) if keep is None else keep
    hit = torch.nn.functional.one_hot(ids // per_rank, n_ranks).bool() & keep[..., None]  # [T,K,R]
    token_in_rank = hit.any(1)
    out = Layout(token_in_rank.sum(0), torch.bincount(ids[keep], minlength=n_slots), token_in_rank)
    if ranks_per_node:
        out.token_in_node = token_in_rank.view(ids.shape[0], n_ranks // ranks_per_node, ranks_per_node).any(2)
        out.tokens_per_node = out.token_in_node.sum(0)
    return out


# ---- the differentiable, optionally asynchronous all-to-all -------------------------------------------------
class _Transfer:
    """One all-to-all and its backward: the state the start/wait autograd nodes share."""

    def __init__(self, in_splits, out_splits, group, codec: Codec, grad_codec: Codec, trace=None):
        self.in_splits, self.out_splits, self.group = in_splits, out_splits, group
        self.codec, self.grad_codec = codec, grad_codec
        self.trace = trace or (lambda event, transfer: contextlib.nullcontext())
        self.work = self.recv = self.send = None

    def start(self, x: torch.Tensor, codec: Codec, in_splits, out_splits, event: str = "issue") -> None:
        self.hidden, self.dtype, self.codec_now = x.shape[1], x.dtype, codec
        self.send = codec.encode(x).contiguous()  # kept alive until the transfer completes
        self.recv = self.send.new_empty((sum(out_splits), *self.send.shape[1:]))
        with self.trace(event, self):
            self.work = dist.all_to_all_single(self.recv, self.send, out_splits, in_splits, group=self.group,
                                               async_op=True)

    def finish(self, event: str = "wait") -> torch.Tensor:
        with self.trace(event, self):
            self.work.wait()
        out = self.codec_now.decode(self.recv, self.hidden, self.dtype)
        self.work = self.recv = self.send = None
        return out


class _Start(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, t: _Transfer):
        ctx.t = t
        t.start(x.detach(), t.codec, t.in_splits, t.out_splits)
        return x.new_empty(0)  # a token that links the wait node to this one in the graph

    @staticmethod
    def backward(ctx, _):
        return ctx.t.finish("grad_wait"), None  # the gradient's all-to-all, issued by _Wait.backward


class _Wait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, token, t: _Transfer):
        ctx.t = t
        return t.finish()

    @staticmethod
    def backward(ctx, grad):
        t = ctx.t
        t.start(grad.contiguous(), t.grad_codec, t.out_splits, t.in_splits, "grad_issue")  # the other way round
        return grad.new_empty(0), None


class Pending:
    """An all-to-all in flight. ``wait()`` completes it and returns the (post-processed) result; call it
    once, just before the result is needed."""

    def __init__(self, token: torch.Tensor, transfer: _Transfer, then: Callable[[torch.Tensor], object]):
        self._token, self._t, self._then, self._done = token, transfer, then, False

    @property
    def token(self) -> torch.Tensor:
        """The start node's output (empty): ``torch.autograd.grad(result, token, grad)`` runs the backward up to
        issuing the gradient's all-to-all, ``torch.autograd.grad(token, x, that)`` finishes it (a backward that
        yields at each transfer: ``toolkit.moe.overlap.micro_batch_backward``)."""
        return self._token

    def wait(self):
        if self._done:
            raise RuntimeError("Pending.wait() was already called; keep its result")
        self._done = True
        return self._then(_Wait.apply(self._token, self._t))


def all_to_all(x: torch.Tensor, in_splits: list[int], out_splits: list[int], group=None,
               codec: "str | Codec" = "none", grad_codec: "str | Codec" = "none",
               async_op: bool = False) -> "torch.Tensor | Pending":
    """Autograd-aware ``all_to_all_single`` of rows [T,H]: ``in_splits[j]`` rows to rank j, ``sum(out_splits)``
    rows back, through ``codec``; the backward sends the gradient the other way through ``grad_codec``."""
    t = _Transfer(list(in_splits), list(out_splits), group, as_codec(codec), as_codec(grad_codec))
    pending = Pending(_Start.apply(x, t), t, lambda y: y)
    return pending if async_op else pending.wait()


# ---- the plan: who sends what where -------------------------------------------------------------------------
@dataclass
class Plan:
    """One layer call's routing, identical in meaning on every rank (built by :meth:`TokenDispatcher.plan`)."""

    ids: torch.Tensor
    """[T,K] slot ids of this rank's tokens."""
    weights: torch.Tensor
    """[T,K] gate weights (autograd flows through them)."""
    keep: torch.Tensor
    """[T,K] bool: pairs that are dispatched (False: dropped by the capacity)."""
    layout: Layout
    """This rank's layout (after drops)."""
    counts: torch.Tensor
    """[R, n_slots] pairs each rank sends to each slot (all-gathered, after drops)."""
    demand: torch.Tensor
    """[R, n_slots] pairs each rank routed to each slot (before drops)."""
    in_splits: list[int]
    """Rows this rank sends to each rank."""
    out_splits: list[int]
    """Rows this rank receives from each rank."""
    recv_counts: list[int]
    """Pairs this rank's experts receive, per local slot (DeepEP's num_recv_tokens_per_expert_list)."""
    send_token: torch.Tensor
    """[rows] token index of each sent row (rows sorted by destination rank)."""
    send_rank: torch.Tensor | None = None
    """[rows] destination rank of each sent row."""
    send_pair: torch.Tensor | None = None
    """[rows] flat pair index (t*K + k) of each sent row (without dedup)."""
    by_slot: torch.Tensor | None = None
    """Permutation of the received rows into slot-major order (without dedup)."""
    recv: dict = field(default_factory=dict)
    """Filled when the dispatch completes (dedup: which received row feeds which local slot, with weight)."""

    @property
    def tokens_per_expert(self) -> torch.Tensor:
        """[n_slots] pairs per slot over the whole ep group (after drops)."""
        return self.counts.sum(0)

    @property
    def dropped(self) -> torch.Tensor:
        """[n_slots] pairs dropped by the capacity over the whole ep group."""
        return (self.demand - self.counts).sum(0)


class TokenDispatcher:
    """Dispatch and combine of MoE tokens over the ``ep`` process ``group`` (see the module docstring).

    Args:
        n_slots: expert slots over the whole group (``n_expert``, plus spare slots for clones); divisible by ep.
        top_k: experts per token.
        codec: the dispatch payload (:data:`CODECS` or a :class:`Codec`); ``block`` channels per scale.
        combine_codec: the combine payload, also used by both backward transfers ("none" or "bf16" usually).
        dedup: send a token once per destination rank (gate weights travel with it, applied expert-side).
        capacity: most pairs one slot accepts from one rank per call (None: unlimited).
        overflow: "error" (ValueError on every rank) or "drop" (the first ``capacity`` tokens in token order
            are kept; dropped pairs contribute nothing and are counted in ``Plan.dropped``).
    """

    def __init__(self, n_slots: int, top_k: int, group=None, codec: "str | Codec" = "none",
                 combine_codec: "str | Codec" = "none", block: int = 128, dedup: bool = False,
                 capacity: int | None = None, overflow: str = "error"):
        self.group = group
        self.ep, self.rank = dist.get_world_size(group), dist.get_rank(group)
        for name, value in (("n_slots", n_slots), ("top_k", top_k)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if top_k > n_slots:
            raise ValueError(f"top_k={top_k} must be <= the number of experts n_slots={n_slots}")
        if n_slots % self.ep:
            raise ValueError(f"n_slots={n_slots} experts must be divisible by the expert-parallel size ep={self.ep} "
                             "(each rank owns the same number of expert slots)")
        if capacity is not None and (not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1):
            raise ValueError(f"capacity={capacity!r} must be None (unlimited) or an int >= 1")
        if overflow not in OVERFLOW:
            raise ValueError(f"overflow={overflow!r} is not allowed; allowed: {OVERFLOW}")
        self.n_slots, self.top_k, self.local = n_slots, top_k, n_slots // self.ep
        self.codec, self.combine_codec = as_codec(codec, block), as_codec(combine_codec, block)
        self.dedup, self.capacity, self.overflow = dedup, capacity, overflow
        self.phase: Callable[[str], contextlib.AbstractContextManager] = lambda name: contextlib.nullcontext()
        """``phase(name)`` wraps each step ("routing", "dispatch", "dispatch_meta", "combine"), e.g.
        ``lambda name: ctx.ledger.tag(name)``."""
        self.trace: Callable[[str, _Transfer], contextlib.AbstractContextManager] | None = None
        """``trace(event, transfer)`` wraps each issue and wait of the dispatch/combine all-to-alls, forward
        ("issue", "wait") and backward ("grad_issue", "grad_wait"); ``transfer.work`` is the handle once issued
        (lesson 02 draws exposed communication from it). Read when ``dispatch``/``combine`` is called."""

    # -- plan ---------------------------------------------------------------------------------------------
    def plan(self, ids: torch.Tensor, weights: torch.Tensor, x: torch.Tensor | None = None) -> Plan:
        """Collective: layout, capacity and the all-gathered counts for slot ids and gate weights [T,K].

        ``x`` [T,H] (optional) lets every rank check the tokens are finite (quantized codecs need it)."""
        if ids.dim() != 2 or ids.shape[1] != self.top_k or weights.shape != ids.shape:
            raise ValueError(f"ids and weights must both be [tokens, top_k={self.top_k}], got "
                             f"{tuple(ids.shape)} and {tuple(weights.shape)}")
        T, E, R = ids.shape[0], self.n_slots, self.ep
        ids = ids.long()
        in_range = bool(((ids >= 0) & (ids < E)).all())
        lo, hi = (int(ids.min()), int(ids.max())) if ids.numel() else (0, 0)
        safe = ids.clamp(0, E - 1)
        demand = torch.bincount(safe.reshape(-1), minlength=E)
        keep = self._capacity_mask(safe)
        kept = torch.bincount(safe[keep], minlength=E)
        layout = dispatch_layout(safe, E, R, keep=keep)
        rows_to = layout.tokens_per_rank if self.dedup else kept.view(R, self.local).sum(1)
        flags = [int(in_range), lo, hi, int(all_finite(weights)),
                 int(x is None or not self.codec.quantized or all_finite(x)),
                 CODECS.index(self.codec.mode), self.codec.block, -1 if x is None else x.shape[1], int(self.dedup)]
        dev = ids.device
        mine = torch.cat([demand, kept, rows_to, torch.tensor(flags, device=dev)]).to(torch.int64)
        every = torch.empty(R * mine.numel(), dtype=torch.int64, device=dev)
        with self.phase("routing"):
            compat.all_gather_single(every, mine, group=self.group)
        every = every.view(R, -1)
        self._raise_if_bad(every[:, 2 * E + R:], every[:, :E])
        demand_all, counts = every[:, :E], every[:, E:2 * E]
        rows = every[:, 2 * E:2 * E + R]  # [src, dst]
        # the host reads the exchanged counts: the receive buffer's size and the splits come from them (a host sync,
        # before any token moves: what DeepEP's normal mode does, and why it cannot be captured in a CUDA graph)
        sizes = host_read(torch.cat([rows[self.rank], rows[:, self.rank], counts[:, self._my_slots()].sum(0)]))
        plan = Plan(ids, weights, keep, layout, counts, demand_all, sizes[:R], sizes[R:2 * R], sizes[2 * R:],
                    ids.new_empty(0))
        if self.dedup:  # rows: (token, destination rank), sorted by rank then token
            plan.send_rank, plan.send_token = layout.token_in_rank.t().nonzero(as_tuple=True)
        else:  # rows: (token, slot) pairs sorted by slot (hence by rank), then token
            flat = torch.where(keep.reshape(-1), safe.reshape(-1), E)  # dropped pairs sort last
            order = flat.argsort(stable=True)[:int(keep.sum())]
            plan.send_pair, plan.send_token = order, order // self.top_k
            recv = counts[:, self._my_slots()]  # [src, local slot]: received rows come source-major
            local_id = torch.arange(self.local, device=dev).repeat(R).repeat_interleave(recv.reshape(-1))
            plan.by_slot = local_id.argsort(stable=True)
        return plan

    def _my_slots(self) -> slice:
        return slice(self.rank * self.local, (self.rank + 1) * self.local)

    def _capacity_mask(self, ids: torch.Tensor) -> torch.Tensor:
        """[T,K] True for pairs within ``capacity`` (the first tokens in token order keep their place)."""
        if self.capacity is None:
            return torch.ones_like(ids, dtype=torch.bool)
        flat = ids.reshape(-1)
        order = flat.argsort(stable=True)
        starts = torch.cumsum(torch.bincount(flat, minlength=self.n_slots), 0) - torch.bincount(flat, minlength=self.n_slots)
        position = torch.empty_like(flat)
        position[order] = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
        return (position < self.capacity).view_as(ids)

    def _raise_if_bad(self, flags: torch.Tensor, demand: torch.Tensor) -> None:
        """The same ValueError on every rank (each rank sees every rank's flags)."""
        bad = lambda col: [r for r in range(self.ep) if not int(flags[r, col])]
        if ranks := bad(0):
            lo, hi = int(flags[ranks, 1].min()), int(flags[ranks, 2].max())
            raise ValueError(f"expert ids out of range on rank(s) {ranks}: ids must be in 0..{self.n_slots - 1} "
                             f"(n_slots={self.n_slots}), got values in {lo}..{hi}")
        if ranks := bad(3):
            raise ValueError(f"router weights hold NaN/Inf on rank(s) {ranks} (NaN router logits?); "
                             "the gate weights must be finite")
        if ranks := bad(4):
            raise ValueError(f"tokens x hold NaN/Inf on rank(s) {ranks}; codec {self.codec.mode!r} needs finite "
                             "tokens (its scales would be inf/nan)")
        for col, name in ((5, "codec"), (6, "block"), (7, "hidden size"), (8, "dedup")):
            values = flags[:, col]
            if col == 7:
                values = values[values >= 0]
            if values.numel() and not torch.all(values == values[0]):
                show = (lambda v: repr(CODECS[v])) if col == 5 else str
                raise ValueError(f"ranks disagree on the dispatcher's {name} ("
                                 + ", ".join(f"rank {r}: {show(int(v))}" for r, v in enumerate(flags[:, col]))
                                 + "); every rank must use the same")
        if self.capacity is not None and self.overflow == "error" and int(demand.max()) > self.capacity:
            src, slot = divmod(int(demand.argmax()), self.n_slots)
            raise ValueError(f"capacity={self.capacity} is too small: slot {slot} gets {int(demand.max())} tokens "
                             f"from rank {src}; raise capacity to >= {int(demand.max())} or pass overflow='drop' "
                             "(dropped pairs are counted in Plan.dropped)")

    # -- dispatch -----------------------------------------------------------------------------------------
    def dispatch(self, x: torch.Tensor, plan: Plan, async_op: bool = False) -> "torch.Tensor | Pending":
        """Tokens x [T,H] -> this rank's expert input [sum(plan.recv_counts), H], slot-major
        (split it with ``plan.recv_counts``). ``async_op=True``: a :class:`Pending` to ``wait()`` on."""
        rows = x[plan.send_token]
        with self.phase("dispatch"):
            t = _Transfer(plan.in_splits, plan.out_splits, self.group, self.codec, self.combine_codec, self.trace)
            token = _Start.apply(rows, t)
        if not self.dedup:
            return self._maybe_wait(Pending(token, t, lambda recv: recv[plan.by_slot]), async_op)
        meta = self._meta(plan)  # [rows, 2K]: weights of this destination's pairs, their local slot or -1
        with self.phase("dispatch_meta"):
            meta_pending = all_to_all(meta, plan.in_splits, plan.out_splits, self.group, async_op=True)

        def expert_input(recv: torch.Tensor) -> torch.Tensor:
            got = meta_pending.wait()
            w, slot = got[:, :self.top_k], got[:, self.top_k:].detach().long()
            row, k = (slot >= 0).nonzero(as_tuple=True)  # row-major: source rank, token order
            order = slot[row, k].argsort(stable=True)  # slot-major, stable
            row, k = row[order], k[order]
            if row.numel() != sum(plan.recv_counts):
                raise RuntimeError(f"received {row.numel()} pairs, the counts promised {sum(plan.recv_counts)}")
            plan.recv.update(row=row, weight=w[row, k], n_rows=recv.shape[0])
            return recv[row]
        return self._maybe_wait(Pending(token, t, expert_input), async_op)

    def _meta(self, plan: Plan) -> torch.Tensor:
        ids = plan.ids[plan.send_token]  # [rows, K]
        mine = (ids // self.local == plan.send_rank[:, None]) & plan.keep[plan.send_token]
        w = torch.where(mine, plan.weights[plan.send_token], torch.zeros((), dtype=plan.weights.dtype))
        local = torch.where(mine, ids % self.local, -1).to(w.dtype)
        return torch.cat([w, local], 1)

    @staticmethod
    def _maybe_wait(pending: Pending, async_op: bool):
        return pending if async_op else pending.wait()

    # -- combine ------------------------------------------------------------------------------------------
    def combine(self, y: torch.Tensor, plan: Plan, async_op: bool = False) -> "torch.Tensor | Pending":
        """Expert outputs [sum(plan.recv_counts), H] (slot-major, as dispatched) -> [T,H] on the tokens'
        ranks: y[t] = sum_k weight[t,k] * expert_k output. ``async_op=True``: a :class:`Pending`."""
        T, H = plan.ids.shape[0], y.shape[1]
        if self.dedup:  # weight each pair on the expert side, one row per (token, rank) goes back
            r = plan.recv
            back = y.new_zeros((r["n_rows"], H)).index_add(0, r["row"], y * r["weight"][:, None].to(y.dtype))
        else:
            back = y[plan.by_slot.argsort()]  # slot-major -> source-major, as received
        with self.phase("combine"):
            t = _Transfer(plan.out_splits, plan.in_splits, self.group, self.combine_codec, self.combine_codec,
                          self.trace)
            token = _Start.apply(back, t)

        def unpermute(rows: torch.Tensor) -> torch.Tensor:
            if not self.dedup:
                rows = rows * plan.weights.reshape(-1)[plan.send_pair, None].to(rows.dtype)
            return rows.new_zeros((T, H)).index_add(0, plan.send_token, rows)
        return self._maybe_wait(Pending(token, t, unpermute), async_op)


def run_experts(experts, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Slot-major expert input [P,H] split by ``counts`` -> each local expert on its rows -> [P,H].

    Every expert runs, also on zero rows, so every rank builds the same graph. A slot without a module
    (``None``, a spare slot not filled) must receive no rows."""
    outs = []
    for slot, (expert, rows) in enumerate(zip(experts, x.split(counts))):
        if expert is None:
            if rows.shape[0]:
                raise ValueError(f"local slot {slot} has no expert but received {rows.shape[0]} rows")
            outs.append(rows)
        else:
            outs.append(expert(rows))
    return torch.cat(outs) if outs else x
