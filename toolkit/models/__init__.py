"""The tiny GPT and its MoE variant, split-able into pipeline stages."""
from .gpt import (GPT, MLP, MoE, PRESETS, Attention, Block, CoreAttention, Embedding, GPTConfig, Head, Router, Stage,
                  count_params, lm_loss, preset, split_stages)

__all__ = ["GPT", "GPTConfig", "PRESETS", "preset", "Embedding", "Attention", "CoreAttention", "MLP", "MoE", "Router",
           "Block", "Head", "Stage", "split_stages", "lm_loss", "count_params"]
