"""Block-wise quantization: the one API every lesson uses (int8, int4, fp8-e4m3, Hadamard-32).

::

    x [any shape, fp32/fp16/bf16/fp64] ─► quantize_blockwise(x, bits, block) ─► Quantized
        flatten, zero-pad to blocks of `block`       payload  int8 [numel_padded]          (bits=8)
        s = amax(block) / qmax   (qmax 127 | 7)               uint8 [numel_padded // 2]     (bits=4, 2 per byte)
        q = clamp(round(x / s), -qmax, qmax)                  uint8 bits of float8_e4m3fn   (fp8)
                                                     scales   float32 [n_blocks]
    Quantized ─► dequantize_blockwise(q) ─► q * s  reshaped to the original shape

``payload`` and ``scales`` are what goes on the wire (``Quantized.nbytes()``); every
payload is an integer dtype, so gloo and nccl can both send it.

Two implementations compute the same bits: the torch reference (``kernels/reference.py``)
and the Triton kernels (``kernels/quant_triton.py``). ``impl="auto"`` picks Triton for
CUDA tensors and the reference on CPU; ``set_impl`` changes the default for every call.
On an emulated cluster a call the reference computes is timed as the Triton kernel a GPU
runs instead (``toolkit.runtime.portable.fused_kernel``): one launch, its inputs read and its
outputs written once (the reference's op-by-op passes, its integer hash included, would each
cost a round trip to HBM).
"""
from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import is_fake

from kernels import reference as ref
from toolkit.runtime.portable import fused_kernel

IMPLS = ("auto", "torch", "triton")
FORMATS = {8: "int8", 4: "int4"}
TRITON_MAX_BLOCK = 16384  # larger blocks (e.g. per-tensor scaling) use the torch reference under "auto"
_impl = "auto"


@dataclass
class Quantized:
    """A block-quantized tensor: integer payload + one float32 scale per block."""

    payload: torch.Tensor
    """int8 [numel_padded] (int8), uint8 [numel_padded // 2] (int4), uint8 bits of float8_e4m3fn (fp8)."""
    scales: torch.Tensor
    """float32 [n_blocks]; 0 for an all-zero block."""
    bits: int
    block: int
    shape: torch.Size
    """Shape of the original tensor (``dequantize_blockwise`` restores it)."""
    fmt: str
    """"int8", "int4" or "fp8_e4m3"."""

    def nbytes(self) -> int:
        """Bytes on the wire: payload + scales."""
        return self.payload.numel() * self.payload.element_size() + self.scales.numel() * self.scales.element_size()

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def set_impl(name: str) -> None:
    """Default implementation for calls with ``impl="auto"``: "auto", "torch" or "triton"."""
    global _impl
    _check_impl(name)
    _impl = name


def get_impl() -> str:
    return _impl


def _check_impl(name: str) -> None:
    if name not in IMPLS:
        raise ValueError(f"impl={name!r} is not allowed; allowed: {IMPLS}")


def _use_triton(x: torch.Tensor, impl: str, block: int | None = None) -> bool:
    _check_impl(impl)
    impl = _impl if impl == "auto" else impl
    if impl == "torch":
        return False
    if impl == "triton":
        if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("impl='triton' on a CPU tensor needs TRITON_INTERPRET=1 (set before importing "
                               "kernels.quant_triton); use impl='torch' or move the tensor to CUDA")
        if block is not None and block > TRITON_MAX_BLOCK:
            raise ValueError(f"block={block} is above the Triton kernels' limit {TRITON_MAX_BLOCK}; use impl='torch'")
        return True
    return x.is_cuda and (block is None or block <= TRITON_MAX_BLOCK) and _triton_available()


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@contextlib.contextmanager
def _one_kernel(name: str):
    """The reference's ops inside stand for one Triton kernel (see the module docstring; ``fused_kernel``):
    ``kernel(reads, writes, flops=0)`` says what it reads and writes."""
    with fused_kernel(f"{name} (Triton kernel)", "memory") as kernel:
        def charge(reads, writes, flops: float = 0.0) -> None:
            kernel.cost = lambda: (flops, [reads, writes], ())
        yield charge


def all_finite(x: torch.Tensor) -> bool:
    """Whether ``x`` holds no NaN or Inf, in one pass over it: max |x| (``torch.linalg.vector_norm(x, inf)``, one
    reduction that a NaN or an Inf of either sign carries into its result, and that cannot overflow), then
    ``isfinite`` of that one value. ``torch.isfinite(x).all()`` makes five passes over ``x`` (``isfinite`` is
    composite: eq, abs, ne, mul; then all) and launches as many kernels: these checks cost lesson 06's emulated
    codec more than its kernels. The host reads the flag: it waits for the device. Under fake tensors (a step
    traced at true shapes, ``toolkit.runtime.shapes``) the reduction is issued as on a GPU but there is no value to
    read: the gradient is taken as finite."""
    if x.numel() == 0:
        return True
    flag = torch.isfinite(torch.linalg.vector_norm(x, float("inf")))
    return True if is_fake(flag) else bool(flag)


