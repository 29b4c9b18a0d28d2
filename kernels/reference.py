"""Torch references of the quantization kernels (the ground truth the Triton kernels are tested against).

Every function works on the *flattened* tensor, cut into blocks of ``block`` consecutive elements::

    x [any shape] ─► flatten + zero-pad ─► [n_blocks, block] ─► amax per row ─► s = amax / qmax   [n_blocks]
                                                            └─► q = clamp(round(x / s), -qmax, qmax)
    int8 : payload int8  [n_blocks*block]
    int4 : payload uint8 [n_blocks*block/2]    (element 2i in the low nibble, 2i+1 in the high nibble)
    fp8  : payload uint8 [n_blocks*block]      (bits of float8_e4m3fn; s = amax/448, round to nearest even)

The arithmetic is written so that a Triton kernel doing the same operations in float32 gets
the same bits: one IEEE division ``x / s``, round-half-even, one multiply to dequantize, and
stochastic rounding from a counter-based integer hash of (seed, element index) that both
torch and Triton compute in uint32 arithmetic.
"""
from __future__ import annotations

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def qmax_of(bits: int) -> int:
    """Largest magnitude of a symmetric ``bits``-bit integer code: 127 for 8 bits, 7 for 4 bits."""
    return 2 ** (bits - 1) - 1


def blocks_of(x: torch.Tensor, block: int) -> torch.Tensor:
    """Flatten to float32 and zero-pad to whole blocks: [n_blocks, block]."""
    flat = x.detach().reshape(-1).float()
    pad = (-flat.numel()) % block
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, block)


def uniform_hash(seed: int, index: torch.Tensor) -> torch.Tensor:
    """U[0,1) float32 from (seed, element index): the lowbias32 integer hash, top 24 bits.

    Computed in int64 and masked to 32 bits so it equals the uint32 arithmetic of the kernel.
    """
    m = 0xFFFFFFFF
    h = (index + ((seed * 0x9E3779B9) & m)) & m
    h = h ^ (h >> 16)
    h = (h * 0x7FEB352D) & m
    h = h ^ (h >> 15)
    h = (h * 0x846CA68B) & m
    h = h ^ (h >> 16)
    return (h >> 8).float() * (1.0 / 16777216.0)


def quantize_int(x: torch.Tensor, bits: int, block: int, stochastic: bool = False,
                 seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric block-wise integer quantization -> (codes int8 [n_blocks*block], scales float32 [n_blocks])."""
    qmax = qmax_of(bits)
    xb = blocks_of(x, block)  # [nb, block]
    scale = xb.abs().amax(dim=1) / qmax  # [nb]
    y = xb / torch.where(scale > 0, scale, 1.0)[:, None]  # an all-zero block keeps s = 0 and codes 0
    del xb  # rounding and clamping in place: at most two float32 copies of x are alive (a codec's working set)
    if stochastic:
        idx = torch.arange(y.numel(), dtype=torch.int64).view_as(y)
        y = y.add_(uniform_hash(seed, idx)).floor_()
    else:
        y = y.round_()  # round half to even
    return y.clamp_(-qmax, qmax).to(torch.int8).reshape(-1), scale


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 codes in [-7, 7], even length -> uint8, two per byte (even index in the low nibble)."""
    n = (q.to(torch.int16) & 0xF).view(-1, 2)
    return (n[:, 0] | (n[:, 1] << 4)).to(torch.uint8)


def unpack_int4(p: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: uint8 [n] -> int8 codes [2n]."""
    b = p.to(torch.int16)
    n = torch.stack([b & 0xF, b >> 4], dim=1).reshape(-1)
    return torch.where(n >= 8, n - 16, n).to(torch.int8)


def quantize_fp8(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise FP8-E4M3FN: s = amax/448, y = x/s rounded (nearest even) onto the E4M3 grid.

    Returns (payload uint8 [n_blocks*block] = the float8 bits, scales float32 [n_blocks]).
    """
    xb = blocks_of(x, block)
    scale = xb.abs().amax(dim=1) / FP8_MAX
    y = (xb / torch.where(scale > 0, scale, 1.0)[:, None]).clamp(-FP8_MAX, FP8_MAX)
    return y.to(torch.float8_e4m3fn).view(torch.uint8).reshape(-1), scale


def dequantize(codes: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """codes (int8 values or float8 bits already decoded to float32) [n_blocks*block] -> float32, same length."""
    return (codes.float().view(-1, block) * scales[:, None]).reshape(-1)


def hadamard32(x: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Unnormalized Sylvester H32 on every run of 32 consecutive elements, as a radix-2 butterfly.

    H32 = H2 (x) H2 (x) H2 (x) H2 (x) H2: view each 32-block as a 2x2x2x2x2 cube and apply
    (a, b) -> (a + b, a - b) along each axis. ``inverse`` scales by 1/32 (H H = 32 I).
    """
    shape, dtype = x.shape, x.dtype
    y = x.reshape(-1, 2, 2, 2, 2, 2).float()
    for axis in range(5, 0, -1):  # the same axis order as the Triton kernel
        a, b = y.select(axis, 0), y.select(axis, 1)
        y = torch.stack([a + b, a - b], dim=axis)
    if inverse:
        y = y * (1.0 / 32.0)
    return y.reshape(shape).to(dtype)
