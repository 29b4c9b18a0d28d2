"""bf16 as storage: on a CPU whose bf16 GEMMs are slow, compute them in fp32 and round once, as a GPU does.

A GPU's bf16 GEMM reads bf16 operands, accumulates in fp32 and rounds the result to bf16 once. torch on a
CPU without bf16 instructions has no fast kernel for it (a scalar loop, ~50-75x slower than fp32; see
``toolkit.runtime.machine``). Where a lesson's point is what bf16 *storage* saves (bytes, masters, ties),
not bf16 arithmetic, ``bf16_as_storage()`` computes those GEMMs the GPU's way on the fast fp32 kernels::

    bf16 x, W ──► x.float() @ W.float().T ──► fp32 accumulator ──► .to(bf16)   (one round-to-nearest-even)
                      transient fp32 copies        saved for backward: x, W as they are (bf16)

    backward: dX = (dY·W) and dW = (dYᵀ·X) the same way, in fp32 from the bf16 tensors, each rounded once

Covered: ``F.linear`` (every ``nn.Linear``), ``matmul`` / ``mm`` / ``bmm`` / ``@`` and
``F.scaled_dot_product_attention`` (no mask, no dropout: its backward recomputes the fp32 attention from
q, k, v, as flash attention does, so only q, k, v are kept). Everything else (LayerNorm, GELU, sums) runs as it is:
torch's bf16 element-wise kernels are vectorized on any x86 CPU. Tensors that are not all bf16 on the CPU
pass through untouched, so the mode is a no-op on GPUs and for fp32 code.

Which path runs is ``compute()``: ``TOOLKIT_BF16_COMPUTE`` = ``auto`` (default: fp32 where
``machine.fingerprint()["bf16_gemm"]`` is ``"slow"``), ``fp32`` or ``bf16`` (force either). Every replica of
a comparison runs under the same mode, so bit-exact checks between them still compare like with like.
"""
from __future__ import annotations

import contextlib
import math
import os
from typing import Optional

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import register_flop_formula, sdpa_backward_flop_count, sdpa_flop_count

from .machine import fingerprint

ENV = "TOOLKIT_BF16_COMPUTE"
CHOICES = ("auto", "fp32", "bf16")


def compute() -> str:
    """``"fp32"`` (GEMMs on bf16 CPU tensors compute in fp32, rounded to bf16) or ``"bf16"`` (torch's own)."""
    choice = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if choice not in CHOICES:
        raise ValueError(f"{ENV}={os.environ[ENV]!r} is not known; allowed: {', '.join(CHOICES)}")
    if choice == "auto":
        return "fp32" if fingerprint()["bf16_gemm"] == "slow" else "bf16"
    return choice


def _bf16_cpu(*tensors) -> bool:
    return all(isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 and t.device.type == "cpu"
               for t in tensors)


# ---- the GEMMs, each one custom op: what tensor observers (MemoryTracker, the emulator's timer) see is what a
# GPU's bf16 GEMM shows them (bf16 in, bf16 out, its FLOPs); the fp32 copies inside are its registers ----------
@torch.library.custom_op("toolkit::bf16_linear", mutates_args=())
def _linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)


@torch.library.custom_op("toolkit::bf16_matmul", mutates_args=())
def _matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.float() @ b.float()).to(a.dtype)


@torch.library.custom_op("toolkit::bf16_matmul_backward", mutates_args=())
def _matmul_backward_op(grad: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dA, dB) of a broadcasting matmul, summed over the broadcast dimensions in fp32, then rounded once."""
    g, a32, b32 = grad.float(), a.float(), b.float()
    return ((g @ b32.mT).sum_to_size(a.shape).to(a.dtype), (a32.mT @ g).sum_to_size(b.shape).to(b.dtype))


@torch.library.custom_op("toolkit::bf16_attention", mutates_args=())
def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
               scale: Optional[float]) -> torch.Tensor:
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=is_causal,
                                          scale=scale).to(q.dtype)


@torch.library.custom_op("toolkit::bf16_attention_backward", mutates_args=())
def _attention_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                        scale: Optional[float]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Recomputes the attention in fp32 from the bf16 q, k, v (flash attention's way), then its gradients."""
    q32, k32, v32, g = q.float(), k.float(), v.float(), grad.float()  # [..., L, E], [..., S, E], [..., S, Ev]
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    scores = (q32 @ k32.mT) * scale  # [..., L, S]
    if is_causal:  # torch's causal mask: query i sees keys 0..i
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    p = scores.softmax(-1)
    dp = g @ v32.mT
    ds = p * (dp - (dp * p).sum(-1, keepdim=True))  # the softmax's backward
    return ((ds @ k32) * scale).to(q.dtype), ((ds.mT @ q32) * scale).to(k.dtype), (p.mT @ g).to(v.dtype)


@_linear.register_fake
def _(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@_matmul.register_fake
def _(a, b):
    return a.new_empty(torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1]))


@_matmul_backward_op.register_fake
def _(grad, a, b):
    return torch.empty_like(a), torch.empty_like(b)


@_attention.register_fake
def _(q, k, v, is_causal, scale):
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