def _check_input(x: torch.Tensor, name: str = "x", finite: bool = True) -> None:
    """Type, dtype and emptiness; ``finite``: no NaN/Inf either (the host reads a flag: it waits for the device)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in ref.SUPPORTED_DTYPES:
        raise ValueError(f"{name}.dtype={x.dtype} is not supported; allowed: {ref.SUPPORTED_DTYPES}")
    if x.numel() == 0:
        raise ValueError(f"{name} is empty (shape {tuple(x.shape)}); nothing to quantize")
    if not finite:
        return
    if not all_finite(x):
        n_nan, n_inf = int(torch.isnan(x).sum()), int(torch.isinf(x).sum())
        raise ValueError(f"{name} holds {n_nan} NaN and {n_inf} Inf values; block scales would be "
                         "meaningless (amax = inf/nan). Fix the producer (e.g. a diverged loss) before quantizing")


def _check_block(block: int, bits: int | None = None) -> None:
    if not isinstance(block, int) or isinstance(block, bool) or block < 1:
        raise ValueError(f"block must be a positive int, got {block!r}")
    if bits == 4 and block % 2:
        raise ValueError(f"block={block} must be even for bits=4 (two 4-bit codes per byte)")


def quantize_blockwise(x: torch.Tensor, bits: int = 8, block: int = 128, stochastic: bool = False,
                       seed: int | None = None, impl: str = "auto", check_finite: bool = True) -> Quantized:
    """Symmetric block-wise integer quantization of ``x`` (see the module docstring).

    Args:
        bits: 8 (int8 codes in [-127, 127]) or 4 (int4 codes in [-7, 7], packed two per byte).
        block: consecutive elements of the flattened tensor sharing one scale (the tail is zero-padded).
        stochastic: round x/s up with probability frac(x/s) (unbiased: E[q*s] = x); seeded.
        seed: seed of the stochastic rounding; None draws one from torch's global generator.
        impl: "auto", "torch" or "triton".
        check_finite: refuse NaN/Inf (a host sync); False skips it (``quantize_fp8_blockwise``).
    Raises:
        ValueError: NaN/Inf in ``x`` (when checked), unsupported dtype, bits not in {4, 8}, bad block.
    """
    if bits not in FORMATS:
        raise ValueError(f"bits={bits!r} is not supported; allowed: {sorted(FORMATS)}")
    _check_block(block, bits)
    _check_input(x, finite=check_finite)
    if stochastic and seed is None:
        seed = int(torch.randint(0, 2**31 - 1, (1,)).item())
    seed = int(seed or 0)
    if _use_triton(x, impl, block):
        from kernels import quant_triton as qt
        payload, scales = qt.quantize_int(x, bits, block, stochastic, seed)
    else:
        with _one_kernel("quantize_int") as kernel:
            codes, scales = ref.quantize_int(x.cpu() if x.is_cuda else x, bits, block, stochastic, seed)
            payload = ref.pack_int4(codes) if bits == 4 else codes
            payload, scales = payload.to(x.device), scales.to(x.device)
            kernel([x], [payload, scales])
    return Quantized(payload, scales, bits, block, torch.Size(x.shape), FORMATS[bits])


def quantize_fp8_blockwise(x: torch.Tensor, block: int = 128, impl: str = "auto",
                           check_finite: bool = True) -> Quantized:
    """Block-wise FP8-E4M3FN: s = amax/448, x/s rounded to the nearest E4M3 value (ties to even).

    The payload is the uint8 view of the float8 codes (gloo cannot send float8 tensors). ``check_finite=False``
    skips the NaN/Inf check, a host sync (where nothing may wait for the device, e.g. a path captured in a CUDA
    graph): a block holding NaN/Inf then decodes to NaN.
    """
    _check_block(block)
    _check_input(x, finite=check_finite)
    if _use_triton(x, impl, block):
        from kernels import quant_triton as qt
        payload, scales = qt.quantize_fp8(x, block)
    else:
        with _one_kernel("quantize_fp8") as kernel:
            payload, scales = ref.quantize_fp8(x.cpu() if x.is_cuda else x, block)
            payload, scales = payload.to(x.device), scales.to(x.device)
            kernel([x], [payload, scales])
    return Quantized(payload, scales, 8, block, torch.Size(x.shape), "fp8_e4m3")


def dequantize_blockwise(q: Quantized, dtype: torch.dtype = torch.float32, impl: str = "auto") -> torch.Tensor:
    """``Quantized`` -> tensor of ``q.shape`` and ``dtype`` (codes times their block scale, in float32)."""
    if q.fmt not in ("int8", "int4", "fp8_e4m3"):
        raise ValueError(f"Quantized.fmt={q.fmt!r} is not known; allowed: 'int8', 'int4', 'fp8_e4m3'")
    n_padded = q.scales.numel() * q.block
    expected = n_padded // 2 if q.fmt == "int4" else n_padded
    if q.payload.numel() != expected:
        raise ValueError(f"payload has {q.payload.numel()} elements; {q.fmt} with {q.scales.numel()} blocks of "
                         f"{q.block} needs {expected}")
    if _use_triton(q.payload, impl, q.block):
        from kernels import quant_triton as qt
        flat = qt.dequantize(q.payload, q.scales, q.block, q.fmt)
    else:
        with _one_kernel("dequantize") as kernel:
            if q.fmt == "int4":
                codes = ref.unpack_int4(q.payload)
            elif q.fmt == "fp8_e4m3":
                codes = q.payload.view(torch.float8_e4m3fn)
            else:
                codes = q.payload
            flat = ref.dequantize(codes, q.scales, q.block)
            kernel([q.payload, q.scales], [flat])
    return flat[:q.numel].view(q.shape).to(dtype)


def hadamard32(x: torch.Tensor, inverse: bool = False, impl: str = "auto") -> torch.Tensor:
    """Unnormalized Sylvester H32 on each run of 32 consecutive elements of the flattened ``x``.

    ``inverse=True`` applies H/32, so ``hadamard32(hadamard32(x), inverse=True) == x`` (up to rounding).
    Spreading an outlier over 32 elements shrinks amax/RMS of the block before quantization.
    """
    _check_input(x)
    if x.numel() % 32:
        raise ValueError(f"hadamard32 needs numel % 32 == 0, got numel={x.numel()} (shape {tuple(x.shape)})")
    if _use_triton(x, impl):
        from kernels import quant_triton as qt
        return qt.hadamard32(x, inverse)
    with _one_kernel("hadamard32") as kernel:
        out = ref.hadamard32(x, inverse)
        kernel([x], [out], flops=5 * x.numel())  # five butterfly stages, an add or a subtract per element each
    return out


def fake_quantize(x: torch.Tensor, fmt: str, block: int = 128, impl: str = "auto") -> torch.Tensor:
    """quantize -> dequantize in one call (same dtype and shape as ``x``); fmt in {"int8","int4","fp8_e4m3"}."""
    if fmt == "fp8_e4m3":
        q = quantize_fp8_blockwise(x, block, impl=impl)
    elif fmt in ("int8", "int4"):
        q = quantize_blockwise(x, bits=8 if fmt == "int8" else 4, block=block, impl=impl)
    else:
        raise ValueError(f"fmt={fmt!r} is not allowed; allowed: 'int8', 'int4', 'fp8_e4m3'")
    return dequantize_blockwise(q, dtype=x.dtype, impl=impl)


def qsnr_db(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    """Quantization signal-to-noise ratio 10*log10(||x||^2 / ||x - x_hat||^2) in dB (inf when exact)."""
    x, x_hat = x.detach().double().reshape(-1), x_hat.detach().double().reshape(-1)
    if x.shape != x_hat.shape:
        raise ValueError(f"x and x_hat differ in size: {x.numel()} vs {x_hat.numel()}")
    noise = float((x - x_hat).pow(2).sum())
    signal = float(x.pow(2).sum())
    if noise == 0.0:
        return math.inf
    return 10.0 * math.log10(signal / noise) if signal > 0 else -math.inf


# ---- fake-quantized GEMMs: blocks along the reduction dimension (lesson 09) ---------------------------------
#
#   forward   Y  = X  W^T     reduce over K:  X [M,K] rows, W [N,K] rows      blocked along K
#   backward  dX = dY W       reduce over N:  dY [M,N] rows, W^T [K,N] rows   blocked along N
#             dW = dY^T X     reduce over M:  dY^T [N,M] rows, X^T [K,M] rows blocked along M
#
# so every block scale factors out of a partial dot product, as in a real block-scaled GEMM kernel.
GEMM_FORMATS = ("none", "bf16", "int8", "int4", "fp8_e4m3")


def fake_quantize_rows(x: torch.Tensor, fmt: str, block: int = 128) -> torch.Tensor:
    """Fake-quantize a 2-D tensor with blocks of ``block`` elements along its last dimension.

    Rows are zero-padded to a multiple of ``block`` so no block straddles two rows; ``block=0``
    means one scale for the whole tensor (per-tensor). "bf16" rounds to bfloat16, "none" is the identity.
    The same float32 operations as quantize -> dequantize (bitwise equal, tested), without building the
    payload: this runs inside every GEMM of a training step.
    """
    if fmt not in GEMM_FORMATS:
        raise ValueError(f"fmt={fmt!r} is not allowed; allowed: {GEMM_FORMATS}")
    if fmt == "none":
        return x
    if fmt == "bf16":
        return x.to(torch.bfloat16).to(x.dtype)
    rows, k = x.shape
    xf = x.float()
    if block == 0:
        xb = xf.reshape(1, 1, -1)  # one block: the whole tensor
    else:
        pad = (-k) % block
        xb = (torch.nn.functional.pad(xf, (0, pad)) if pad else xf).view(rows, -1, block)  # [rows, nb, block]
    qmax = ref.FP8_MAX if fmt == "fp8_e4m3" else float(ref.qmax_of(8 if fmt == "int8" else 4))
    scale = xb.abs().amax(-1, keepdim=True) / qmax  # [rows, nb, 1]
    y = xb / torch.where(scale > 0, scale, 1.0)
    if fmt == "fp8_e4m3":
        y = y.clamp(-qmax, qmax).to(torch.float8_e4m3fn).float()
    else:
        y = torch.round(y).clamp(-qmax, qmax)
    out = (y * scale).view(rows, -1) if block else (y * scale).view(rows, k)
    return out[:, :k].to(x.dtype)


class _FakeQuantLinear(torch.autograd.Function):
    """y = Q(x) Q(w)^T + b; the backward GEMMs quantize their own operands (straight-through estimator)."""

    @staticmethod
    def forward(ctx, x, weight, bias, fmt, block):  # x [M,K], weight [N,K]
        ctx.save_for_backward(x, weight)
        ctx.fmt, ctx.block, ctx.has_bias = fmt, block, bias is not None
        y = fake_quantize_rows(x, fmt, block) @ fake_quantize_rows(weight, fmt, block).t()  # [M,N]
        return y + bias if bias is not None else y

    @staticmethod
    def backward(ctx, dy):  # dy [M,N]
        x, weight = ctx.saved_tensors
        fq = lambda t: fake_quantize_rows(t.contiguous(), ctx.fmt, ctx.block)
        dx = fq(dy) @ fq(weight.t()).t()  # [M,N] @ [N,K] -> [M,K], blocks along N
        dw = fq(dy.t()) @ fq(x.t()).t()  # [N,M] @ [M,K] -> [N,K], blocks along M
        db = dy.sum(0) if ctx.has_bias else None
        return dx, dw, db, None, None


def fake_quant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, fmt: str,
                      block: int = 128) -> torch.Tensor:
    """``F.linear`` whose three GEMMs (forward, dgrad, wgrad) see block-quantized operands. x [..., K]."""
    lead = x.shape[:-1]
    y = _FakeQuantLinear.apply(x.reshape(-1, x.shape[-1]), weight, bias, fmt, block)
    return y.reshape(*lead, weight.shape[0])


class FakeQuantLinear(torch.nn.Module):
    """Wraps an ``nn.Linear`` (sharing its parameters) so its GEMMs run through :func:`fake_quant_linear`."""

    def __init__(self, linear: torch.nn.Linear, fmt: str, block: int = 128):
        super().__init__()
        if fmt not in GEMM_FORMATS:
            raise ValueError(f"fmt={fmt!r} is not allowed; allowed: {GEMM_FORMATS}")
        self.linear, self.fmt, self.block = linear, fmt, block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fake_quant_linear(x, self.linear.weight, self.linear.bias, self.fmt, self.block)


def quantize_gemms(model: torch.nn.Module, fmt: str, block: int = 128, skip: tuple[str, ...] = ("head",)) -> int:
    """Replace, in place, every ``nn.Linear`` of ``model`` whose qualified name does not start with one of
    ``skip`` by a :class:`FakeQuantLinear`. Returns how many were replaced."""
    targets = [(name, m) for name, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and not name.startswith(skip)]
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, FakeQuantLinear(linear, fmt, block))
    return len(targets)


__all__ = ["Quantized", "all_finite", "quantize_blockwise", "quantize_fp8_blockwise", "dequantize_blockwise", "hadamard32",
           "fake_quantize", "set_impl", "get_impl", "qsnr_db", "fake_quantize_rows", "fake_quant_linear",
           "FakeQuantLinear", "quantize_gemms", "GEMM_FORMATS"]
