"""EDGC: entropy-driven dynamic low-rank gradient compression, on a PowerSGD engine.

Data parallelism averages every gradient across ranks. PowerSGD (Vogels et al. 2019) sends a
rank-r factorisation of each gradient matrix instead, and keeps what it loses as an error that
is added back next step. EDGC (Yi et al. 2025) picks r per pipeline stage and per window from
the gradient's entropy: less information in the gradient, smaller rank.

One step, per stage s (a stage is a group of parameters; here: first / second half of the blocks)::

    grads of stage s ─flatten─► g [N_s] ; x = g + e_s          (e_s: error kept from the last step)
        │                         │
        │ every k-th step         ├─ matrices M [n,m] (views of x)       ├─ vectors, small matrices
        ▼ (ISR α = 1/k)           │  P = M Q             [n,r]            │  all-reduce, / W
    sample β·N_s elements         │  all-reduce P (sum)                   │
    histogram entropy h (bits)    │  orthogonalize P     (Gram-Schmidt / QR)
        │                         │  Q = Mᵀ P            [m,r]
        ▼ mean over the window    │  all-reduce Q, / W
    rank 0: r_s = r(h_w) ──broadcast──► every rank sets r_s (checked: all ranks agree)
                                  │  M̂ = P Qᵀ           = P Pᵀ mean(M)
                                  ▼
                        ĝ (same on every rank) ; e_s = x − ĝ   (error feedback, local)

Bytes on the wire per step (ring all-reduce, fp32): 2(W−1)/W · 4 · (Σ r(n+m) + Σ uncompressed)
against 2(W−1)/W · 4 · Σ nm for the plain all-reduce.

Rank from entropy (our reading of the paper, whose exact model is not public). The sampler gives
the differential entropy h (bits) of a stage's gradient (histogram estimator). At the end of the
warm-up the gradient is taken to carry ``ref_bits`` bits per element at the resolution worth
keeping; that fixes the grid Δ = 2^(h_ref − ref_bits). From then on H = h − log2 Δ is the entropy
on that grid, the bits per element it takes to describe the gradient as finely as at the warm-up
(for a Gaussian, H falls by one bit each time the spread halves). The rank follows the
information: r = r_init · H / ref_bits, clipped to [r_min, r_max]. Two models go with it (the CQM):
an error model, Eckart–Young ||M − M_r||² = Σ_{i>r} σ_i², evaluated for an unstructured gradient
(i.i.d. Gaussian, Marchenko–Pastur spectrum, Monte Carlo): the error a rank risks at worst; and a
time model, latency + bytes / bandwidth per all-reduce, fitted to measured calls.

``PowerSGDReducer`` with one bucket and a fixed rank computes what torch's ``powerSGD_hook``
computes (same Q initialisation from the same seed, same orthogonalisation, same error feedback).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from toolkit.quant import all_finite
from toolkit.runtime import compat


# ---- the PowerSGD engine -------------------------------------------------------------------------

def orthogonalize_(m: torch.Tensor, epsilon: float = 0.0) -> torch.Tensor:
    """Orthonormalise the columns of each matrix in a batch [B,n,r] in place (as torch's powerSGD_hook).

    Gram–Schmidt for r <= 2 (and half precision), Householder QR otherwise.
    """
    rank = m.shape[2]
    if rank <= 2 or m.dtype in (torch.float16, torch.bfloat16):
        for i in range(rank):
            col = m[:, :, i:i + 1]  # [B,n,1]
            norm = torch.norm(col, dim=1, keepdim=True)
            col /= (norm + epsilon) if epsilon else norm
            if i + 1 < rank:
                rest = m[:, :, i + 1:]
                rest -= torch.sum(col * rest, dim=1, keepdim=True) * col
    else:
        torch.linalg.qr(m, out=(m, torch.empty(m.shape[0], rank, rank, dtype=m.dtype, device=m.device)))
    return m


def allreduce_mean_(flat: torch.Tensor, group=None) -> torch.Tensor:
    """Plain data-parallel averaging, as DDP's default hook: divide by W, then sum across ranks."""
    flat.div_(dist.get_world_size(group))
    dist.all_reduce(flat, group=group)
    return flat


def should_compress(n: int, m: int, rank: int, min_compression_rate: float) -> bool:
    """A matrix is factorised only if r(n+m) · rate < nm (torch's rule); vectors never are."""
    return (n + m) * min(n, m, rank) * min_compression_rate < n * m


@dataclass
class _Bucket:
    params: list[torch.nn.Parameter]
    rank: int | None = None  # None: plain all-reduce
    error: torch.Tensor | None = None  # [N] error feedback, created at the first compressed step
    p_mem: torch.Tensor | None = None  # flat P of every compressed matrix (kept for warm start)
    q_mem: torch.Tensor | None = None
    q_rank: int | None = None  # rank the Q memory was built for


class PowerSGDReducer:
    """Average the gradients of several buckets (here: pipeline stages) across ``group``.

    Each bucket has its own rank (``None`` = plain all-reduce). ``reduce_()`` reads every
    ``param.grad``, synchronises it and writes the result back. ``set_ranks`` is collective and
    raises on every rank if the ranks disagree (instead of deadlocking on mismatched shapes).
    """

    def __init__(self, buckets: list[list[torch.nn.Parameter]], ranks: list[int | None] | None = None,
                 group=None, min_compression_rate: float = 2.0, warm_start: bool = True,
                 error_feedback: bool = True, seed: int = 0, epsilon: float = 0.0):
        if not buckets or any(len(b) == 0 for b in buckets):
            raise ValueError("buckets must be a non-empty list of non-empty parameter lists")
        if min_compression_rate <= 0:
            raise ValueError(f"min_compression_rate must be > 0, got {min_compression_rate}")
        self.buckets = [_Bucket(list(b)) for b in buckets]
        self.group, self.min_compression_rate = group, min_compression_rate
        self.warm_start, self.error_feedback, self.epsilon = warm_start, error_feedback, epsilon
        self.rng = np.random.RandomState(seed)  # the same generator torch's PowerSGDState uses
        self.set_ranks(ranks if ranks is not None else [None] * len(buckets), check=False)

    @property
    def ranks(self) -> list[int | None]:
        return [b.rank for b in self.buckets]

    def set_ranks(self, ranks: list[int | None], check: bool = True) -> None:
        """Set the rank of every bucket (None = plain all-reduce). Collective when ``check``."""
        if len(ranks) != len(self.buckets):
            raise ValueError(f"ranks has {len(ranks)} entries; expected one per bucket ({len(self.buckets)})")
        for r in ranks:
            if r is not None and (not isinstance(r, int) or isinstance(r, bool) or r < 1):
                raise ValueError(f"rank must be a positive int or None, got {r!r}")
        if check and dist.is_initialized() and dist.get_world_size(self.group) > 1:
            check_ranks_agree(ranks, self.group, self.buckets[0].params[0].device)
        for b, r in zip(self.buckets, ranks):
            b.rank = r

    def wire_elements(self, bucket: int, rank: int | None = None) -> list[int]:
        """Elements each all-reduce of one step sends for ``bucket`` at ``rank`` (plain: one call)."""
        b = self.buckets[bucket]
        rank = b.rank if rank is None else rank
        return step_elements([tuple(p.shape) for p in b.params], rank, self.min_compression_rate)

    def reduce_(self, grads: list[list[torch.Tensor]] | None = None) -> None:
        """Average every bucket in place: the parameters' ``.grad``, or ``grads[i]`` for bucket i (tensors
        shaped like its parameters, e.g. a DDP hook's ``bucket.gradients()``)."""
        for i, b in enumerate(self.buckets):
            self._reduce_bucket(b, grads[i] if grads is not None else [p.grad for p in b.params])

    # ---- one bucket ------------------------------------------------------------------------------
    def _reduce_bucket(self, b: _Bucket, grads: list[torch.Tensor]) -> None:
        flat = torch.cat([g.reshape(-1) for g in grads])  # x [N] = g (+ e), in bucket order
        if not all_finite(flat):  # one pass over the bucket (the host reads the flag)
            raise ValueError("gradient holds NaN/Inf values; refusing to compress and all-reduce it")
        world = dist.get_world_size(self.group)
        if b.error is not None:
            flat.add_(b.error)
        if b.rank is None:
            allreduce_mean_(flat, self.group)
            b.error = None  # whatever error was kept has now been sent, in full
            self._write_back(grads, flat)
            return
        if self.error_feedback and b.error is None:
            b.error = torch.zeros_like(flat)
        local = flat.clone() if self.error_feedback else None
        by_shape, plain = {}, []  # matrices M [n,m] to factorise, grouped by shape; everything else, sent as is
        for p, o in zip(b.params, _offsets(b.params)):
            piece = flat[o:o + p.numel()]
            n, m = p.shape[0], p.numel() // max(p.shape[0], 1)
            if p.dim() > 1 and should_compress(n, m, b.rank, self.min_compression_rate):
                by_shape.setdefault((n, m), []).append(piece.view(n, m))
            else:
                plain.append(piece)
        comp = [m for group in by_shape.values() for m in group]  # torch's order: shapes by first appearance
        ps, qs = self._factors(b, comp, flat)
        for m, q, p in zip(comp, qs, ps):
            torch.bmm(m.unsqueeze(0), q, out=p)  # P = M Q  [1,n,r]
        unc = torch.cat(plain) if plain else flat.new_empty(0)
        dist.all_reduce(unc, group=self.group)
        unc.div_(world)
        for t, o in zip(plain, _offsets(plain)):
            t.copy_(unc[o:o + t.numel()])
        dist.all_reduce(b.p_mem, group=self.group)  # a sum: P is orthogonalised, its scale does not matter
        for p in ps:
            orthogonalize_(p, self.epsilon)
        for m, p, q in zip(comp, ps, qs):
            torch.bmm(m.unsqueeze(0).transpose(1, 2), p, out=q)  # Q = Mᵀ P  [1,m,r]
        dist.all_reduce(b.q_mem, group=self.group)
        b.q_mem.div_(world)
        for m, p, q in zip(comp, ps, qs):
            torch.bmm(p, q.transpose(1, 2), out=m.unsqueeze(0))  # M̂ = P Qᵀ = P Pᵀ mean(M), written into x
        if self.error_feedback:
            b.error = local - flat  # e = x − x̂ (for the vectors: local − mean, whose sum over ranks is 0)
        if not self.warm_start:
            b.p_mem = b.q_mem = None
        self._write_back(grads, flat)

    def _factors(self, b: _Bucket, comp: list[torch.Tensor], like: torch.Tensor
                 ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Views [1,n,r] / [1,m,r] into the bucket's P and Q memories; Q is drawn anew when the rank changed."""
        ranks = [min(*m.shape, b.rank) for m in comp]
        fresh = b.q_mem is None or b.q_rank != b.rank  # a rank change invalidates the warm-start Q
        if fresh:
            b.p_mem = like.new_empty(sum(m.shape[0] * r for m, r in zip(comp, ranks)))
            b.q_mem = like.new_empty(sum(m.shape[1] * r for m, r in zip(comp, ranks)))
            b.q_rank = b.rank
        ps, qs, po, qo = [], [], 0, 0
        for m, r in zip(comp, ranks):
            n, k = m.shape
            ps.append(b.p_mem[po:po + n * r].view(1, n, r))
            qs.append(b.q_mem[qo:qo + k * r].view(1, k, r))
            po, qo = po + n * r, qo + k * r
        if fresh:
            with torch.random.fork_rng(devices=[]):  # torch's recipe: one seed per bucket from the numpy rng
                torch.manual_seed(self.rng.randint(1_000_000_000))
                for q in qs:
                    q.copy_(torch.randn(*q.shape, dtype=q.dtype))  # drawn on the CPU, as torch does
                    orthogonalize_(q, self.epsilon)
        else:
            for q in qs:
                orthogonalize_(q, self.epsilon)
        return ps, qs

    @staticmethod
    def _write_back(grads: list[torch.Tensor], flat: torch.Tensor) -> None:
        for g, o in zip(grads, _offsets(grads)):
            g.copy_(flat[o:o + g.numel()].view_as(g))


def _offsets(tensors) -> list[int]:
    out, o = [], 0
    for p in tensors:
        out.append(o)
        o += p.numel()
    return out


def step_elements(shapes: list[tuple[int, ...]], rank: int | None, min_compression_rate: float = 2.0) -> list[int]:
    """Elements of each all-reduce in one step: [N] plain, or [uncompressed, Σ n·r, Σ m·r] compressed."""
    if rank is None:
        return [sum(math.prod(s) for s in shapes)]
    unc = p = q = 0
    for s in shapes:
        n, m = s[0], math.prod(s[1:])
        if len(s) > 1 and should_compress(n, m, rank, min_compression_rate):
            r = min(n, m, rank)
            p, q = p + n * r, q + m * r
        else:
            unc += math.prod(s)
    return [unc, p, q]


def allreduce_wire_bytes(elements: int, world: int, elem_bytes: int = 4) -> int:
    """Bytes one rank sends for a ring all-reduce of ``elements`` (the ledger's convention)."""
    return 2 * (world - 1) * elements * elem_bytes // world


def check_ranks_agree(ranks: list[int | None], group=None, device: torch.device | str = "cpu") -> None:
    """Collective: raise RuntimeError on every rank if any two ranks hold different compression ranks.

    Mismatched ranks would give P/Q buffers of different sizes and the next all-reduce would hang
    or fail obscurely; one small fixed-size all-gather turns that into a clear error.
    """
    mine = torch.tensor([0 if r is None else r for r in ranks], dtype=torch.int64, device=device)
    world = dist.get_world_size(group)
    gathered = mine.new_empty(world * mine.numel())
    compat.all_gather_single(gathered, mine, group=group)
    table = gathered.view(world, -1).cpu()
    if not bool((table == table[0]).all()):
        rows = "; ".join(f"rank {i}: {row.tolist()}" for i, row in enumerate(table))
        raise RuntimeError(f"compression ranks disagree across data-parallel ranks ({rows}); every rank must "
                           "use the rank decided on rank 0 (broadcast it) or the P/Q all-reduces would not match")


# ---- the gradient data sampler (GDS) ----------------------------------------------------------------

def histogram_entropy(x: torch.Tensor, bins: int = 256) -> float:
    """Differential entropy (bits) of the values in ``x``, plug-in histogram estimator.

    h ≈ −Σ p_i log2 p_i + log2 Δ over ``bins`` equal bins of width Δ spanning [min, max].
    """
    x = x.detach().float().reshape(-1)
    if x.numel() < 2:
        raise ValueError(f"need at least 2 samples for an entropy estimate, got {x.numel()}")
    if not bool(torch.isfinite(x).all()):
        raise ValueError("gradient holds NaN/Inf values; cannot estimate its entropy")
    lo, hi = x.min().item(), x.max().item()
    if hi <= lo:
        return float("-inf")  # all equal: a point mass
    counts = torch.histc(x, bins=bins, min=lo, max=hi)
    p = counts[counts > 0] / x.numel()
    return float(-(p * p.log2()).sum()) + math.log2((hi - lo) / bins)


def sample_entropy(grads: list[torch.Tensor], fraction: float, bins: int, generator: torch.Generator) -> float:
    """``histogram_entropy`` of a random ``fraction`` (GSR β) of the elements of ``grads`` (one stage)."""
    flat = torch.cat([g.reshape(-1) for g in grads])
    k = max(2, int(round(fraction * flat.numel())))
    idx = torch.randint(0, flat.numel(), (k,), generator=generator)
    return histogram_entropy(flat[idx], bins)


def rank_from_entropy(h: float, h_ref: float, ref_bits: float, r_init: int, r_min: int, r_max: int) -> int:
    """r = r_init · H / ref_bits, H = ref_bits + h − h_ref the bits on the warm-up grid; clipped."""
    bits = max(ref_bits + h - h_ref, 0.0)
    return int(min(max(round(r_init * bits / ref_bits), r_min), r_max))


# ---- the compression quantification model (CQM) ----------------------------------------------------

_MP_CACHE: dict[tuple[int, int, int, int], torch.Tensor] = {}


def mp_tail(n: int, m: int, trials: int = 4, seed: int = 0) -> torch.Tensor:
    """g(r; n, m) for r = 0..min(n,m): expected fraction of ||M||_F² that the best rank-r approximation
    misses, for M [n,m] with i.i.d. Gaussian entries (Marchenko–Pastur spectrum; Monte Carlo, cached)."""
    key = (n, m, trials, seed)
    if key not in _MP_CACHE:
        gen = torch.Generator().manual_seed(seed)
        acc = torch.zeros(min(n, m) + 1, dtype=torch.float64)
        for _ in range(trials):
            s2 = torch.linalg.svdvals(torch.randn(n, m, generator=gen, dtype=torch.float64)) ** 2
            acc += spectral_tail(s2)
        _MP_CACHE[key] = (acc / trials).clamp_min(0.0)
    return _MP_CACHE[key]


def spectral_tail(s2: torch.Tensor) -> torch.Tensor:
    """Eckart–Young: from squared singular values [k], the fraction Σ_{i>r} σ_i² / Σ σ_i² for r = 0..k."""
    total = s2.sum()
    return (total - torch.cat([s2.new_zeros(1), s2.cumsum(0)])) / total


def error_fraction(shapes: list[tuple[int, ...]], rank: int, tails: dict[tuple[int, int], torch.Tensor] | None = None,
                   min_compression_rate: float = 2.0) -> float:
    """Σ nm·g(r) / Σ nm over the matrices a rank-``rank`` compressor factorises (MP tails by default)."""
    num = den = 0.0
    for s in shapes:
        n, m = s[0], math.prod(s[1:])
        if len(s) > 1 and should_compress(n, m, rank, min_compression_rate):
            g = tails[(n, m)] if tails is not None else mp_tail(n, m)
            num, den = num + n * m * float(g[min(n, m, rank)]), den + n * m
    return num / den if den else 0.0


@dataclass
class CommTimeModel:
    """t(bytes) = latency + bytes / bandwidth per all-reduce, fitted by least squares to measured calls."""

    latency_s: float
    bytes_per_s: float

    @classmethod
    def fit(cls, sent_bytes: list[float], seconds: list[float]) -> "CommTimeModel":
        x, y = np.asarray(sent_bytes, float), np.asarray(seconds, float)
        if len(x) < 2 or np.ptp(x) == 0:
            raise ValueError("need measurements at two or more different sizes to fit the time model")
        slope, intercept = np.polyfit(x, y, 1)
        return cls(max(float(intercept), 0.0), 1.0 / max(float(slope), 1e-15))

    def predict(self, calls_bytes: list[int]) -> float:
        """Seconds for a sequence of all-reduces of the given wire bytes."""
        return sum(self.latency_s + b / self.bytes_per_s for b in calls_bytes)


# ---- the controller: warm-up, windows, per-stage ranks -----------------------------------------------

@dataclass
class EDGCConfig:
    warmup: int = 20
    """Steps of plain all-reduce before compression starts."""
    window: int = 20
    """Steps between two rank decisions; the entropy of a decision is the mean over the window just ended."""
    isr_every: int = 2
    """Iteration sampling: the entropy is measured every ``isr_every``-th step (α = 1/isr_every)."""
    gsr: float = 0.1
    """Gradient sampling rate β: fraction of a stage's elements the entropy is estimated from."""
    bins: int = 256
    ref_bits: float = 6.0
    """Bits per element the warm-up gradient is described with; each bit of entropy lost later takes
    r_init / ref_bits off the rank (the sensitivity of the rank to the entropy)."""
    r_init: int = 4
    """Rank at the end of the warm-up, paired with the entropy measured there."""
    r_min: int = 1
    r_max: int = 16
    min_compression_rate: float = 2.0
    seed: int = 0
    epsilon: float = 0.0
    """Added to each column norm when orthogonalizing (0: torch's powerSGD_hook; > 0 keeps a matrix whose gradient
    is all zero, e.g. a vocabulary shard whose tokens never occur, from dividing 0 by 0 in Gram-Schmidt)."""

    def validate(self) -> "EDGCConfig":
        for name in ("warmup", "window", "isr_every", "bins", "r_init", "r_min", "r_max"):
            v = getattr(self, name)
            low = 0 if name == "warmup" else 1
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise ValueError(f"{name} must be an int >= {low}, got {v!r}")
        if not self.r_min <= self.r_init <= self.r_max:
            raise ValueError(f"need r_min <= r_init <= r_max, got {self.r_min}, {self.r_init}, {self.r_max}")
        if not (isinstance(self.gsr, (int, float)) and 0.0 < self.gsr <= 1.0):
            raise ValueError(f"gsr must be in (0, 1], got {self.gsr!r}")
        if not (isinstance(self.ref_bits, (int, float)) and self.ref_bits > 0 and math.isfinite(self.ref_bits)):
            raise ValueError(f"ref_bits must be a finite number > 0, got {self.ref_bits!r}")
        if not (isinstance(self.epsilon, (int, float)) and 0.0 <= self.epsilon < 1.0):
            raise ValueError(f"epsilon must be a number in [0, 1), got {self.epsilon!r}")
        if self.isr_every > self.window:
            raise ValueError(f"isr_every={self.isr_every} must be <= window={self.window} (one sample per window)")
        return self


@dataclass
class EDGC:
    """Entropy-driven rank control around a :class:`PowerSGDReducer`, one rank per stage.

    Call ``sync(step)`` after ``backward()`` on every rank; it samples the entropy, decides ranks
    at window boundaries (rank 0 decides, a broadcast makes them everyone's) and averages the grads.
    """

    stages: list[list[torch.nn.Parameter]]
    cfg: EDGCConfig
    group: object = None
    history: list[dict] = field(default_factory=list)

    def __post_init__(self):
        self.cfg.validate()
        self.reducer = PowerSGDReducer(self.stages, None, self.group, self.cfg.min_compression_rate,
                                       seed=self.cfg.seed, epsilon=self.cfg.epsilon)
        self.shapes = [[tuple(p.shape) for p in s] for s in self.stages]
        self.gen = torch.Generator().manual_seed(self.cfg.seed)
        self.samples: list[tuple[int, list[float]]] = []  # (step, entropy per stage) of the sampled steps
        self.h_ref: list[float] | None = None  # entropy per stage at the end of the warm-up

    def sync(self, step: int) -> dict:
        """Sample, decide (at window boundaries), then average this step's gradients in place."""
        cfg, rec = self.cfg, {"step": step, "entropy": None}
        if step % cfg.isr_every == 0:  # GDS: sampled steps, sampled elements
            rec["entropy"] = [sample_entropy([p.grad for p in s], cfg.gsr, cfg.bins, self.gen) for s in self.stages]
            self.samples.append((step, rec["entropy"]))
        if step >= cfg.warmup and (step - cfg.warmup) % cfg.window == 0:
            self.reducer.set_ranks(self._decide(step))
        rec["ranks"] = self.reducer.ranks
        self.reducer.reduce_()
        self.history.append(rec)
        return rec

    def _decide(self, step: int) -> list[int]:
        """Rank 0 maps the window's mean entropy to a rank per stage; the broadcast makes it global."""
        cfg = self.cfg
        recent = [hs for s, hs in self.samples if s > step - cfg.window]  # the window just ended
        mean = [sum(col) / len(col) for col in zip(*recent)]
        if self.h_ref is None:  # end of warm-up: freeze the grid, start at r_init
            self.h_ref = mean
        ranks = [rank_from_entropy(h, h_ref, cfg.ref_bits, cfg.r_init, cfg.r_min, cfg.r_max)
                 for h, h_ref in zip(mean, self.h_ref)]
        decided = torch.tensor(ranks, dtype=torch.int64, device=self.stages[0][0].device)
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
            dist.broadcast(decided, src=src, group=self.group)
        return [int(r) for r in decided.tolist()]
