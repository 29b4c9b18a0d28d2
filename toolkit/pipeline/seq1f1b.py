"""Seq1F1B: pipeline over sequence chunks instead of whole micro-batches (Sun et al., NAACL 2025).

Each micro-batch's sequence is cut into ``k`` chunks. A stage runs the forward of chunk j as soon as
chunk j arrives, keeping the keys and values of every earlier chunk in a per-layer cache, so the
pipeline fills and drains in chunk-sized steps: the bubble shrinks by k and a stage holds k times fewer
activations in flight.

Forward of chunk j (one layer, ``LayerKV.attend``; chunks 0..j-1 already in the cache)::

    qkv_j ──► q_j ───────────────────────────────────┐
          └─► k_j, v_j ──► cache.append(detached)     ▼
    K = [ k_0 .. k_{j-1} (cache, detached) | k_j ]   softmax(q_j K^T + bottom-right causal mask) V
    V = [ v_0 .. v_{j-1} (cache, detached) | v_j ]   query i of chunk j sits at position start_j + i and
                                                     sees keys 0..start_j + i (is_causal is top-left: wrong)

Backward, chunks in reverse order (B(j) before B(j-1)), moved by two tensor hooks::

    hook on K of chunk j:   dK[:start_j] ──► split by chunk, added to dk[0..j-1]   (the prefix's share)
    hook on k_j:            dk_j (own)  +  dk[j] (filed by chunks j+1..k-1)        (raises if one is missing)

So the backward of a chunk is plain autograd on its output, and a chunk's K/V gradient is complete exactly
when its own backward runs, which is why the schedule walks chunks in reverse. Positions are offset by
``start_j``; the cache lives per micro-batch, chunk j's entry is freed by B(j).

Partition (``partition``). ``equal_tokens`` cuts T into equal lengths, but chunk j attends over
start_j + l_j keys, so later chunks cost more and the pipeline stalls on them. ``equal_compute`` (the
paper's ``uniform_comp``) balances the cumulative FLOPs C(t) = a*t + b*t(t+1)/2, so earlier chunks are longer.

Schedule (``seq1f1b``, actions of ``toolkit.pipeline.schedule``): rank r runs min(p-r-2+k, m*k) warm-up
forwards in (micro-batch, chunk) order, then alternates one F with one B, the B walking each micro-batch's
chunks in reverse, then drains the remaining B. Bubble (p-1)(F+B)/k; rank r holds (p-r-1+k)/k
micro-batches of activations (rank 0: 1+(p-1)/k versus p for 1F1B). The pipeline executor runs it for real with the ``SequenceChunks`` hook.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from toolkit.models.gpt import Block, GPTConfig, Stage
from toolkit.pipeline.executor import ExecutorHook, key_of
from toolkit.pipeline.schedule import Action, Schedule, linear_layout

PARTITIONS = ("equal_tokens", "equal_compute")


# ---------------------------------------------------------------------------------------------
# Partitioning a sequence into chunks
# ---------------------------------------------------------------------------------------------
def flop_coefficients(cfg: GPTConfig) -> tuple[float, float]:
    """Forward FLOPs of the whole model as ``a * tokens + b * (query, key) pairs``.

    a: per token, every Linear (2 FLOPs per multiply-add): qkv 3D^2, proj D^2, MLP 2*D*D_ff per layer, plus the
    head D*V. b: per causal (query, key) pair, q.k and p.v cost 2D each per layer.
    """
    D, L = cfg.d_model, cfg.n_layer
    a = L * 2 * (4 * D * D + 2 * D * cfg.d_ff) + 2 * D * cfg.vocab_size
    b = L * 4 * D
    return float(a), float(b)


def chunk_flops(lengths: list[int], a: float, b: float) -> list[float]:
    """Forward FLOPs of each chunk: a*l + b*(causal pairs whose query is in the chunk)."""
    out, start = [], 0
    for l in lengths:
        end = start + l
        pairs = end * (end + 1) / 2 - start * (start + 1) / 2  # query t attends to t+1 keys
        out.append(a * l + b * pairs)
        start = end
    return out


def partition(seq_len: int, k: int, strategy: str = "equal_compute", a: float = 1.0, b: float = 0.0,
              multiple_of: int = 1) -> list[int]:
    """Chunk lengths (summing to ``seq_len``) for ``k`` chunks.

    ``equal_tokens``: as equal as integers allow. ``equal_compute``: chunks of (as nearly as whole
    multiples of ``multiple_of``, e.g. the TP size, allow) equal forward FLOPs, C(t) = a*t + b*t(t+1)/2 for
    the first t tokens; precisely, the partition whose most expensive chunk is cheapest. With real numbers
    the boundaries would solve C(t_j) = j/k * C(T); the paper solves that with sympy from the last chunk and
    rounds lengths down to the TP size.
    """
    if strategy not in PARTITIONS:
        raise ValueError(f"partition={strategy!r} is not known; allowed: {PARTITIONS}")
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"seq_chunks (k) must be an int >= 1, got {k!r}")
    if multiple_of < 1 or seq_len % multiple_of:
        raise ValueError(f"multiple_of={multiple_of} must be >= 1 and divide seq_len={seq_len}")
    units = seq_len // multiple_of
    if k > units:
        raise ValueError(f"seq_chunks={k} is more chunks than the {units} tokens (in units of {multiple_of}) of "
                         f"seq_len={seq_len}; need 1 <= seq_chunks <= {units}")
    if strategy == "equal_tokens" or b == 0.0:
        bounds = [round(j * units / k) for j in range(k + 1)]
    else:
        bounds = _min_max_bounds(units, k, lambda u: _prefix_flops(u * multiple_of, a, b),
                                 lambda c: _tokens_within(c, a, b) / multiple_of)
    return [(bounds[j + 1] - bounds[j]) * multiple_of for j in range(k)]


def _prefix_flops(t: int, a: float, b: float) -> float:
    """C(t) = a*t + b*t(t+1)/2: forward FLOPs of the first t tokens (token i attends to i+1 keys)."""
    return a * t + b * t * (t + 1) / 2


def _tokens_within(c: float, a: float, b: float) -> float:
    """The real t with C(t) = c (the positive root of the quadratic)."""
    qa, qb = b / 2, a + b / 2
    return (-qb + math.sqrt(qb * qb + 4 * qa * c)) / (2 * qa)


def _min_max_bounds(units: int, k: int, cum, root) -> list[int]:
    """Boundaries of k contiguous chunks of ``units`` that minimise the largest chunk's FLOPs.

    ``cum(u)``: FLOPs of the first u units; ``root(c)``: the real u with cum(u) = c. Binary search on the
    FLOP budget of a chunk; for a budget, each chunk greedily takes every unit that fits (closed form).
    """
    def pack(cap: float) -> list[int] | None:
        bounds = [0]
        while bounds[-1] < units and len(bounds) <= k:
            u = min(units, math.floor(root(cum(bounds[-1]) + cap) + 1e-9))
            while u > bounds[-1] and cum(u) - cum(bounds[-1]) > cap * (1 + 1e-12):
                u -= 1  # floating-point guard
            if u == bounds[-1]:
                return None  # one unit alone exceeds the budget
            bounds.append(u)
        return bounds if bounds[-1] == units else None

    lo, hi = cum(units) / k, cum(units)
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if pack(mid) else (mid, hi)
    bounds = pack(hi)
    while len(bounds) < k + 1:  # fewer chunks than asked: split the widest (its halves fit the budget too)
        j = max(range(len(bounds) - 1), key=lambda i: bounds[i + 1] - bounds[i])
        bounds.insert(j + 1, (bounds[j] + bounds[j + 1]) // 2)
    return bounds


# ---------------------------------------------------------------------------------------------
# The per-layer KV prefix cache and the chunked stage forward/backward
# ---------------------------------------------------------------------------------------------
@dataclass
class LayerKV:
    """One layer's keys/values of the chunks already run for one micro-batch, and the dK/dV that later
    chunks have sent back to earlier ones (hooks move them; see the module docstring)."""

    keys: list[torch.Tensor | None] = field(default_factory=list)  # detached [B,H,l_i,hd] per chunk
    values: list[torch.Tensor | None] = field(default_factory=list)
    dk: dict[int, torch.Tensor] = field(default_factory=dict)  # chunk -> dK summed over later chunks
    dv: dict[int, torch.Tensor] = field(default_factory=dict)
    sent: dict[int, int] = field(default_factory=dict)  # chunk -> how many later chunks have sent

    def attend(self, qkv: torch.Tensor, n_head: int) -> torch.Tensor:  # [B,l,3D] -> [B,l,D]
        B, l, three_d = qkv.shape
        q, k, v = qkv.view(B, l, 3, n_head, three_d // (3 * n_head)).permute(2, 0, 3, 1, 4)  # [B,H,l,hd]
        j = len(self.keys)
        if j:
            # The cached prefix is detached, so chunk j's backward stops at K instead of running into the
            # graphs of earlier chunks (their backward comes later); a hook on K takes the prefix's slice of
            # dK and files it for those chunks.
            K, V = torch.cat(self.keys + [k], dim=2), torch.cat(self.values + [v], dim=2)  # [B,H,start+l,hd]
            K.register_hook(lambda g: self._send_back(j, g, self.dk))
            V.register_hook(lambda g: self._send_back(j, g, self.dv))
            # bottom-right causal: query i (position start+i) sees keys 0..start+i; torch's
            # causal_lower_right(l, start+l) is the same mask, as a tensor subclass
            n = K.shape[2]
            mask = torch.ones(l, n, dtype=torch.bool, device=q.device).tril(diagonal=n - l)  # [l,start+l]
            y = F.scaled_dot_product_attention(q, K, V, attn_mask=mask)  # [B,H,l,hd]
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        # When chunk j's own dK/dV is computed, add what the later chunks sent (they ran their backward first).
        k.register_hook(lambda g: self._receive(j, g, self.dk))
        v.register_hook(lambda g: self._receive(j, g, self.dv))
        self.keys.append(k.detach())
        self.values.append(v.detach())
        return y.transpose(1, 2).reshape(B, l, three_d // 3)

    def _send_back(self, j: int, grad: torch.Tensor, acc: dict[int, torch.Tensor]) -> None:
        start = 0
        for i in range(j):
            n = self.keys[i].shape[2]
            part = grad[:, :, start:start + n]
            if i in acc:
                acc[i].add_(part)
            else:
                acc[i] = part.clone()
            start += n
        if acc is self.dk:
            for i in range(j):
                self.sent[i] = self.sent.get(i, 0) + 1

    def _receive(self, j: int, grad: torch.Tensor, acc: dict[int, torch.Tensor]) -> torch.Tensor:
        later = len(self.keys) - 1 - j
        if self.sent.get(j, 0) != later:
            raise RuntimeError(f"backward of chunk {j} ran before the backward of all {later} later chunks "
                               f"({self.sent.get(j, 0)} done): Seq1F1B needs B(j) after B(j+1)")
        return grad + acc.pop(j) if j in acc else grad

    def release(self, j: int) -> None:
        """After chunk j's backward nothing reads its cached K/V any more."""
        self.keys[j] = self.values[j] = None


