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
import os

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

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


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.bias = bias is not None
        return F.linear(x.float(), weight.float(), bias.float() if bias is not None else None).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g = grad.float()
        g2 = g.reshape(-1, g.shape[-1])  # [N, out]
        dx = (g @ weight.float()).to(x.dtype) if ctx.needs_input_grad[0] else None
        dw = (g2.t() @ x.reshape(-1, x.shape[-1]).float()).to(weight.dtype) if ctx.needs_input_grad[1] else None
        db = g2.sum(0).to(weight.dtype) if ctx.bias and ctx.needs_input_grad[2] else None
        return dx, dw, db


class _MatMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return (a.float() @ b.float()).to(a.dtype)

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        g = grad.float()
        da = (g @ b.float().mT).sum_to_size(a.shape).to(a.dtype) if ctx.needs_input_grad[0] else None
        db = (a.float().mT @ g).sum_to_size(b.shape).to(b.dtype) if ctx.needs_input_grad[1] else None
        return da, db


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, is_causal, scale):
        ctx.save_for_backward(q, k, v)
        ctx.is_causal, ctx.scale = is_causal, scale
        return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=is_causal,
                                              scale=scale).to(q.dtype)

    @staticmethod
    def backward(ctx, grad):
        # recompute the attention in fp32 from the bf16 q, k, v (flash attention's way), then its gradients
        q, k, v = (t.float() for t in ctx.saved_tensors)  # [..., L, E], [..., S, E], [..., S, Ev]
        scale = ctx.scale if ctx.scale is not None else q.shape[-1] ** -0.5
        scores = (q @ k.mT) * scale  # [..., L, S]
        if ctx.is_causal:  # torch's causal mask: query i sees keys 0..i
            scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
        p = scores.softmax(-1)
        g = grad.float()
        dp = g @ v.mT
        ds = p * (dp - (dp * p).sum(-1, keepdim=True))  # the softmax's backward
        dq, dk, dv = (ds @ k) * scale, (ds.mT @ q) * scale, p.mT @ g
        return dq.to(torch.bfloat16), dk.to(torch.bfloat16), dv.to(torch.bfloat16), None, None


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
                return _Linear.apply(x, weight, bias)
        elif func in _MATMULS and len(args) == 2 and not kwargs:
            if _bf16_cpu(*args) and args[0].dim() >= 2 and args[1].dim() >= 2:
                return _MatMul.apply(*args)
        elif func is F.scaled_dot_product_attention:
            q, k, v, mask, dropout, causal, scale, gqa = _bind(args, kwargs, (
                "query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"))
            if mask is None and not dropout and not gqa and _bf16_cpu(q, k, v):
                return _Attention.apply(q, k, v, bool(causal), scale)
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
