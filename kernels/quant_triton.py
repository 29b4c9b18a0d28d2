"""Triton kernels of block-wise quantization (int8 / int4 / fp8-e4m3) and the Hadamard-32 transform.

Each program owns ``BPP`` whole blocks, a tile [BPP, BLOCK_P2] in registers (BLOCK_P2 = the
block size rounded up to a power of two, masked). Many blocks per program keep the grid small,
which matters twice: on a GPU each program moves ~16 KiB, and under ``TRITON_INTERPRET=1``
(numpy, one program at a time) the launch overhead is paid per program, not per block::

    grid = cdiv(n_blocks, BPP)
    program p:  x[p*BPP*block : (p+1)*BPP*block]  ─► tile [BPP, BLOCK_P2] ─► amax(axis=1) ─► s [BPP]
                                                                        └─► q = clamp(rne(x/s)) ─► store

The arithmetic mirrors ``kernels/reference.py`` operation by operation (IEEE division
``div_rn``, round-half-even by the 1.5*2^23 trick, the same uint32 hash for stochastic
rounding, the same butterfly order for H32), so the payloads are bitwise equal.

Entry points take and return torch tensors and are called by ``toolkit.quant``;
the triton.jit functions are decorated at import time, so set ``TRITON_INTERPRET=1``
before importing this module to run it on CPU.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE = 4096  # elements per program (BPP * BLOCK_P2)
RNE_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2**23: (y + M) - M rounds |y| < 2**22 to the nearest integer, ties to even


@triton.jit
def _uniform(idx, seed_mix):
    """U[0,1) from the lowbias32 hash of (element index + seed), in int64 masked to 32 bits (= reference)."""
    m = 0xFFFFFFFF
    h = (idx + seed_mix) & m
    h = h ^ (h >> 16)
    h = (h * 0x7FEB352D) & m
    h = h ^ (h >> 15)
    h = (h * 0x846CA68B) & m
    h = h ^ (h >> 16)
    return (h >> 8).to(tl.float32) * (1.0 / 16777216.0)


@triton.jit
def _load_blocks(x_ptr, numel, block, BPP: tl.constexpr, BLOCK_P2: tl.constexpr):
    """Tile [BPP, BLOCK_P2] of float32 (zero beyond the tensor and beyond each block), its indices and mask."""
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BPP + tl.arange(0, BPP)[:, None]  # [BPP,1] block ids
    cols = tl.arange(0, BLOCK_P2)[None, :]  # [1,BLOCK_P2]
    idx = rows * block + cols  # [BPP,BLOCK_P2] element ids
    in_block = cols < block
    x = tl.load(x_ptr + idx, mask=in_block & (idx < numel), other=0.0).to(tl.float32)
    return x, rows, cols, idx, in_block


@triton.jit
def _quant_int_kernel(x_ptr, q_ptr, s_ptr, numel, n_blocks, block, seed_mix,
                      QMAX: tl.constexpr, PACK4: tl.constexpr, STOCHASTIC: tl.constexpr,
                      BPP: tl.constexpr, BLOCK_P2: tl.constexpr):
    x, rows, cols, idx, in_block = _load_blocks(x_ptr, numel, block, BPP, BLOCK_P2)
    scale = tl.math.div_rn(tl.max(tl.abs(x), axis=1), QMAX)  # [BPP]
    safe = tl.where(scale > 0, scale, 1.0)
    y = tl.math.div_rn(x, safe[:, None])  # [BPP,BLOCK_P2]
    if STOCHASTIC:
        q = tl.floor(y + _uniform(idx, seed_mix))
    else:
        q = (y + RNE_MAGIC) - RNE_MAGIC
    q = tl.minimum(tl.maximum(q, -QMAX), QMAX).to(tl.int32)
    row_ok = rows < n_blocks
    tl.store(s_ptr + tl.reshape(rows, (BPP,)), scale, mask=tl.reshape(row_ok, (BPP,)))
    if PACK4:  # element 2j -> low nibble of byte j, element 2j+1 -> high nibble
        lo, hi = tl.split(tl.reshape(q, (BPP, BLOCK_P2 // 2, 2)))  # [BPP,BLOCK_P2/2] each
        byte = ((lo & 0xF) | ((hi & 0xF) << 4)).to(tl.uint8)
        half = tl.arange(0, BLOCK_P2 // 2)[None, :]
        tl.store(q_ptr + rows * (block // 2) + half, byte, mask=row_ok & (half < block // 2))
    else:
        tl.store(q_ptr + idx, q.to(tl.int8), mask=row_ok & in_block)


@triton.jit
def _quant_fp8_kernel(x_ptr, q_ptr, s_ptr, numel, n_blocks, block, BPP: tl.constexpr, BLOCK_P2: tl.constexpr):
    x, rows, cols, idx, in_block = _load_blocks(x_ptr, numel, block, BPP, BLOCK_P2)
    scale = tl.math.div_rn(tl.max(tl.abs(x), axis=1), 448.0)
    safe = tl.where(scale > 0, scale, 1.0)
    y = tl.minimum(tl.maximum(tl.math.div_rn(x, safe[:, None]), -448.0), 448.0)
    # Round onto the E4M3 grid in float32 first: the grid step is 2^(e-3) in the binade [2^e, 2^(e+1)),
    # 2^-9 below 2^-6 (subnormals). Dividing/multiplying by a power of two is exact, so the float8 cast
    # below is exact too. (Triton 3.x's interpreter drops the exponent carry when its own fp32->fp8
    # rounding overflows the mantissa, e.g. 124.3 -> 64 instead of 128; this path never asks it to round.)
    e = ((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # unbiased exponent of |y|
    step = ((tl.maximum(e, -6) - 3 + 127) << 23).to(tl.float32, bitcast=True)
    r = ((tl.math.div_rn(tl.abs(y), step) + RNE_MAGIC) - RNE_MAGIC) * step
    y = tl.where(y.to(tl.int32, bitcast=True) < 0, -r, r)  # the sign bit: -0.0 stays -0.0 (torch's cast)
    code = y.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
    row_ok = rows < n_blocks
    tl.store(s_ptr + tl.reshape(rows, (BPP,)), scale, mask=tl.reshape(row_ok, (BPP,)))
    tl.store(q_ptr + idx, code, mask=row_ok & in_block)


@triton.jit
def _dequant_kernel(q_ptr, s_ptr, out_ptr, n_blocks, block, FMT: tl.constexpr,
                    BPP: tl.constexpr, BLOCK_P2: tl.constexpr):
    """FMT 0 = int8, 1 = int4 (packed), 2 = fp8 bits. out [n_blocks*block] float32."""
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BPP + tl.arange(0, BPP)[:, None]
    row_ok = rows < n_blocks
    scale = tl.load(s_ptr + rows, mask=row_ok, other=0.0)  # [BPP,1]
    cols = tl.arange(0, BLOCK_P2)[None, :]
    if FMT == 1:
        half = tl.arange(0, BLOCK_P2 // 2)[None, :]
        byte = tl.load(q_ptr + rows * (block // 2) + half, mask=row_ok & (half < block // 2), other=0).to(tl.int32)
        lo, hi = byte & 0xF, byte >> 4
        lo = tl.where(lo >= 8, lo - 16, lo)
        hi = tl.where(hi >= 8, hi - 16, hi)
        v = tl.reshape(tl.join(lo, hi), (BPP, BLOCK_P2)).to(tl.float32)
    elif FMT == 2:
        raw = tl.load(q_ptr + rows * block + cols, mask=row_ok & (cols < block), other=0)
        v = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        v = tl.load(q_ptr + rows * block + cols, mask=row_ok & (cols < block), other=0).to(tl.float32)
    tl.store(out_ptr + rows * block + cols, v * scale, mask=row_ok & (cols < block))


@triton.jit
def _hadamard32_kernel(x_ptr, out_ptr, n_rows, INVERSE: tl.constexpr, ROWS: tl.constexpr):
    """H32 on ROWS runs of 32: view each as a 2x2x2x2x2 cube, butterfly (a+b, a-b) along each axis."""
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]
    offs = rows * 32 + tl.arange(0, 32)[None, :]
    ok = rows < n_rows
    x = tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    y = tl.reshape(x, (ROWS, 2, 2, 2, 2, 2))
    for _ in tl.static_range(5):  # axes 5, 4, 3, 2, 1 in turn (the reference's order)
        a, b = tl.split(y)  # the last axis
        y = tl.permute(tl.join(a + b, a - b), (0, 5, 1, 2, 3, 4))  # next axis becomes the last
    y = tl.reshape(y, (ROWS, 32))
    if INVERSE:
        y = y * (1.0 / 32.0)
    tl.store(out_ptr + offs, y, mask=ok)  # float32; torch casts (the interpreter truncates fp32->bf16)


def _layout(block: int) -> tuple[int, int]:
    block_p2 = triton.next_power_of_2(block)
    return max(1, TILE // block_p2), block_p2


def _seed_mix(seed: int) -> int:
    return (seed * 0x9E3779B9) & 0xFFFFFFFF


def quantize_int(x: torch.Tensor, bits: int, block: int, stochastic: bool, seed: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (payload int8 [n_blocks*block] or packed uint8 [n_blocks*block/2], scales float32 [n_blocks])."""
    x = x.contiguous().reshape(-1)
    if x.dtype == torch.float64:
        x = x.float()
    n_blocks = triton.cdiv(x.numel(), block)
    bpp, block_p2 = _layout(block)
    pack4 = bits == 4
    q = torch.empty(n_blocks * block // 2 if pack4 else n_blocks * block, dtype=torch.uint8 if pack4 else torch.int8,
                    device=x.device)
    s = torch.empty(n_blocks, dtype=torch.float32, device=x.device)
    _quant_int_kernel[(triton.cdiv(n_blocks, bpp),)](
        x, q, s, x.numel(), n_blocks, block, _seed_mix(seed), QMAX=2 ** (bits - 1) - 1, PACK4=pack4,
        STOCHASTIC=stochastic, BPP=bpp, BLOCK_P2=block_p2)
    return q, s


