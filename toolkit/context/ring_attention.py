"""Ring attention: causal attention over sequences sharded across a context-parallel (CP) group of ``cp`` ranks.

**Layout (causal load balancing).** Each sequence of length L is cut into 2·cp chunks; rank j of the group holds
chunk j and chunk 2cp-1-j, so every rank has one early and one late chunk and the same causal work::

    L = 16, cp = 2:   [ c0 | c1 | c2 | c3 ]      rank 0 holds c0 + c3,  rank 1 holds c1 + c2

Packed sequences (THD: several documents in one micro-batch) are sharded document by document; a rank keeps its
first chunks of every sequence, then its second chunks: ``local = [c_j(s0) c_j(s1) ... | c_2cp-1-j(s0) ...]``.

**The ring.** Q stays; K and V travel. At step s rank j meets the K/V block that started on rank j-s, while the
next block is already in flight (isend/irecv posted before the block's compute, waited after it)::

    cp = 4, rank 2:   step 0            step 1            step 2            step 3
                      Q2·KV2 (causal)   Q2·KV1            Q2·KV0            Q2·KV3
                      send KV2 -> 3     send KV1 -> 3     send KV0 -> 3     (nothing left to send)
                      recv KV1 <- 1     recv KV0 <- 1     recv KV3 <- 1

    a block from an earlier rank (src < j): all of Q against the *first* halves of K/V only (no mask inside a
    sequence); from a later rank (src > j): only the *second* half of Q against all of K/V. Every off-diagonal
    step is half a block of work on every rank -- that is the load balance.

**Blockwise softmax** (flash attention's running max m and sum l). For each new block of scores S::

    m' = max(m, rowmax S);   l' = l·e^(m-m') + rowsum e^(S-m');   acc' = acc·e^(m-m') + e^(S-m')·V
    out = acc / l,  lse = m + log l          (the same numbers as one softmax over the whole row)

**Backward** (a custom ``autograd.Function``; the ring runs again). With D = rowsum(dO∘O) and P = e^(S-lse)::

    dV += Pᵀ·dO;   dS = P∘(dO·Vᵀ - D);   dQ += dS·K/√d;   dK += dSᵀ·Q/√d

dQ stays on its rank. dK/dV of a block travel *with* the block: each rank adds its part and passes the sum on;
after cp hops it is home.

**Bytes each rank sends per layer** (T local tokens, d_kv = heads·head_dim, b bytes per element)::

    forward    (cp-1) · 2·T·d_kv·b                                K and V, cp-1 hops
    backward   (cp-1) · 2·T·d_kv·b  +  cp · 2·T·d_kv·b            K/V again, dK/dV back home

**On the emulated cluster** each ring step's block is timed as the one fused kernel a GPU runs for it (flash
attention on packed sequences, THD; ``toolkit.runtime.portable.fused_kernel``): the FLOPs of the (query, key)
pairs the mask lets through -- forward 2 matmuls, backward 5 (the scores recomputed), 2·head_dim FLOPs per pair
and head each -- and its inputs and outputs once through HBM. The ops here compute the block dense and unfused: scores
between different documents (masked), the score matrix written out between ops. Timed as they are, a rank's
attention would cost (tokens it holds)² however short its documents -- not the Σ L² that dynamic CP balances.
The ring's sends and receives are timed as themselves, on the link.
"""
from __future__ import annotations

import math
from functools import lru_cache

import torch
import torch.distributed as dist
import torch.nn.functional as F

from toolkit.runtime.portable import fused_kernel

IGNORE = -100
"""Target of a padding token (ignored by the loss)."""


def is_power_of_two(n: int) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 1 and not n & (n - 1)


def sample_parts(length: int, cp: int, j: int) -> tuple[range, range]:
    """Positions of one sequence held by rank ``j`` of a CP group of ``cp``: chunk j and chunk 2cp-1-j
    (for cp = 1, the whole sequence and nothing)."""
    if cp == 1:
        return range(length), range(0)
    c = length // (2 * cp)
    return range(j * c, (j + 1) * c), range((2 * cp - 1 - j) * c, (2 * cp - j) * c)


