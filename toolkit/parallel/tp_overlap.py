"""Tensor-parallel communication hidden behind the GEMMs (flux, torch async-TP, TE userbuffers), on a ring.

With sequence parallelism (Korthikanti et al. 2022) every rank keeps only its 1/tp of the tokens between
the TP regions; a column-parallel layer all-gathers them first, a row-parallel one reduce-scatters its
partial sums back to the token shards. Done "bulk", the GEMM waits for the whole collective::

    bulk AG+GEMM   x_r [m,K] ─► all_gather ─► X [M,K] ─► X·W_rᵀ ─► Y [M,N/tp]     comm, then compute
    bulk GEMM+RS   H [M,K/tp] ─► H·W_rᵀ = P [M,N] ─► reduce_scatter ─► y_r [m,N]    compute, then comm

Decomposed into tp ring steps, each step's GEMM runs on the chunk a rank already holds while the next
chunk (or partial sum) travels to the neighbour with isend/irecv (``batch_isend_irecv``)::

    ring AG+GEMM, rank r, tp = 4 (chunk c = x of rank c; ──► = the chunk in flight during the GEMM)
      step 0   Y[r]   = X_r   W_rᵀ      X_r   ──► rank r+1,  X_r-1 ◄── rank r-1
      step 1   Y[r-1] = X_r-1 W_rᵀ      X_r-1 ──► rank r+1,  X_r-2 ◄── rank r-1
      step 2   Y[r-2] = X_r-2 W_rᵀ      X_r-2 ──► rank r+1,  X_r-3 ◄── rank r-1
      step 3   Y[r-3] = X_r-3 W_rᵀ      (every chunk has arrived; X is kept if asked: see below)

    ring GEMM+RS, rank r: step i computes the partial product of token block c = r-i-1, adds the running
    sum it received for c from rank r-1 and passes it on to rank r+1; at the last step c = r: it keeps it.
      step 0   S = H[r-1] W_rᵀ                        S ──► rank r+1
      step 1   S = H[r-2] W_rᵀ + (sum from r-1)       S ──► rank r+1
      ...
      step tp-1  y_r = H[r] W_rᵀ + (sum from r-1)     (the sum over all tp ranks' partials of block r)

Tiles (flux's granularity): at chunk granularity the last chunk's GEMM has nothing left to hide, so with
tp = 2 at most half the GEMM covers the one message. With ``tiles`` > 1 every chunk travels and is multiplied
in row tiles; a tile is passed on and multiplied as soon as it has arrived, so only the last tile's GEMM is
uncovered (a fraction 1/(tp·tiles) of the work), at the price of tiles× as many messages::

    tp = 2, tiles = 1   gemm X_r ‖ X_r-1 in flight  │ wait │ gemm X_r-1
    tp = 2, tiles = 4   gemm X_r tile by tile ‖ tiles of X_r-1 in flight │ gemm tile 0 ‖ tiles 1-3 still arriving │ ...

Whether that pays depends on what one message costs beside one tile's GEMM: a flag in device memory on a
GPU (flux), tens of microseconds of gloo threads and loopback TCP on a CPU.

Same bytes on the wire as the collectives ((tp-1)/tp of the gathered or reduced tensor per rank), in
(tp-1)·tiles messages. The ring sums in another order than ``reduce_scatter_tensor``, so its result is allclose,
not bitwise, to the bulk one; the all-gather ring moves bytes unchanged.

Backward (autograd functions below; dY = gradient of the output)::

    AG+GEMM layer  dX_r = reduce_scatter(dY · W_r)      (a GEMM+RS: ring; bulk: in flight behind the dW
                                                        GEMM, as Megatron does without flux)
                   dW_r = dYᵀ · X                       needs the gathered X: either kept from the
                                                        forward (``keep_gathered``: +(tp-1)/tp·M·K·b
                                                        bytes held) or all-gathered again here
                                                        (async, behind the dX GEMM, as Megatron does)
    GEMM+RS layer  dH   = all_gather(dy_r) · W_r        (an AG+GEMM: ring or bulk)
                   dW_r = all_gather(dy_r)ᵀ · H

Per transformer layer: qkv and fc1 are AG+GEMM, proj and fc2 GEMM+RS. Keeping both gathered inputs saves
the two re-gathers per layer (2·(tp-1)/tp·M·D·b bytes) for 2·(tp-1)/tp·M·D·b bytes of memory.

LayerNorms and the row-parallel biases see only a rank's tokens: their gradients are partial sums,
all-reduced over the tp group after the backward (``allreduce_sequence_parallel_grads``), as in Megatron.
On CUDA the same code overlaps through NCCL's own streams; torch's fused ops
(``torch.ops.symm_mem.fused_all_gather_matmul`` / ``fused_matmul_reduce_scatter``) are the production
version (``benchmarks/gpu/tp_overlap.py`` puts them side by side).
"""
from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from toolkit.runtime import compat