def quantize_fp8(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (payload uint8 [n_blocks*block] = float8_e4m3fn bits, scales float32 [n_blocks])."""
    x = x.contiguous().reshape(-1)
    if x.dtype == torch.float64:
        x = x.float()
    n_blocks = triton.cdiv(x.numel(), block)
    bpp, block_p2 = _layout(block)
    q = torch.empty(n_blocks * block, dtype=torch.uint8, device=x.device)
    s = torch.empty(n_blocks, dtype=torch.float32, device=x.device)
    _quant_fp8_kernel[(triton.cdiv(n_blocks, bpp),)](x, q, s, x.numel(), n_blocks, block, BPP=bpp, BLOCK_P2=block_p2)
    return q, s


def dequantize(payload: torch.Tensor, scales: torch.Tensor, block: int, fmt: str) -> torch.Tensor:
    """-> float32 [n_blocks*block] (padded length)."""
    n_blocks = scales.numel()
    bpp, block_p2 = _layout(block)
    out = torch.empty(n_blocks * block, dtype=torch.float32, device=payload.device)
    _dequant_kernel[(triton.cdiv(n_blocks, bpp),)](payload, scales, out, n_blocks, block,
                                                   FMT={"int8": 0, "int4": 1, "fp8_e4m3": 2}[fmt],
                                                   BPP=bpp, BLOCK_P2=block_p2)
    return out


def hadamard32(x: torch.Tensor, inverse: bool) -> torch.Tensor:
    """H32 (or H32/32) on each run of 32 elements of the flattened x; same shape and dtype."""
    flat = x.contiguous().reshape(-1)
    out = torch.empty(flat.shape, dtype=torch.float32, device=flat.device)
    n_rows = flat.numel() // 32
    rows = TILE // 32
    _hadamard32_kernel[(triton.cdiv(n_rows, rows),)](flat, out, n_rows, INVERSE=inverse, ROWS=rows)
    return out.view(x.shape).to(x.dtype)
