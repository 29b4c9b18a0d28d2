"""Quantized all-to-all for MoE token dispatch (int8 / int4 / fp8-e4m3 payload + fp32 scales).

Dispatch sends each routed token to the rank that owns its expert. Quantizing the tokens before
the all-to-all halves (int8) or quarters (int4) the bytes; the combine that brings the expert
outputs back stays in high precision (DeepSeek-V3: FP8 dispatch, BF16 combine)::

    rank r: x [T,H] ─► per token, per `block` channels: s = amax/qmax, q = round(x/s)
            wire row = [ q (H bytes | H/2 bytes for int4) | s (4*H/block bytes, fp32 viewed as uint8) ]
            (fp8: s = amax/448, q = the float8_e4m3fn bits as uint8: gloo cannot send float8 tensors)
            all_to_all_single(wire rows, in_splits ─► out_splits)          (one collective)
            received rows ─► q * s ─► experts ─► y ─► all_to_all_single (fp32, plain) ─► combine

    bytes per token on the wire:  fp32 4H   bf16 2H   int8 = fp8 H + 4H/128 = 1.031H   int4 0.5H + 0.031H

Backward is straight-through: the gradient of the dispatch is the plain all-to-all of the incoming
gradient in the opposite direction, in the gradient's own precision.

``mode`` is "none" (send the tensor as it is: bitwise the plain collective), "bf16", "int8", "int4" or "fp8".
With ``check=True`` (the default) the ranks first all-gather their settings and whether their
tokens are finite, so a mismatch (mode, block, hidden size, dtype) or a NaN/Inf on any rank raises
the same ValueError on every rank instead of a hang or garbage.

This module is the wire format; the MoE token dispatcher that uses it (routing, permutation, autograd,
async handles) is ``toolkit.moe``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from toolkit import quant as Q

MODES = ("none", "bf16", "int8", "int4", "fp8")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_BITS = {"int8": 8, "int4": 4, "fp8": 8}  # the quantized modes: payload bits per value


def wire_bytes_per_token(mode: str, hidden: int, block: int = 128, dtype: torch.dtype = torch.float32) -> int:
    """Bytes one token occupies on the wire (the row size of the dispatch buffer)."""
    if mode == "none":
        return hidden * torch.finfo(dtype).bits // 8
    if mode == "bf16":
        return 2 * hidden
    return hidden * _BITS[mode] // 8 + 4 * (hidden // block)


def _validate_local(x: torch.Tensor, mode: str, block: int) -> None:
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not allowed; allowed: {MODES}")
    if x.dtype not in DTYPES:
        raise ValueError(f"tokens dtype={x.dtype} is not supported; allowed: {DTYPES}")
    if x.dim() != 2:
        raise ValueError(f"tokens must be 2-D [tokens, hidden], got shape {tuple(x.shape)}")
    if mode in _BITS and (block < 2 or block % 2 or x.shape[1] % block):
        raise ValueError(f"block={block} must be even and divide the hidden size {x.shape[1]} (scales are per "
                         f"token per block of channels; pick a divisor such as 128, 64 or 32)")
    if mode in _BITS and not bool(torch.isfinite(x).all()):
        raise ValueError("tokens hold NaN/Inf; a quantized all-to-all needs finite inputs (scales would be inf/nan)")


def check_agreement(x: torch.Tensor, mode: str, block: int, group=None) -> None:
    """Collective: all-gather every rank's settings, then raise the same ValueError on every rank if any rank's
    input is bad (unknown mode or dtype, not 2-D, NaN/Inf) or the ranks disagree (mode, block, hidden, dtype).

    A rank that raised alone would leave the others waiting in the all-to-all until the timeout.
    """
    mine = torch.tensor([MODES.index(mode) if mode in MODES else -1, block, x.shape[-1] if x.dim() else -1,
                         DTYPES.index(x.dtype) if x.dtype in DTYPES else -1, int(x.dim() == 2),
                         int(bool(torch.isfinite(x).all())) if x.is_floating_point() and mode in _BITS else 1],
                        dtype=torch.int64)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    every = torch.stack(every)  # [world, 6]
    for col, problem in ((0, f"an unknown mode (allowed: {MODES})"), (3, f"an unsupported dtype (allowed: {DTYPES})"),
                         (4, "tokens that are not 2-D [tokens, hidden]"), (5, "NaN/Inf tokens (scales would be inf/nan)")):
        bad = (every[:, col] <= (-1 if col < 4 else 0)).nonzero().flatten().tolist()
        if bad:
            raise ValueError(f"rank(s) {bad} passed {problem} to the quantized all-to-all")
    for col, name, show in ((0, "mode", lambda v: repr(MODES[v])), (1, "block", str), (2, "hidden size", str),
                            (3, "dtype", lambda v: str(DTYPES[v]))):
        if not torch.all(every[:, col] == every[0, col]):
            per_rank = ", ".join(f"rank {r}: {show(int(v))}" for r, v in enumerate(every[:, col]))
            raise ValueError(f"ranks disagree on the all-to-all {name} ({per_rank}); every rank must use the same")


def encode(x: torch.Tensor, mode: str, block: int = 128, check_finite: bool = True) -> torch.Tensor:
    """Tokens [T,H] -> wire rows [T, row_bytes] (uint8 for int8/int4, bf16 or the input itself otherwise);
    ``check_finite``: quantized modes refuse NaN/Inf (a host sync)."""
    if mode == "none":
        return x
    if mode == "bf16":
        return x.to(torch.bfloat16)
    t, h = x.shape
    if t == 0:  # nothing to quantize (a rank may send no token to anyone)
        return x.new_empty((0, wire_bytes_per_token(mode, h, block)), dtype=torch.uint8)
    q = (Q.quantize_fp8_blockwise(x, block=block, check_finite=check_finite) if mode == "fp8"  # per token and block
         else Q.quantize_blockwise(x, bits=_BITS[mode], block=block, check_finite=check_finite))
    payload = q.payload.view(torch.uint8).view(t, -1)  # [T, H] or [T, H/2]
    scales = q.scales.view(t, h // block).view(torch.uint8)  # [T, 4H/block]
    return torch.cat([payload, scales], dim=1)


def decode(wire: torch.Tensor, mode: str, hidden: int, dtype: torch.dtype, block: int = 128) -> torch.Tensor:
    """Wire rows [R, row_bytes] -> tokens [R, hidden] of ``dtype``."""
    if mode in ("none", "bf16"):
        return wire.to(dtype)
    r = wire.shape[0]
    if r == 0:
        return torch.empty((0, hidden), dtype=dtype, device=wire.device)
    pay_cols = hidden * _BITS[mode] // 8
    payload = wire[:, :pay_cols].contiguous().view(-1)
    scales = wire[:, pay_cols:].contiguous().view(torch.float32).view(-1)  # [R * H/block]
    if mode == "int8":
        payload = payload.view(torch.int8)
    q = Q.Quantized(payload, scales, _BITS[mode], block, torch.Size((r, hidden)), "fp8_e4m3" if mode == "fp8" else mode)
    return Q.dequantize_blockwise(q, dtype=dtype)


def all_to_all_quantized(x: torch.Tensor, in_splits: list[int], out_splits: list[int], mode: str = "int8",
                         block: int = 128, group=None, check: bool = True) -> torch.Tensor:
    """Send rows of ``x`` [T,H] (``in_splits[j]`` rows to rank j), receive ``sum(out_splits)`` rows, in ``mode``."""
    if check:
        check_agreement(x, mode, block, group)
    _validate_local(x, mode, block)
    wire = encode(x, mode, block)
    out = wire.new_empty((sum(out_splits), *wire.shape[1:]))
    dist.all_to_all_single(out, wire.contiguous(), out_splits, in_splits, group=group)
    return decode(out, mode, x.shape[1], x.dtype, block)