from .tensor import ColumnParallelLinear, RowParallelLinear, check_tp, qkv_rows

MODES = ("bulk", "ring")


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not allowed; allowed: {list(MODES)}")


class _Trace:
    """Optional spans on a ``toolkit.runtime.Timeline``: lane "compute" (gemm, wait = exposed comm) and
    lane "comm" (a message from post to the moment its wait returned: an upper bound of its flight)."""

    def __init__(self, timeline, op: str):
        self.timeline, self.op = timeline, op

    @contextlib.contextmanager
    def span(self, kind: str, **meta):
        if self.timeline is None:
            yield
            return
        with self.timeline.span(kind, lane="compute", op=self.op, **meta):
            yield

    def mark(self) -> tuple[float, float | None]:
        """The moment a message is posted, on the wall clock and (emulated cluster) the virtual one."""
        return (time.perf_counter(), self.timeline.vnow() if self.timeline is not None else None)

    def flight(self, posted: tuple[float, float | None], **meta) -> None:
        if self.timeline is not None:
            start, vstart = posted
            self.timeline.add("comm", start - self.timeline.origin, self.timeline.now(), vstart=vstart,
                              vend=self.timeline.vnow(), lane="comm", op=self.op, **meta)


def _peers(group) -> tuple[int, int, int, int]:
    """(tp, my index, global rank of the next ring member, global rank of the previous one)."""
    tp, r = dist.get_world_size(group), dist.get_rank(group)
    nxt = dist.get_global_rank(group, (r + 1) % tp) if group is not None else (r + 1) % tp
    prv = dist.get_global_rank(group, (r - 1) % tp) if group is not None else (r - 1) % tp
    return tp, r, nxt, prv


def _mm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor | None = None):
    if bias is None:
        return torch.mm(a, b, out=out) if out is not None else torch.mm(a, b)
    return torch.addmm(bias, a, b, out=out) if out is not None else torch.addmm(bias, a, b)


