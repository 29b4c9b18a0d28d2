"""What a GPU's kernels achieve: one efficiency model for every cost model of the toolkit.

A datasheet peak is what no training run reaches. Each kernel here runs at a measured fraction of it, which
depends on its kind and shape, and pays fixed costs a roofline leaves out::

    kernel time = kernel_min_s + max(FLOPs / (peak · e(kind, shape)),  bytes / (HBM · hbm)) / step
                  └ the device's fixed cost of a kernel (a CUDA graph replay pays it too)
                                                              in a training step; 1 for one kernel alone ┘

    e(gemm, M, N, K)      = gemm · max over tile shapes t of  t.share · used(t) · K / (K + gemm_k_half)
                            (· gemm_misaligned when a dimension is not a multiple of 8)
                            used(t) = M·N / (⌈tiles / SMs⌉ · SMs · t.m · t.n),  tiles = ⌈M / t.m⌉ · ⌈N / t.n⌉
                            (cuBLAS picks a tile; partial tiles and a last, partial wave leave SMs idle)
    e(attention, s, d)    = its plateau (forward, causal forward, backward) · waves of its query blocks
                            · s / (s + attention_half_seq) · (d / 64 for heads narrower than 64)
    e(memory)             = 0 FLOPs: bytes / (HBM · hbm) alone
    host, per eager op    = host_op_s (Python, the dispatcher and the launch; ``graph_replay``: one launch)
    step                  = what a kernel keeps of its isolated rate inside a whole training step

The figures of each preset (``toolkit.runtime.cluster``) are fitted to published measurements
(``data/published/``: cuBLAS GEMM throughput by shape, FlashAttention-2 throughput by sequence length, copy
bandwidth, kernel and launch overheads, whole training steps), and ``tests/test_calibration.py`` checks the
model against every row.
MFU is reported against the datasheet peak, as published MFUs are.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

KINDS = ("gemm", "attention", "memory")


@dataclass(frozen=True)
class Kernel:
    """One kernel a cost model times: its kind (``KINDS``), FLOPs, bytes it reads and writes, and its shape where
    the kind's efficiency depends on one (a GEMM's (M, N, K, batch); attention's (batch·heads, seq, head_dim,
    causal, backward))."""

    kind: str
    flops: float
    bytes: float
    dims: tuple = ()
    count: int = 1
    """How many kernels the entry stands for (its FLOPs and bytes are their total): each pays the GPU's fixed
    kernel time and, eager, the host's cost of one op."""


def gemm(m: int, n: int, k: int, elem: int = 2, batch: int = 1) -> Kernel:
    """[m, k] @ [k, n] (``batch`` of them), ``elem`` bytes per element."""
    return Kernel("gemm", 2.0 * batch * m * n * k, float(batch * (m * k + k * n + m * n) * elem), (m, n, k, batch))


def attention(batch_heads: int, seq: int, head_dim: int, causal: bool = True, backward: bool = False,
              elem: int = 2) -> Kernel:
    """Flash attention over ``batch_heads`` (batch x heads) sequences of ``seq``: forward 4·s²·d FLOPs per head
    (QKᵀ and PV; half with ``causal``), backward 2.5x (five matmuls against two, scores recomputed)."""
    flops = 4.0 * batch_heads * seq * seq * head_dim * (0.5 if causal else 1.0) * (2.5 if backward else 1.0)
    io = batch_heads * seq * head_dim * elem * (8 if backward else 4)  # q, k, v, o (+ their gradients, dO)
    return Kernel("attention", flops, float(io), (batch_heads, seq, head_dim, causal, backward))


def memory(nbytes: float, count: int = 1) -> Kernel:
    """A memory-bound kernel (or ``count`` of them) moving ``nbytes`` in all."""
    return Kernel("memory", 0.0, float(nbytes), (), count)


@dataclass(frozen=True)
class Tile:
    """An output tile a GEMM library may choose, and the share of the plateau a kernel of such tiles reaches."""

    m: int
    n: int
    share: float
    stream: bool = False
    """A persistent (stream-K) kernel: it splits the K loops of its tiles over every SM, so a partial last wave
    costs nothing once there are as many tiles as SMs."""