@_attention_backward.register_fake
def _(grad, q, k, v, is_causal, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _linear_setup(ctx, inputs, output):
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight)  # bf16, as torch's own linear keeps them
    ctx.bias = bias is not None


def _linear_backward(ctx, grad):
    x, weight = ctx.saved_tensors
    g2 = grad.reshape(-1, grad.shape[-1])  # [N, out]
    dx = _matmul(grad, weight) if ctx.needs_input_grad[0] else None
    dw = _matmul(g2.t(), x.reshape(-1, x.shape[-1])) if ctx.needs_input_grad[1] else None
    db = g2.sum(0) if ctx.bias and ctx.needs_input_grad[2] else None  # torch's bf16 sum accumulates in fp32
    return dx, dw, db


def _matmul_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _matmul_backward(ctx, grad):
    return _matmul_backward_op(grad, *ctx.saved_tensors)


def _attention_setup(ctx, inputs, output):
    q, k, v, ctx.is_causal, ctx.scale = inputs
    ctx.save_for_backward(q, k, v)  # no output or statistics: the backward recomputes them


def _attention_grad(ctx, grad):
    return (*_attention_backward(grad, *ctx.saved_tensors, ctx.is_causal, ctx.scale), None, None)


_linear.register_autograd(_linear_backward, setup_context=_linear_setup)
_matmul.register_autograd(_matmul_backward, setup_context=_matmul_setup)
_attention.register_autograd(_attention_grad, setup_context=_attention_setup)


@register_flop_formula(torch.ops.toolkit.bf16_linear)
def _linear_flops(x_shape, w_shape, bias_shape, out_shape=None, **kwargs) -> int:
    return 2 * math.prod(x_shape) * w_shape[0]


@register_flop_formula(torch.ops.toolkit.bf16_matmul)
def _matmul_flops(a_shape, b_shape, out_shape=None, **kwargs) -> int:
    return 2 * math.prod(out_shape) * a_shape[-1]


@register_flop_formula(torch.ops.toolkit.bf16_matmul_backward)
def _matmul_backward_flops(grad_shape, a_shape, b_shape, out_shape=None, **kwargs) -> int:
    return 2 * 2 * math.prod(grad_shape) * a_shape[-1]  # two GEMMs the size of the forward one


@register_flop_formula(torch.ops.toolkit.bf16_attention)
def _attention_flops(q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(q_shape, k_shape, v_shape)


@register_flop_formula(torch.ops.toolkit.bf16_attention_backward)
def _attention_backward_flops(grad_shape, q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_shape, q_shape, k_shape, v_shape)


_MATMULS = {torch.matmul, torch.mm, torch.bmm, torch.Tensor.matmul, torch.Tensor.mm, torch.Tensor.bmm,
            torch.Tensor.__matmul__}


def _bind(args: tuple, kwargs: dict, names: tuple[str, ...]) -> list:
    """Positional and keyword arguments by parameter name (None where not given)."""
    return [args[i] if i < len(args) else kwargs.get(name) for i, name in enumerate(names)]


class Fp32Compute(TorchFunctionMode):
    """While active, GEMMs whose operands are all bf16 CPU tensors compute in fp32 and round once (module doc)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight, bias = _bind(args, kwargs, ("input", "weight", "bias"))
            if _bf16_cpu(x, weight) and (bias is None or _bf16_cpu(bias)):
                return _linear(x, weight, bias)
        elif func in _MATMULS and len(args) == 2 and not kwargs:
            if _bf16_cpu(*args) and args[0].dim() >= 2 and args[1].dim() >= 2:
                return _matmul(*args)
        elif func is F.scaled_dot_product_attention:
            q, k, v, mask, dropout, causal, scale, gqa = _bind(args, kwargs, (
                "query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"))
            if mask is None and not dropout and not gqa and _bf16_cpu(q, k, v):
                return _attention(q, k, v, bool(causal), scale)
        return func(*args, **kwargs)


def explain(path: str) -> str:
    """One sentence for a lesson: how its bf16 GEMMs computed on this machine (``path``: a rank's ``compute()``)."""
    fp = fingerprint()
    if path == "fp32":
        return (f"The bf16 GEMMs computed in fp32 from the bf16 tensors, each result rounded to bf16 once, as a "
                f"GPU's bf16 GEMM does: this CPU's own bf16 GEMMs are slow ({fp['bf16_gemm_why']}). Weights, "
                f"gradients and the activations kept for backward stay bf16.")
    return f"The bf16 GEMMs ran on torch's bf16 kernels (this CPU has {fp['bf16_gemm_why']})."


def bf16_as_storage(enabled: bool | None = None) -> contextlib.AbstractContextManager:
    """The context under which a bf16 model's GEMMs run: ``Fp32Compute()`` where ``compute()`` says ``"fp32"``
    (or ``enabled=True``), nothing otherwise. Forward and backward must both run inside it."""
    if enabled is None:
        enabled = compute() == "fp32"
    return Fp32Compute() if enabled else contextlib.nullcontext()


__all__ = ["bf16_as_storage", "compute", "explain", "Fp32Compute", "ENV", "CHOICES"]
