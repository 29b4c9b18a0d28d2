"""A tiny pre-norm GPT (and its MoE variant) whose parts lessons can schedule, shard or offload.

::

    idx [B,T] ─► Embedding (token + position) ─► Block x n_layer ─► LayerNorm ─► Head ─► logits [B,T,V]

    Block (pre-norm):                                  attention is three modules, so a lesson can
      x = x + attn.proj( attn.core( attn.qkv( ln1(x) )))   place, offload or recompute each on its own
      x = x + mlp.fc2( mlp.act( mlp.fc1( ln2(x) )))        (MoE: router + experts instead of fc1/fc2)

``split_stages(model, n)`` cuts it into pipeline stages that share the model's
parameters: stage 0 starts with the embedding, the last stage ends with the head.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    """Shape of the tiny GPT. Every field has a small default that runs in seconds on a CPU."""

    vocab_size: int = 256
    """Tokens in the vocabulary (256 = the byte tokenizer of ``toolkit.data``)."""
    seq_len: int = 64
    """Maximum sequence length (size of the learned position table)."""
    n_layer: int = 2
    """Transformer blocks."""
    n_head: int = 2
    """Attention heads; must divide ``d_model``."""
    d_model: int = 64
    """Hidden size."""
    d_ff: int = 0
    """MLP inner size; 0 means 4 * d_model."""
    n_expert: int = 0
    """Experts per MoE layer; 0 means a dense MLP."""
    top_k: int = 2
    """Experts each token is routed to (MoE only)."""
    init_std: float = 0.02
    """Standard deviation of the normal weight init."""

    def __post_init__(self):
        if self.d_ff == 0:
            self.d_ff = 4 * self.d_model
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model", "d_ff"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.n_head:
            raise ValueError(f"d_model={self.d_model} must be divisible by n_head={self.n_head}")
        if self.n_expert and not 1 <= self.top_k <= self.n_expert:
            raise ValueError(f"top_k={self.top_k} must be in 1..n_expert={self.n_expert}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head


PRESETS: dict[str, GPTConfig] = {
    "smoke": GPTConfig(seq_len=32, n_layer=2, n_head=2, d_model=32),
    "default": GPTConfig(seq_len=128, n_layer=4, n_head=4, d_model=128),
    "full": GPTConfig(seq_len=1024, n_layer=12, n_head=12, d_model=768),
}


def preset(name: str, **overrides) -> GPTConfig:
    """The named model size (``smoke``, ``default`` or ``full``), with fields overridden."""
    if name not in PRESETS:
        raise ValueError(f"preset={name!r} is not known; allowed: {sorted(PRESETS)}")
    return replace(PRESETS[name], **overrides)


class Embedding(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)

    def forward(self, idx: torch.Tensor, pos_offset: int = 0) -> torch.Tensor:  # [B,T] -> [B,T,D]
        pos = torch.arange(pos_offset, pos_offset + idx.shape[1], device=idx.device)
        return self.tok(idx) + self.pos(pos)


class CoreAttention(nn.Module):
    """Causal softmax(QK^T/sqrt(d))V on a packed qkv tensor; no parameters."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head

    def forward(self, qkv: torch.Tensor) -> torch.Tensor:  # [B,T,3D] -> [B,T,D]
        B, T, three_d = qkv.shape
        q, k, v = qkv.view(B, T, 3, self.n_head, three_d // (3 * self.n_head)).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B,H,T,hd]
        return y.transpose(1, 2).reshape(B, T, three_d // 3)


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.core = CoreAttention(cfg)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.core(self.qkv(x)))


class MLP(nn.Module):
    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.fc1 = nn.Linear(d_model, d_ff)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(d_ff, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Router(nn.Module):
    """Top-k softmax gate: returns (weights [N,K] summing to 1, expert ids [N,K])."""

    def __init__(self, d_model: int, n_expert: int, top_k: int):
        super().__init__()
        self.gate = nn.Linear(d_model, n_expert, bias=False)
        self.top_k = top_k

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # x [N,D]
        probs = self.gate(x).softmax(dim=-1)
        weights, ids = probs.topk(self.top_k, dim=-1)
        return weights / weights.sum(-1, keepdim=True), ids


class MoE(nn.Module):
    """Router + experts, computed locally (expert-parallel lessons replace the dispatch)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.router = Router(cfg.d_model, cfg.n_expert, cfg.top_k)
        self.experts = nn.ModuleList(MLP(cfg.d_model, cfg.d_ff) for _ in range(cfg.n_expert))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B,T,D]
        flat = x.reshape(-1, x.shape[-1])
        weights, ids = self.router(flat)  # [N,K]
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token, slot = (ids == e).nonzero(as_tuple=True)
            if token.numel():
                out.index_add_(0, token, expert(flat[token]) * weights[token, slot, None])
        return out.view_as(x)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MoE(cfg) if cfg.n_expert else MLP(cfg.d_model, cfg.d_ff)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.out = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B,T,D] -> [B,T,V]
        return self.out(self.ln_f(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = Embedding(cfg)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.head = Head(cfg)
        self.apply(lambda m: _init(m, cfg.init_std))
        for block in self.blocks:  # GPT-2 scaling of residual projections
            for lin in (block.attn.proj, *([block.mlp.fc2] if not cfg.n_expert else
                                          [e.fc2 for e in block.mlp.experts])):
                nn.init.normal_(lin.weight, std=cfg.init_std / math.sqrt(2 * cfg.n_layer))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        return logits if targets is None else lm_loss(logits, targets)


def _init(module: nn.Module, std: float) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=std)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over all positions."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


class Stage(nn.Module):
    """A contiguous slice of the GPT: optional embedding, some blocks, optional head."""

    def __init__(self, embed: Embedding | None, blocks: list[Block], head: Head | None):
        super().__init__()
        self.embed, self.blocks, self.head = embed, nn.ModuleList(blocks), head

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # idx [B,T] or hidden [B,T,D] -> hidden or logits
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x) if self.head is not None else x


def split_stages(model: GPT, n_stages: int) -> list[Stage]:
    """Cut ``model`` into ``n_stages`` stages of equal block count (sharing its parameters)."""
    n_layer = len(model.blocks)
    if n_stages < 1 or n_layer % n_stages:
        raise ValueError(f"n_stages={n_stages} must be >= 1 and divide n_layer={n_layer}")
    per = n_layer // n_stages
    return [Stage(model.embed if s == 0 else None, list(model.blocks[s * per:(s + 1) * per]),
                  model.head if s == n_stages - 1 else None) for s in range(n_stages)]


def count_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