@dataclass(frozen=True)
class Efficiency:
    """The achieved fractions of a GPU's peaks and its fixed costs (module docstring: the formulas)."""

    gemm: float
    """The plateau of large, well-shaped bf16 GEMMs, as a fraction of the dense peak (cuBLAS's best)."""
    gemm_misaligned: float
    """The share of the plateau left when a dimension is not a multiple of 8 (bf16: 16 bytes), which the tensor
    cores' vectorised loads need."""
    gemm_k_half: float
    """The K at which a GEMM's main loop and its prologue/epilogue take as long (short K: the tile's write
    dominates)."""
    tiles: tuple[Tile, ...]
    """The output tiles the library chooses from (the largest reaches the plateau)."""
    attention: float
    """Flash attention's forward plateau (long sequences, no mask), as a fraction of the dense peak."""
    attention_causal: float
    """The forward plateau with a causal mask (FLOPs counted for the causal half)."""
    attention_backward: float
    """The backward plateau (2.5x the forward's FLOPs)."""
    attention_half_seq: float
    """The sequence length at which attention reaches half of its plateau (the K/V loop's fill)."""
    hbm: float
    """Of the HBM bandwidth, what a memory-bound kernel reaches."""
    kernel_min_s: float
    """The device's fixed cost of one kernel (its launch latency on the GPU, the tail of its last wave): the
    shortest a kernel takes, in a CUDA graph too."""
    host_op_s: float
    """The host's cost of one eager PyTorch op: Python, the dispatcher, the allocator and the launch."""
    step: float = 1.0
    """Of a kernel's isolated rate (the fractions above, fitted to single-kernel benchmarks), what it keeps inside
    a whole training step: the median of published whole-step MFU over this model's kernel MFU for the same runs
    (``data/published/training.csv``, ``toolkit.runtime.calibration.fit_step``). It stands for what a benchmark
    of one kernel leaves out: gaps between kernels, the optimizer, embeddings and loss, communication a framework
    does not hide, clocks under sustained load."""
    source: str = ""

    def __post_init__(self):
        object.__setattr__(self, "_gemm_memo", {})  # shapes already placed on tiles: not a field (cost models
        # time the same GEMMs many times)
        for name in ("gemm", "gemm_misaligned", "attention", "attention_causal", "attention_backward", "hbm", "step"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1:
                raise ValueError(f"Efficiency {name}={v!r} is not allowed; allowed: a fraction in (0, 1]")
        for name in ("gemm_k_half", "attention_half_seq", "kernel_min_s", "host_op_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"Efficiency {name}={v!r} is not allowed; allowed: a finite number >= 0")
        if not self.tiles or any(not 0 < t.share <= 1 or t.m < 1 or t.n < 1 for t in self.tiles):
            raise ValueError(f"Efficiency tiles={self.tiles!r}: at least one Tile with m, n >= 1, share in (0, 1]")

    def scaled(self, factor: float) -> "Efficiency":
        """Every achieved fraction times ``factor`` (capped at 1: no kernel beats the peak); fixed costs
        unchanged. The sensitivity band of an emulated result perturbs this."""
        if not factor > 0:
            raise ValueError(f"Efficiency.scaled(factor={factor!r}): a number > 0")
        return dataclasses.replace(self, **{name: min(1.0, getattr(self, name) * factor) for name in (
            "gemm", "attention", "attention_causal", "attention_backward", "hbm")})

    # ---- the fractions --------------------------------------------------------------------------------------
    def gemm_fraction(self, m: int, n: int, k: int, sms: int, batch: int = 1) -> float:
        """Of the dense peak, what a [m, k] @ [k, n] GEMM (``batch`` of them) reaches on ``sms`` SMs: the best
        tile's share of the plateau times the useful part of its waves (partial tiles and a last, partial wave
        leave SMs idle), times the K loop against its prologue and epilogue."""
        key = (m, n, k, sms, batch)
        got = self._gemm_memo.get(key)
        if got is None:
            got = self._gemm_memo[key] = self._gemm_fraction(m, n, k, sms, batch)
        return got

    def _gemm_fraction(self, m: int, n: int, k: int, sms: int, batch: int) -> float:
        best = 0.0
        for t in self.tiles:
            tiles = math.ceil(m / t.m) * math.ceil(n / t.n) * batch
            if t.stream:
                used = m * n * batch / (tiles * t.m * t.n) * min(1.0, tiles / sms)
            else:
                used = m * n * batch / (math.ceil(tiles / sms) * sms * t.m * t.n)
            best = max(best, t.share * used)
        aligned = 1.0 if m % 8 == 0 and n % 8 == 0 and k % 8 == 0 else self.gemm_misaligned
        return self.gemm * aligned * best * k / (k + self.gemm_k_half)

    def attention_fraction(self, batch_heads: int, seq: int, head_dim: int, causal: bool, backward: bool,
                           sms: int) -> float:
        """Of the dense peak, what flash attention over ``batch_heads`` sequences of ``seq`` (heads of
        ``head_dim``) reaches: its plateau, the waves of its 128-query blocks over ``sms`` SMs, the fill of its
        K/V loop, and heads narrower than 64 (half the tensor-core work per load)."""
        plateau = self.attention_backward if backward else self.attention_causal if causal else self.attention
        blocks = batch_heads * math.ceil(seq / 128)
        waves = blocks / (sms * math.ceil(blocks / sms))
        return plateau * waves * seq / (seq + self.attention_half_seq) * min(1.0, head_dim / 64)


def kernel_seconds(k: Kernel, peak_flops: float, hbm_bytes_per_s: float, sms: int, eff: Efficiency,
                   flop_scale: float = 1.0, byte_scale: float = 1.0) -> float:
    """Seconds of one ``Kernel`` entry on a device (module docstring), in a training step (``eff.step``; 1: alone,
    as a benchmark of one kernel times it). ``flop_scale`` / ``byte_scale``: the entry stands for one that many
    times larger (the emulator's workload-matched mode); its shape then grows by the cube root of the FLOP factor
    in each dimension (to multiples of 8, as a real model's are), which keeps the toy's aspect ratios."""
    work_s = 0.0
    flops = k.flops * flop_scale
    if flops > 0:
        if k.kind == "gemm" and k.dims:
            m, n, kk, batch = k.dims
            if flop_scale != 1.0:  # the shape it stands for: each side x the cube root, aligned as a real one is
                g = flop_scale ** (1 / 3)
                m, n, kk = (max(8, 8 * round(x * g / 8)) for x in (m, n, kk))
            fraction = eff.gemm_fraction(m, n, kk, sms, batch)
        elif k.kind == "attention" and k.dims:
            batch_heads, seq, head_dim, causal, backward = k.dims
            g = flop_scale ** (1 / 3)
            fraction = eff.attention_fraction(max(1, round(batch_heads * g)), max(1, round(seq * g)), head_dim,
                                              causal, backward, sms)
        else:  # a GEMM-like kernel of unknown shape (a factorisation, a fused kernel): the plateau
            fraction = eff.gemm
        work_s = flops / (peak_flops * fraction)
    work_s = max(work_s, k.bytes * byte_scale / (hbm_bytes_per_s * eff.hbm))
    return k.count * eff.kernel_min_s + work_s / eff.step


PEAK = Efficiency(gemm=1.0, gemm_misaligned=1.0, gemm_k_half=0.0, tiles=(Tile(1, 1, 1.0),), attention=1.0, attention_causal=1.0,
                  attention_backward=1.0, attention_half_seq=0.0, hbm=1.0, kernel_min_s=0.0, host_op_s=0.0,
                  source="every kernel at the datasheet peaks, no fixed costs: a roofline, for a machine whose "
                         "figures are already achieved rates")
"""A roofline: every fraction 1, no fixed costs."""
