"""Megatron-style tensor parallelism: one layer's matrices split across the ranks of a tp group.

The MLP ``fc2(act(fc1(x)))`` split over tp ranks (Shoeybi et al. 2019, Megatron-LM, Fig. 3)::

                      fc1: ColumnParallel              fc2: RowParallel
                      W1 split by output rows          W2 split by input columns
    x [B,T,D] ─► f ─┬─► x·W1_0ᵀ [B,T,F/tp] ─► act ─► ·W2_0ᵀ ─┐ partial [B,T,D]
                    └─► x·W1_1ᵀ [B,T,F/tp] ─► act ─► ·W2_1ᵀ ─┴─► g ─► + b2 ─► y [B,T,D]

    f: forward identity,   backward all-reduce (every rank's x fed its own slice of W1: sum their dx)
    g: forward all-reduce, backward identity   (sum the partial products; dy is already whole)

Attention is split the same way by heads: ``qkv`` is column-parallel (rank r keeps the q, k and v
rows of heads [r·H/tp, (r+1)·H/tp) and runs attention on those heads alone), ``proj`` is row-parallel.
Per block and per pass, two all-reduces of B·T·D activations cross the tp group: g after attention and
g after the MLP in forward, f before each of them in backward. LayerNorms stay replicated; their
gradients come out equal on every rank because f has already summed dx before they see it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


def check_tp(tp: int, **sizes: int) -> None:
    """Raise ValueError naming the first of ``sizes`` (e.g. ``n_head=4, d_ff=256``) that ``tp`` does not divide."""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"tp must be a positive int, got {tp!r}")
    for name, value in sizes.items():
        if value % tp:
            raise ValueError(f"{name}={value} is not divisible by tp={tp}; {name} must be a multiple of tp")


class _CopyToTP(torch.autograd.Function):
    """f: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        x = x.contiguous()
        dist.all_reduce(x, group=group)  # in place: the partial product is used by nobody else (as Megatron)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def _tp(group) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


class ColumnParallelLinear(nn.Module):
    """y_r = f(x) · W[rows_r]ᵀ + b[rows_r]: each rank computes its slice of the output features."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group):
        super().__init__()
        self.group = group
        self.weight = nn.Parameter(weight.detach().clone())  # [out/tp, in]
        self.bias = nn.Parameter(bias.detach().clone()) if bias is not None else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, group, rows: torch.Tensor | None = None) -> "ColumnParallelLinear":
        """Keep this rank's output rows of ``linear`` (default: the r-th contiguous 1/tp of them)."""
        tp, r = _tp(group)
        if rows is None:
            check_tp(tp, out_features=linear.out_features)
            per = linear.out_features // tp
            rows = torch.arange(r * per, (r + 1) * per)
        bias = linear.bias[rows] if linear.bias is not None else None
        return cls(linear.weight[rows], bias, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B,T,in] -> [B,T,out/tp]
        return F.linear(_CopyToTP.apply(x, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = g(x_r · W[:, cols_r]ᵀ) + b: each rank multiplies its slice of the input features, g sums."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group):
        super().__init__()
        self.group = group
        self.weight = nn.Parameter(weight.detach().clone())  # [out, in/tp]
        self.bias = nn.Parameter(bias.detach().clone()) if bias is not None else None  # [out], replicated

    @classmethod
    def from_linear(cls, linear: nn.Linear, group) -> "RowParallelLinear":
        """Keep this rank's contiguous 1/tp of ``linear``'s input columns."""
        tp, r = _tp(group)
        check_tp(tp, in_features=linear.in_features)
        per = linear.in_features // tp
        return cls(linear.weight[:, r * per:(r + 1) * per], linear.bias, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B,T,in/tp] -> [B,T,out]
        y = _ReduceFromTP.apply(F.linear(x, self.weight), self.group)
        return y + self.bias if self.bias is not None else y


def qkv_rows(d_model: int, n_head: int, tp: int, rank: int) -> torch.Tensor:
    """Rows of a packed [3·D, D] qkv weight that hold the q, k and v of rank ``rank``'s heads.

    The packed output is laid out (3, H, head_dim); rank r keeps heads [r·H/tp, (r+1)·H/tp) of each.
    """
    check_tp(tp, n_head=n_head)
    hd, local = d_model // n_head, n_head // tp
    heads = torch.arange(rank * local, (rank + 1) * local)
    return torch.cat([s * d_model + h * hd + torch.arange(hd) for s in range(3) for h in heads])


def tensor_parallel_mlp(mlp: nn.Module, group) -> nn.Module:
    """Shard ``mlp.fc1`` by columns and ``mlp.fc2`` by rows, in place (weights taken from the full layers)."""
    tp, _ = _tp(group)
    check_tp(tp, d_ff=mlp.fc1.out_features)
    mlp.fc1 = ColumnParallelLinear.from_linear(mlp.fc1, group)
    mlp.fc2 = RowParallelLinear.from_linear(mlp.fc2, group)
    return mlp


def tensor_parallel_attention(attn: nn.Module, group) -> nn.Module:
    """Shard ``attn.qkv`` by heads (column-parallel) and ``attn.proj`` by rows, in place."""
    tp, r = _tp(group)
    n_head, d_model = attn.core.n_head, attn.proj.in_features
    check_tp(tp, n_head=n_head)
    attn.qkv = ColumnParallelLinear.from_linear(attn.qkv, group, rows=qkv_rows(d_model, n_head, tp, r))
    attn.core.n_head = n_head // tp  # core attention runs on my heads only
    attn.proj = RowParallelLinear.from_linear(attn.proj, group)
    return attn


def tensor_parallel_block(block: nn.Module, group) -> nn.Module:
    """Both halves of a transformer block (attention and MLP), in place."""
    tensor_parallel_attention(block.attn, group)
    tensor_parallel_mlp(block.mlp, group)
    return block