class CPLayout:
    """Where the tokens of packed sequences live in a CP group (see the module docstring).

    ``lengths``: the (padded) sequence lengths packed in this micro-batch; with ``cp > 1`` each must be a
    multiple of 2·cp. ``coords(j)`` gives rank j's local tokens as (sequence id, position in its sequence,
    index into the packed concatenation), in local order.
    """

    def __init__(self, lengths, cp: int):
        if not is_power_of_two(cp):
            raise ValueError(f"cp={cp!r} must be a power of two (1, 2, 4, ...)")
        self.lengths, self.cp = tuple(int(x) for x in lengths), cp
        if not self.lengths:
            raise ValueError("lengths must not be empty")
        for length in self.lengths:
            if length < 1 or (cp > 1 and length % (2 * cp)):
                raise ValueError(f"sequence length {length} must be >= 1 and, with cp={cp}, a multiple of "
                                 f"2*cp = {2 * cp} (pad it)")

    @property
    def tokens_per_rank(self) -> int:
        return sum(self.lengths) // self.cp

    def coords(self, j: int, device=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(sequence id, position, packed index) of rank j's local tokens, on ``device`` (cached; made afresh
        under fake tensors, ``toolkit.runtime.shapes``, whose tensors must not outlive their trace)."""
        if torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None:
            return _coords.__wrapped__(self.lengths, self.cp, j, "cpu")
        return _coords(self.lengths, self.cp, j, str(torch.device(device or "cpu")))

    def pairs(self, j: int, src: int, second_q_half: bool, first_k_half: bool) -> int:
        """Unmasked (query, key) pairs of rank j's rows against rank src's K/V block (the mask's count, from the
        layout alone): per sequence, chunk a of queries against chunk b of keys (c tokens each) is c² pairs
        when a > b, c(c+1)/2 when a = b, none when a < b; ``second_q_half`` / ``first_k_half``: only rank j's
        second chunks / only src's first chunks (``_block``)."""
        if self.cp == 1:
            return sum(n * (n + 1) // 2 for n in self.lengths)
        last = 2 * self.cp - 1
        qs = [last - j] if second_q_half else [j, last - j]
        ks = [src] if first_k_half else [src, last - src]
        out = 0
        for n in self.lengths:
            c = n // (2 * self.cp)
            out += sum(c * c if a > b else c * (c + 1) // 2 if a == b else 0 for a in qs for b in ks)
        return out

    def __repr__(self) -> str:
        return f"CPLayout(lengths={list(self.lengths)}, cp={self.cp})"


@lru_cache(maxsize=512)
def _coords(lengths: tuple[int, ...], cp: int, j: int, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if device != "cpu":
        return tuple(t.to(device) for t in _coords(lengths, cp, j, "cpu"))
    offsets = [0]
    for length in lengths:
        offsets.append(offsets[-1] + length)
    pieces = [[], []]
    for s, length in enumerate(lengths):
        for half, part in enumerate(sample_parts(length, cp, j)):
            if len(part):
                pieces[half].append((s, part.start, part.stop, offsets[s]))
    seq, pos, idx = [], [], []
    for s, a, b, off in pieces[0] + pieces[1]:
        seq.append(torch.full((b - a,), s, dtype=torch.long))
        pos.append(torch.arange(a, b))
        idx.append(torch.arange(off + a, off + b))
    return torch.cat(seq), torch.cat(pos), torch.cat(idx)


def _block(j: int, src: int, t: int) -> tuple[slice, slice]:
    """(Q rows, K columns) of rank j's scores against the K/V block of rank src that can be unmasked."""
    if src == j:
        return slice(None), slice(None)
    if src < j:
        return slice(None), slice(0, t // 2)
    return slice(t // 2, None), slice(None)


def _mask(mine, theirs, rows: slice, cols: slice) -> torch.Tensor:
    """True where query (row) may attend to key (column): same sequence, key not after the query."""
    seq_q, pos_q, _ = mine
    seq_k, pos_k, _ = theirs
    return (seq_q[rows, None] == seq_k[None, cols]) & (pos_k[None, cols] <= pos_q[rows, None])


def _exchange(send: torch.Tensor, group, to: int, frm: int):
    """Post send(to) and recv(frm) of a tensor shaped like ``send``; returns (recv buffer, works)."""
    recv = torch.empty_like(send)
    ops = [dist.P2POp(dist.isend, send, to, group), dist.P2POp(dist.irecv, recv, frm, group)]
    return recv, dist.batch_isend_irecv(ops)


def _block_cost(matmuls: int, heads: int, head_dim: int, layout: CPLayout, j: int, src: int, rows: slice,
                cols: slice, shape: tuple[int, int], tensors: list[torch.Tensor]):
    """The cost of one ring step's block as the one fused attention kernel a GPU runs (module docstring):
    ``matmuls`` x 2·head_dim FLOPs per (query, key) pair and head that the mask lets through
    (``CPLayout.pairs``), ``tensors`` once through HBM, one flash-attention kernel over the ``shape`` =
    (query rows, key columns) block (causal where masked). A ``fused_kernel``'s ``cost``: counted only where
    the block is timed."""
    def cost():
        pairs = layout.pairs(j, src, rows.start is not None, cols.stop is not None)
        return (2.0 * matmuls * head_dim * heads * pairs, tensors,
                (heads, shape[0], head_dim, pairs < shape[0] * shape[1], matmuls > 2))
    return cost


def _wait(works) -> None:
    for w in works:
        w.wait()


def _ring(group, cp: int) -> tuple[int, list[int]]:
    if cp == 1:
        return 0, [dist.get_rank() if dist.is_initialized() else 0]
    return dist.get_rank(group), dist.get_process_group_ranks(group)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, layout: CPLayout, group):
        cp = layout.cp
        j, ring = _ring(group, cp)
        nxt, prv = ring[(j + 1) % cp], ring[(j - 1) % cp]
        h, t, hd = q.shape
        scale = 1.0 / math.sqrt(hd)
        mine = layout.coords(j, q.device)
        m = q.new_full((h, t), -math.inf)
        l = q.new_zeros((h, t))
        acc = torch.zeros_like(q)
        kv = torch.stack([k, v])
        for step in range(cp):
            if step < cp - 1:
                incoming, works = _exchange(kv, group, nxt, prv)  # the next block travels while we compute
            src = (j - step) % cp
            rows, cols = _block(j, src, t)
            # read: Q rows and the K/V block; read and written: the running output
            with fused_kernel("ring attention block (fused), forward", "attention") as kernel:
                s = (q[:, rows] @ kv[0][:, cols].transpose(-1, -2)) * scale
                mask = _mask(mine, layout.coords(src, q.device), rows, cols)
                kernel.cost = _block_cost(2, h, hd, layout, j, src, rows, cols, mask.shape,
                                          [q[:, rows], kv[:, :, cols], acc[:, rows], acc[:, rows]])
                s = s.masked_fill(~mask, -math.inf)
                mv, lv, av = m[:, rows], l[:, rows], acc[:, rows]  # views: updated in place
                m_new = torch.maximum(mv, s.amax(-1))
                m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)  # rows with nothing yet
                alpha = torch.exp(mv - m_safe)
                p = torch.exp(s - m_safe[..., None])
                lv.mul_(alpha).add_(p.sum(-1))
                av.mul_(alpha[..., None]).add_(p @ kv[1][:, cols])
                mv.copy_(m_new)
            if step < cp - 1:
                _wait(works)
                kv = incoming
        out = acc / l[..., None]
        ctx.save_for_backward(q, k, v, out, m + l.log())
        ctx.layout, ctx.group = layout, group
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        layout, group = ctx.layout, ctx.group
        cp = layout.cp
        j, ring = _ring(group, cp)
        nxt, prv = ring[(j + 1) % cp], ring[(j - 1) % cp]
        h, t, hd = q.shape
        scale = 1.0 / math.sqrt(hd)
        mine = layout.coords(j, q.device)
        dout = dout.contiguous()
        d = (dout * out).sum(-1)
        dq = torch.zeros_like(q)
        kv = torch.stack([k, v])
        dkv = torch.zeros_like(kv)  # dK/dV of the block we hold (arrives from the previous rank after step 0)
        pending = None
        for step in range(cp):
            if step < cp - 1:
                incoming, works = _exchange(kv, group, nxt, prv)
            src = (j - step) % cp
            rows, cols = _block(j, src, t)
            kb, vb, qr, dor = kv[0][:, cols], kv[1][:, cols], q[:, rows], dout[:, rows]
            # read: Q, dO rows and the K/V block; read and written: dQ rows; written: the block's dK/dV part
            with fused_kernel("ring attention block (fused), backward", "attention") as kernel:
                s = (qr @ kb.transpose(-1, -2)) * scale
                mask = _mask(mine, layout.coords(src, q.device), rows, cols)
                kernel.cost = _block_cost(5, h, hd, layout, j, src, rows, cols, mask.shape,
                                          [qr, dor, kv[:, :, cols], dq[:, rows], dq[:, rows], kv[:, :, cols]])
                s = s.masked_fill(~mask, -math.inf)
                p = torch.exp(s - lse[:, rows, None])
                ds = p * (dor @ vb.transpose(-1, -2) - d[:, rows, None])
                dq[:, rows] += (ds @ kb) * scale
                dk, dv = (ds.transpose(-1, -2) @ qr) * scale, p.transpose(-1, -2) @ dor
            if pending is not None:  # the block's dK/dV so far, passed on by the previous rank
                _wait(pending[1])
                dkv = pending[0]
            dkv[0][:, cols] += dk
            dkv[1][:, cols] += dv
            if cp > 1:
                pending = _exchange(dkv, group, nxt, prv)  # pass the sum on; receive the next block's
            if step < cp - 1:
                _wait(works)
                kv = incoming
        if pending is not None:
            _wait(pending[1])
            dkv = pending[0]  # our own block's dK/dV, back from its trip round the ring
        return dq, dkv[0], dkv[1], None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: CPLayout,
                   group=None) -> torch.Tensor:
    """Causal attention of this rank's shard ``q, k, v`` (each ``[heads, T_local, head_dim]``, tokens in
    ``layout``'s local order) against the whole of every sequence, K/V passed round ``group``.

    ``group``: the process group of the CP ranks (its size must be ``layout.cp``; None when cp = 1). Every rank
    of the group calls this with the same ``layout``. Differentiable (the backward runs the ring again).
    """
    if q.shape != k.shape or q.shape != v.shape or q.dim() != 3:
        raise ValueError(f"q, k, v must have one shape [heads, T, head_dim]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[1] != layout.tokens_per_rank:
        raise ValueError(f"q has {q.shape[1]} tokens but the layout gives this rank {layout.tokens_per_rank}")
    if layout.cp > 1:
        if group is None or dist.get_world_size(group) != layout.cp:
            raise ValueError(f"layout.cp={layout.cp} needs a process group of {layout.cp} ranks")
    return _RingAttention.apply(q, k, v, layout, group)


def packed_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths) -> torch.Tensor:
    """The reference: causal attention inside each sequence of a packed ``[heads, N, head_dim]`` batch, one
    process, one softmax per row (``scaled_dot_product_attention`` with a block-diagonal causal mask)."""
    seq = torch.cat([torch.full((n,), s, device=q.device) for s, n in enumerate(lengths)])
    pos = torch.cat([torch.arange(n, device=q.device) for n in lengths])
    mask = (seq[:, None] == seq[None, :]) & (pos[None, :] <= pos[:, None])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def ring_bytes(tokens_per_rank: int, d_kv: int, cp: int, elem_bytes: int) -> dict[str, int]:
    """Bytes one rank sends per layer (closed form of the module docstring): ``forward``, ``backward``."""
    block = 2 * tokens_per_rank * d_kv * elem_bytes
    if cp == 1:
        return {"forward": 0, "backward": 0}
    return {"forward": (cp - 1) * block, "backward": (cp - 1) * block + cp * block}


def gpt_shard_loss(model, tokens: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor,
                   layout: CPLayout, group=None) -> torch.Tensor:
    """Summed next-token cross-entropy of a ``toolkit.models.GPT`` over one rank's CP shard of packed sequences.

    ``tokens``, ``targets``, ``positions`` (position in its sequence) are ``[T_local]`` in the layout's local
    order; targets equal to ``IGNORE`` (padding) do not count. Everything but attention is per token, so it runs
    on the shard as is; attention is ``ring_attention`` over ``group``. Summed over the ranks and divided by the
    number of real tokens, this is the per-token loss of the unpacked sequences.
    """
    x = model.embed.tok(tokens) + model.embed.pos(positions)  # [T, D]
    for block in model.blocks:
        x = shard_layer(block, x, layout, group)
    logits = model.head(x)
    return F.cross_entropy(logits.float(), targets, ignore_index=IGNORE, reduction="sum")


def shard_layer(block, x: torch.Tensor, layout: CPLayout, group=None) -> torch.Tensor:
    """One transformer block of a ``toolkit.models.GPT`` on one rank's CP shard ``x`` ``[T_local, D]``: every op
    but attention per token, attention ``ring_attention`` over ``group``."""
    n_head = block.attn.core.n_head
    t, dim = x.shape
    qkv = block.attn.qkv(block.ln1(x)).view(t, 3, n_head, dim // n_head).permute(1, 2, 0, 3)  # [3, H, T, hd]
    y = ring_attention(qkv[0], qkv[1], qkv[2], layout, group)
    x = x + block.attn.proj(y.transpose(0, 1).reshape(t, dim))
    return x + block.mlp(block.ln2(x))


def gpt_sequence_loss(model, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The unpacked reference: one sequence ``[L]`` through the model's own forward, summed cross-entropy."""
    logits = model(tokens[None])[0]
    return F.cross_entropy(logits.float(), targets, ignore_index=IGNORE, reduction="sum")


def causal_pairs(length: int, cp: int, balanced: bool = True) -> list[int]:
    """Unmasked (query, key) pairs each rank of a CP group computes for one causal sequence: with the balanced
    layout (chunks j and 2cp-1-j) they are equal; with contiguous chunks (rank j holds the j-th 1/cp) the last
    rank does 2cp-1 times the work of the first."""
    if balanced:
        rows = [list(sample_parts(length, cp, j)[0]) + list(sample_parts(length, cp, j)[1]) for j in range(cp)]
    else:
        size = length // cp
        rows = [list(range(j * size, (j + 1) * size)) for j in range(cp)]
    return [sum(p + 1 for p in r) for r in rows]