def all_gather_matmul(x: torch.Tensor, b: torch.Tensor, group=None, *, bias: torch.Tensor | None = None,
                      mode: str = "ring", keep_gathered: bool = False, tiles: int = 1, timeline=None
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``all_gather(x) @ b (+ bias)`` over ``group``, the all-gather hidden behind the GEMM in ``"ring"`` mode.

    Args:
        x: this rank's rows ``[m, K]`` (rank r holds rows ``r·m .. (r+1)·m`` of the gathered ``[tp·m, K]``).
        b: ``[K, N]`` (e.g. ``weight.t()``).
        mode: ``"bulk"`` (``all_gather_into_tensor``, then one GEMM) or ``"ring"`` (tp steps, p2p).
        keep_gathered: also return the gathered ``[tp·m, K]`` (for the backward), else None.
        tiles: ring only: each chunk travels and is multiplied in ``tiles`` row tiles of ``m / tiles`` rows; a
            tile is passed on and its GEMM starts as soon as it has arrived (flux's tile-level overlap), so only
            the last tile's GEMM has no message to hide.
        timeline: record per-tile spans (see ``_Trace``).
    Returns:
        (``[tp·m, N]`` in rank order, the gathered input or None).
    """
    _check_mode(mode)
    tp, r, nxt, prv = _peers(group)
    m, k = x.shape
    rows = tile_rows(m, tiles)
    trace = _Trace(timeline, "AG+GEMM")
    gathered = x.new_empty(tp, m, k)
    if mode == "bulk" or tp == 1:
        start = trace.mark()
        with trace.span("wait"):
            compat.all_gather_single(gathered.view(tp * m, k), x.contiguous(), group=group)
        trace.flight(start)
        with trace.span("gemm"):
            out = _mm(gathered.view(tp * m, k), b, bias)
        return out, gathered.view(tp * m, k) if keep_gathered else None
    out = x.new_empty(tp * m, b.shape[1])
    # chunk c's tile j: my own rows straight from x (no copy on the critical path), the others' where they arrive
    tile = lambda c, j: (x if c == r else gathered[c])[j * rows:(j + 1) * rows]  # [m/tiles, K] view
    sends, arriving = [], {}
    for i in range(tp):
        c = (r - i) % tp  # the chunk held at step i
        for j in range(tiles):
            if i > 0:  # tile j of chunk c was posted at step i-1
                recv, start = arriving.pop(j)
                with trace.span("wait", chunk=c, tile=j):
                    recv.wait()
                trace.flight(start, chunk=c, tile=j)
            if i < tp - 1:  # pass it on while computing on it; the same tile of the next chunk arrives meanwhile
                start = trace.mark()
                send, recv = dist.batch_isend_irecv([dist.P2POp(dist.isend, tile(c, j), nxt, group),
                                                     dist.P2POp(dist.irecv, tile((c - 1) % tp, j), prv, group)])
                sends.append(send)
                arriving[j] = recv, start
            with trace.span("gemm", chunk=c, tile=j):
                _mm(tile(c, j), b, bias, out=out[c * m + j * rows:c * m + (j + 1) * rows])
    if keep_gathered:  # the backward's copy of the whole input, mine included
        gathered[r].copy_(x)
    for send in sends:
        send.wait()
    return out, gathered.view(tp * m, k) if keep_gathered else None


def overlap_fraction(t_comm: float, t_gemm: float, t_fused: float) -> float:
    """(T_comm + T_gemm − T_fused) / T_comm: 1 = the communication is fully hidden, 0 = not at all."""
    return (t_comm + t_gemm - t_fused) / t_comm if t_comm > 0 else float("nan")


def tile_rows(m: int, tiles: int) -> int:
    """Rows per tile when a chunk of ``m`` rows is cut into ``tiles`` (ValueError unless ``tiles`` divides it)."""
    if not isinstance(tiles, int) or isinstance(tiles, bool) or tiles < 1 or m % tiles:
        raise ValueError(f"tiles={tiles!r} must be a positive int dividing the {m} rows of a rank's chunk")
    return m // tiles


def matmul_reduce_scatter(a: torch.Tensor, b: torch.Tensor, group=None, *, mode: str = "ring", tiles: int = 1,
                          timeline=None) -> torch.Tensor:
    """``reduce_scatter(a @ b)`` over ``group`` (sum; rank r keeps rows ``r·m .. (r+1)·m``).

    Args:
        a: ``[tp·m, K]`` (all tokens, this rank's slice of the features).
        b: ``[K, N]``.
        mode: ``"bulk"`` (one GEMM, then ``reduce_scatter_tensor``) or ``"ring"`` (tp steps passing running sums).
        tiles: ring only: each block's running sum is computed and passed on in ``tiles`` row tiles, so a tile
            travels while the next one is computed.
    Returns:
        ``[m, N]``: the sum over the group of every rank's ``a @ b``, rows of this rank's block.
    """
    _check_mode(mode)
    tp, r, nxt, prv = _peers(group)
    if a.shape[0] % tp:
        raise ValueError(f"a has {a.shape[0]} rows, not divisible by the group size {tp}")
    m = a.shape[0] // tp
    rows = tile_rows(m, tiles)
    trace = _Trace(timeline, "GEMM+RS")
    if mode == "bulk" or tp == 1:
        with trace.span("gemm"):
            partial = torch.mm(a, b)
        out = partial.new_empty(m, b.shape[1])
        start = trace.mark()
        with trace.span("wait"):
            compat.reduce_scatter_single(out, partial, group=group)
        trace.flight(start)
        return out
    out = a.new_empty(m, b.shape[1])
    sends, arriving = [], {}
    for i in range(tp):
        c = (r - i - 1) % tp  # the token block whose running sum passes through this rank at step i
        for j in range(tiles):
            lo = c * m + j * rows
            last = i == tp - 1  # my own block: its sum is written straight into the output
            with trace.span("gemm", chunk=c, tile=j):
                acc = torch.mm(a[lo:lo + rows], b, out=out[j * rows:(j + 1) * rows] if last else None)  # [m/tiles, N]
            if i > 0:  # the running sum of this tile, posted at step i-1
                recv, incoming, start = arriving.pop(j)
                with trace.span("wait", chunk=c, tile=j):
                    recv.wait()
                trace.flight(start, chunk=c, tile=j)
                acc += incoming
            if not last:  # send this sum on; receive the same tile of the next block's sum meanwhile
                incoming = torch.empty_like(acc)
                start = trace.mark()
                send, recv = dist.batch_isend_irecv([dist.P2POp(dist.isend, acc, nxt, group),
                                                     dist.P2POp(dist.irecv, incoming, prv, group)])
                sends.append((send, acc))
                arriving[j] = recv, incoming, start
    for send, _ in sends:
        send.wait()
    return out


# ------------------------------------------------------------------------------------------------
# Autograd: the two layer kinds of a sequence-parallel TP block
# ------------------------------------------------------------------------------------------------
class _AllGatherLinear(torch.autograd.Function):
    """Y = all_gather(x) · Wᵀ + b (column-parallel after a sequence-parallel region)."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, mode, keep_gathered, tiles, timeline):
        out, gathered = all_gather_matmul(x, weight.t(), group, bias=bias, mode=mode, keep_gathered=keep_gathered,
                                          tiles=tiles, timeline=timeline)
        ctx.save_for_backward(gathered if keep_gathered else x, weight)
        ctx.group, ctx.mode, ctx.keep, ctx.tiles, ctx.has_bias = group, mode, keep_gathered, tiles, bias is not None
        return out

    @staticmethod
    def backward(ctx, grad):  # grad [M, N/tp]
        saved, weight = ctx.saved_tensors
        grad = grad.contiguous()
        tp = dist.get_world_size(ctx.group)
        gather = None
        if ctx.keep:
            gathered = saved
        else:  # gather the input again, behind the dX GEMM
            gathered = saved.new_empty(tp * saved.shape[0], saved.shape[1])
            gather = compat.all_gather_single(gathered, saved, group=ctx.group, async_op=True)
        scatter = None
        if ctx.mode == "ring" and tp > 1:
            dx = matmul_reduce_scatter(grad, weight, ctx.group, mode="ring", tiles=ctx.tiles)  # [m, K]
        else:  # Megatron without flux: the dX GEMM, then its reduce-scatter in flight behind the dW GEMM
            partial = grad.mm(weight)  # [M, K]
            dx = partial.new_empty(partial.shape[0] // tp, partial.shape[1])
            scatter = compat.reduce_scatter_single(dx, partial, group=ctx.group, async_op=True)
        if gather is not None:
            gather.wait()
        dw = grad.t().mm(gathered)
        db = grad.sum(0) if ctx.has_bias else None
        if scatter is not None:
            scatter.wait()
        return dx, dw, db, None, None, None, None, None


class _LinearReduceScatter(torch.autograd.Function):
    """y = reduce_scatter(h · Wᵀ) (row-parallel into a sequence-parallel region; bias added by the caller)."""

    @staticmethod
    def forward(ctx, h, weight, group, mode, tiles, timeline):
        ctx.save_for_backward(h, weight)
        ctx.group, ctx.mode, ctx.tiles = group, mode, tiles
        return matmul_reduce_scatter(h, weight.t(), group, mode=mode, tiles=tiles, timeline=timeline)

    @staticmethod
    def backward(ctx, grad):  # grad [m, N]
        h, weight = ctx.saved_tensors
        dh, gathered = all_gather_matmul(grad.contiguous(), weight, ctx.group, mode=ctx.mode, keep_gathered=True,
                                         tiles=ctx.tiles)
        return dh, gathered.t().mm(h), None, None, None, None


class AllGatherColumnLinear(ColumnParallelLinear):
    """Column-parallel linear whose input is this rank's tokens ``[m, in]``: all-gather (bulk or ring) + GEMM.

    Built like its parent (``AllGatherColumnLinear.from_linear(linear, group, rows=...)``); ``mode``,
    ``keep_gathered``, ``tiles`` and ``timeline`` may be changed at any time.
    """

    mode: str = "ring"
    keep_gathered: bool = False
    tiles: int = 1
    timeline = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [m, in] -> [tp·m, out/tp]
        return _AllGatherLinear.apply(x, self.weight, self.bias, self.group, self.mode, self.keep_gathered,
                                      self.tiles, self.timeline)


class RowReduceScatterLinear(RowParallelLinear):
    """Row-parallel linear whose output is reduce-scattered to the token shards: GEMM + reduce-scatter."""

    mode: str = "ring"
    tiles: int = 1
    timeline = None

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # [tp·m, in/tp] -> [m, out]
        y = _LinearReduceScatter.apply(h, self.weight, self.group, self.mode, self.tiles, self.timeline)
        return y + self.bias if self.bias is not None else y


class SequenceParallelBlock(nn.Module):
    """A GPT ``Block`` split by tensor parallelism with sequence-parallel activations between the TP regions.

    Input and output are this rank's tokens ``[m, D]`` (rank r: rows ``r·m .. (r+1)·m`` of the flattened
    ``[B·T, D]``); inside attention and the MLP the tokens are whole and the heads / features split::

        x_r ─► ln1 ─► AG+qkv ─► core (my heads, [B,T,·]) ─► proj+RS ─► + x_r ─► ln2 ─► AG+fc1 ─► gelu ─► fc2+RS ─► +
    """

    def __init__(self, block: nn.Module, group, seq_len: int, mode: str = "ring", keep_gathered: bool = False):
        super().__init__()
        tp, r = dist.get_world_size(group), dist.get_rank(group)
        d_model, n_head = block.attn.proj.in_features, block.attn.core.n_head
        check_tp(tp, n_head=n_head, d_model=d_model, d_ff=block.mlp.fc1.out_features)
        self.seq_len = seq_len
        self.ln1, self.ln2, self.core, self.act = block.ln1, block.ln2, block.attn.core, block.mlp.act
        self.core.n_head = n_head // tp
        self.qkv = AllGatherColumnLinear.from_linear(block.attn.qkv, group, rows=qkv_rows(d_model, n_head, tp, r))
        self.proj = RowReduceScatterLinear.from_linear(block.attn.proj, group)
        self.fc1 = AllGatherColumnLinear.from_linear(block.mlp.fc1, group)
        self.fc2 = RowReduceScatterLinear.from_linear(block.mlp.fc2, group)
        for p in (*self.ln1.parameters(), *self.ln2.parameters(), self.proj.bias, self.fc2.bias):
            p.sequence_parallel = True  # sees only this rank's tokens: gradient all-reduced over tp
        self.configure(mode=mode, keep_gathered=keep_gathered)

    def configure(self, mode: str | None = None, keep_gathered: bool | None = None, tiles: int | None = None,
                  timeline=...) -> None:
        """Switch the overlap mode, keeping the gathered inputs, the ring's tiles or the timeline of all four
        linears."""
        if mode is not None:
            _check_mode(mode)
        for lin in (self.qkv, self.proj, self.fc1, self.fc2):
            if mode is not None:
                lin.mode = mode
            if tiles is not None:
                lin.tiles = tiles
            if keep_gathered is not None and isinstance(lin, AllGatherColumnLinear):
                lin.keep_gathered = keep_gathered
            if timeline is not ...:
                lin.timeline = timeline

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [m, D] -> [m, D]
        qkv = self.qkv(self.ln1(x))  # [B·T, 3D/tp]
        attn = self.core(qkv.view(-1, self.seq_len, qkv.shape[-1]))  # [B, T, D/tp]
        x = x + self.proj(attn.reshape(-1, attn.shape[-1]))
        return x + self.fc2(self.act(self.fc1(self.ln2(x))))


def sequence_parallel_blocks(blocks, group, seq_len: int, mode: str = "ring",
                             keep_gathered: bool = False) -> nn.ModuleList:
    """``SequenceParallelBlock`` of every block (the blocks' LayerNorms are shared, their linears sliced)."""
    return nn.ModuleList(SequenceParallelBlock(b, group, seq_len, mode, keep_gathered) for b in blocks)


class SequenceParallelStack(nn.Module):
    """Sequence-parallel blocks, then the (replicated) head on this rank's tokens; returns this rank's share
    of the mean next-token loss (sum over its tokens / all tokens): summed over the ranks it is the loss.

    ``SequenceParallelStack.from_model(gpt, group, mode, keep_gathered)`` copies nothing: it slices
    ``gpt.blocks`` (in place, see ``SequenceParallelBlock``) and shares ``gpt.head``.
    """

    def __init__(self, blocks: nn.ModuleList, head: nn.Module):
        super().__init__()
        self.blocks, self.head = blocks, head
        for p in head.parameters():
            p.sequence_parallel = True  # sees this rank's tokens only

    @classmethod
    def from_model(cls, model: nn.Module, group, mode: str = "ring", keep_gathered: bool = False
                   ) -> "SequenceParallelStack":
        return cls(sequence_parallel_blocks(model.blocks, group, model.cfg.seq_len, mode, keep_gathered),
                   model.head)

    def configure(self, **options) -> None:
        """``SequenceParallelBlock.configure`` on every block (mode, keep_gathered, tiles, timeline)."""
        for block in self.blocks:
            block.configure(**options)

    def forward(self, x: torch.Tensor, targets: torch.Tensor, n_tokens: int) -> torch.Tensor:
        """x [m, D] and targets [m] of this rank's tokens -> sum of their losses / ``n_tokens``."""
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x).float(), targets, reduction="sum") / n_tokens


def allreduce_sequence_parallel_grads(module: nn.Module, group) -> None:
    """Sum over ``group`` the gradients of parameters marked ``sequence_parallel`` (LayerNorms, row biases)."""
    grads = [p.grad for p in module.parameters() if getattr(p, "sequence_parallel", False) and p.grad is not None]
    if grads:
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def shard_tokens(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's contiguous 1/tp of the tokens of ``x [B, T, D]`` as ``[B·T/tp, D]`` (a copy)."""
    tp, r = dist.get_world_size(group), dist.get_rank(group)
    flat = x.reshape(-1, x.shape[-1])
    if flat.shape[0] % tp:
        raise ValueError(f"B·T = {flat.shape[0]} tokens are not divisible by tp={tp}")
    m = flat.shape[0] // tp
    return flat[r * m:(r + 1) * m].clone()


def bytes_per_layer(tokens: int, d_model: int, tp: int, keep_gathered: bool, elem: int = 4) -> dict[str, int]:
    """Bytes one rank sends per transformer layer (the ledger's convention: (tp-1)/tp of each gathered or
    reduced ``[tokens, d_model]`` tensor), forward and backward, bulk and ring alike::

        forward   AG(qkv in) RS(proj out) AG(fc1 in) RS(fc2 out)                     4 × (tp-1)/tp·M·D·b
        backward  RS(dX qkv) AG(d proj out) RS(dX fc1) AG(d fc2 out) [+ AG, AG again]   4 (or 6) × ...
    """
    one = (tp - 1) * tokens * d_model * elem // tp
    return {"forward": 4 * one, "backward": (4 if keep_gathered else 6) * one}


def kept_bytes_per_layer(tokens: int, d_model: int, tp: int, elem: int = 4) -> int:
    """Extra activation bytes held per layer by keeping the gathered inputs of qkv and fc1 (instead of
    each rank's own tokens): 2 × (tp-1)/tp·M·D·b."""
    return 2 * (tokens - tokens // tp) * d_model * elem


def overlap_ceiling(tp: int, t_gemm: float, t_comm: float, tiles: int = 1) -> float:
    """The most of the communication a ring can hide behind its GEMMs, as a fraction of ``t_comm``::

        min(1, (1 - 1/(tp·tiles)) · T_gemm / T_comm)

    The ring passes each of the tp chunks on while it multiplies the one it holds, so every GEMM but the last
    chunk's covers a transfer; the tiled ring (``tiles`` row tiles per chunk) leaves only the last tile's GEMM
    uncovered. The bound of the overlap fraction (T_comm + T_gemm - T_fused) / T_comm at these times (formula;
    the per-message costs that tiles multiply are not counted).
    """
    check_tp(tp)
    if not isinstance(tiles, int) or isinstance(tiles, bool) or tiles < 1:
        raise ValueError(f"tiles must be an int >= 1, got {tiles!r}")
    return min(1.0, (1 - 1 / (tp * tiles)) * t_gemm / t_comm) if t_comm > 0 else float("nan")
