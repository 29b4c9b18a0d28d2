"""Expert parallelism: one token dispatcher (``dispatcher``), the tiny GPT's MoE layer on it (``layer``),
and DeepEP-style variants (``deepep``: dedup, two-hop forwarding over nodes, low-latency fixed buffers)."""
from .dispatcher import (CODECS, Codec, Layout, Pending, Plan, TokenDispatcher, all_to_all, dispatch_layout, route,
                         run_experts)
from .layer import ExpertParallelMoE, expert_parallel

__all__ = ["CODECS", "Codec", "Layout", "Pending", "Plan", "TokenDispatcher", "all_to_all", "dispatch_layout",
           "route", "run_experts", "ExpertParallelMoE", "expert_parallel"]