def block_forward(block: Block, x: torch.Tensor, kv: LayerKV, n_head: int) -> torch.Tensor:  # [B,l,D]
    """The GPT block of ``toolkit.models.gpt`` with its core attention reading the KV prefix cache."""
    x = x + block.attn.proj(kv.attend(block.attn.qkv(block.ln1(x)), n_head))
    return x + block.mlp(block.ln2(x))


class ChunkedStage:
    """Runs one pipeline ``Stage`` on sequence chunks, with a KV cache per in-flight micro-batch.

    ``forward(mb, j, x, start)`` for j = 0, 1, ... in order. The backward is plain autograd on the output
    (the hooks move dK/dV between chunks), run for j in reverse, each followed by ``done(mb, j)``, which
    frees chunk j's cache and, after chunk 0, the micro-batch's.
    """

    def __init__(self, stage: Stage, n_head: int):
        self.stage, self.n_head = stage, n_head
        self.caches: dict[int, list[LayerKV]] = {}

    def forward(self, mb: int, j: int, x: torch.Tensor, start: int) -> torch.Tensor:
        if j == 0:
            self.caches[mb] = [LayerKV() for _ in self.stage.blocks]
        cache = self.caches.get(mb)
        if cache is None or (cache and len(cache[0].keys) != j):
            raise RuntimeError(f"chunk {j} of micro-batch {mb} arrived out of order; chunks run 0, 1, ... in order")
        if self.stage.embed is not None:
            x = self.stage.embed(x, pos_offset=start)  # positions continue where the previous chunk stopped
        for block, kv in zip(self.stage.blocks, cache):
            x = block_forward(block, x, kv, self.n_head)
        return self.stage.head(x) if self.stage.head is not None else x

    def done(self, mb: int, j: int) -> None:
        for kv in self.caches[mb]:
            kv.release(j)
        if j == 0:
            del self.caches[mb]

    def backward(self, mb: int, j: int, out: torch.Tensor, grad: torch.Tensor | None = None) -> None:
        """Backward of chunk j: ``out`` is its output (a scalar loss on the last stage, ``grad`` None)."""
        torch.autograd.backward(out, grad)
        self.done(mb, j)

    def held(self, mb: int, j: int) -> list[torch.Tensor]:
        """Tensors the cache keeps for chunk j: its K/V (for later chunks) and the dK/dV filed for it."""
        cache = self.caches.get(mb, [])
        return [t for kv in cache for t in (kv.keys[j] if j < len(kv.keys) else None,
                                             kv.values[j] if j < len(kv.values) else None,
                                             kv.dk.get(j), kv.dv.get(j)) if t is not None]


