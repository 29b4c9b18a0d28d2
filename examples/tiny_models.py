"""Two small models that are not the toolkit's GPT, written the plain PyTorch way (the examples use them).

    mlp(d, n_layers)            nn.Sequential of residual MLP blocks: [B, d] -> [B, d]
    TinyTransformer(...)        embedding, pre-norm blocks (nn.MultiheadAttention + MLP), head: [B, T] -> [B, T, V]
"""
from __future__ import annotations

import torch
import torch.nn as nn


class ResidualMLP(nn.Module):
    """x + W2 gelu(W1 norm(x)): [B, d] -> [B, d]."""

    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


def mlp(d: int = 64, n_layers: int = 8, hidden: int = 128, seed: int = 0) -> nn.Sequential:
    """The same weights on every rank for the same ``seed``."""
    torch.manual_seed(seed)
    return nn.Sequential(*[ResidualMLP(d, hidden) for _ in range(n_layers)])


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, d]
        T = x.shape[1]
        causal = torch.triu(torch.ones(T, T, dtype=torch.bool, device=x.device), 1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=causal, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyTransformer(nn.Module):
    """A causal language model: tokens [B, T] -> logits [B, T, vocab]."""

    def __init__(self, vocab: int = 256, d: int = 64, heads: int = 4, n_layers: int = 2, seq_len: int = 32,
                 seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq_len, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(n_layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))
