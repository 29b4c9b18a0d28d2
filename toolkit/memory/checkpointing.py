"""Activation checkpointing at the granularity you choose, and an exact count of what it saves.

::

    policy        what is wrapped in checkpoint()          kept for backward           recomputed in backward
    none          nothing                                   every saved activation      nothing
    core_attn     attn.core of every block                  all but softmax/attn probs  QK^T, softmax, PV
    attn          attn (qkv -> core -> proj)                block input of attn         the whole attention
    mlp           mlp (fc1 -> act -> fc2)                   block input of mlp          the MLP
    block         the whole block                           block inputs only           the whole block

``toolkit.runtime.memory.saved_activation_bytes`` counts, with ``saved_tensors_hooks``, every tensor autograd
keeps for backward during a forward pass: parameters excluded, each storage once
(views of one buffer, e.g. q/k/v of one qkv tensor, are one storage). It is exact and
deterministic, so it can be compared between policies and against a formula.
"""
from __future__ import annotations


import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

POLICIES = ("none", "core_attn", "attn", "mlp", "block")
class Checkpointed(nn.Module):
    """Runs ``inner`` under non-reentrant ``torch.utils.checkpoint``: keep inputs, recompute the rest."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, *args):
        if not torch.is_grad_enabled():
            return self.inner(*args)
        return checkpoint(self.inner, *args, use_reentrant=False)


def apply_checkpointing(model: nn.Module, policy: str) -> nn.Module:
    """Wrap parts of every block of a ``toolkit.models.GPT`` (in place) according to ``policy``."""
    if policy not in POLICIES:
        raise ValueError(f"policy={policy!r} is not known; allowed: {POLICIES}")
    for i, block in enumerate(model.blocks):
        if policy == "core_attn":
            block.attn.core = Checkpointed(block.attn.core)
        elif policy == "attn":
            block.attn = Checkpointed(block.attn)
        elif policy == "mlp":
            block.mlp = Checkpointed(block.mlp)
        elif policy == "block":
            model.blocks[i] = Checkpointed(block)
    return model