def chunk_bounds(lengths: list[int]) -> list[tuple[int, int]]:
    """[(start, end)] of each chunk."""
    out, start = [], 0
    for l in lengths:
        out.append((start, start + l))
        start += l
    return out


# ---------------------------------------------------------------------------------------------
# The schedule (actions of toolkit.pipeline.schedule) and its costs for the simulator
# ---------------------------------------------------------------------------------------------
def seq1f1b(p: int, m: int, k: int) -> Schedule:
    """Seq1F1B on p ranks, m micro-batches of k sequence chunks each.

    Forwards run in (micro-batch, chunk) order, backwards in (micro-batch, reversed chunk) order.
    Rank r warms up with min(p-r-2+k, m*k) forwards, then alternates F and B, then drains the B.
    With k = 1 this is exactly 1F1B.
    """
    for name, value, low in (("p", p, 1), ("m", m, p), ("k", k, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    ranks = []
    for r in range(p):
        fwd = [Action("F", r, mb, c) for mb in range(m) for c in range(k)]
        bwd = [Action("B", r, mb, c) for mb in range(m) for c in reversed(range(k))]
        warmup = min(p - r - 2 + k, m * k)
        acts = fwd[:warmup]
        for i in range(m * k - warmup):
            acts += [fwd[warmup + i], bwd[i]]
        ranks.append(acts + bwd[m * k - warmup:])
    return Schedule("seq1f1b" if k > 1 else "1f1b", ranks, linear_layout(p), m, k=k, meta={"k": k}).check()


class ChunkCosts:
    """Per-chunk durations for ``simulate``: chunk c's F and B scale with its FLOPs (``chunk_flops``).

    ``F``, ``B`` are the durations of a whole micro-batch on one stage; chunk c gets the share
    ``flops[c] / sum(flops)`` of them.
    """

    def __init__(self, F: float, B: float, flops: list[float], comm: float = 0.0):
        total = sum(flops)
        self.F = [F * f / total for f in flops]
        self.B = [B * f / total for f in flops]
        self.comm = comm

    def __call__(self, a: Action) -> float:
        return (self.F if a.op == "F" else self.B)[a.chunk]


def bubble_formula(p: int, m: int, k: int) -> float:
    """The paper's bubble ratio for equal chunks: (p-1) / (k*m + p - 1)."""
    return (p - 1) / (k * m + p - 1)


def peak_formula(p: int, r: int, k: int) -> float:
    """Micro-batches of activations rank r holds at its peak: (p - r - 1 + k) / k."""
    return (p - r - 1 + k) / k


# ---------------------------------------------------------------------------------------------
# Running a schedule for real: the pipeline executor's hook for sequence chunks
# ---------------------------------------------------------------------------------------------
class SequenceChunks(ExecutorHook):
    """The pipeline executor's hook for schedules over sequence chunks (``Schedule.k > 1``)::

        chunks = SequenceChunks(stage, lengths, n_head)
        PipelineExecutor(schedule, rank, {rank: stage}, None, (micro_batch, sum(lengths), d_model), hooks=[chunks])

    What changes: chunk c of a micro-batch is tokens [start_c, end_c) (its activation messages have that
    length); the stage runs through ``ChunkedStage`` (KV prefix cache, position offset); the last stage's loss
    of a chunk is its summed cross-entropy / (tokens per micro-batch * m), so the chunks add up to the mean
    loss (the executor's ``loss_fn`` is not used); after each backward the chunk's cache is freed. With the
    executor's ``meter`` on, the cached K/V and the dK/dV filed for a chunk count as that chunk's activations.
    ``peak_chunks`` counts the chunks whose activations were held at once.
    """

    def __init__(self, stage: Stage, lengths: list[int], n_head: int):
        self.chunked, self.bounds, self.seq_len = ChunkedStage(stage, n_head), chunk_bounds(lengths), sum(lengths)
        self.held_chunks = self.peak_chunks = 0

    def bind(self, executor) -> None:
        if len(self.bounds) != executor.schedule.k:
            raise ValueError(f"lengths has {len(self.bounds)} chunks, the schedule {executor.schedule.k}")
        super().bind(executor)

    def recv_shape(self, msg: Action, shape: tuple[int, ...]) -> tuple[int, ...]:
        s, e = self.bounds[msg.chunk]
        return (shape[0], e - s, shape[2])

    def stage_fn(self, a: Action, fn):
        ex, (s, e) = self.executor, self.bounds[a.chunk]
        scale = 1.0 / (ex.act_shape[0] * self.seq_len)  # the mean over the micro-batch's tokens

        def chunk_fn(x: torch.Tensor) -> torch.Tensor:
            y = self.chunked.forward(a.mb, a.chunk, x[:, s:e] if a.stage == 0 else x, s)
            if a.stage == ex.last:
                y = _chunk_loss(y, ex.targets[a.mb][:, s:e]) * scale / ex.schedule.m
            return y

        return chunk_fn

    @contextlib.contextmanager
    def forward_context(self, a: Action):
        yield
        if a.op == "F":  # the forward is done: its chunk's cache is held until its backward
            self.held_chunks += 1
            self.peak_chunks = max(self.peak_chunks, self.held_chunks)
            self.executor.hold(key_of(a), self.chunked.held(a.mb, a.chunk))

    def after_backward(self, a: Action) -> None:  # every B (and I): free the chunk's cache
        ex = self.executor
        self.chunked.done(a.mb, a.chunk)
        self.held_chunks -= 1
        if ex.meter:  # release this chunk's bytes first: the meter tracks storages by address, and the dK/dV
            ex.meter.release(key_of(a))  # filed below may reuse the address of one it freed (its popped dK)
        for c in range(a.chunk):  # dK/dV this backward filed for earlier chunks
            ex.hold((a.stage, a.mb, c), self.chunked.held(a.mb, c))


def _chunk_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy of one chunk. logits [B,l,V], target [B,l]"""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1), reduction="sum")
