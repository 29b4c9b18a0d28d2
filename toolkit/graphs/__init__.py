"""CUDA graphs: op counts and host cost per pipeline chunk, capture requirements (``audit``), a replay cost
model, and the CUDA path (``graph_stages``)."""
from .cuda_graphs import OpCounter, audit, count_ops, dispatch_cost, graph_stages, launches_kernel, replay_model

__all__ = ["OpCounter", "audit", "count_ops", "dispatch_cost", "graph_stages", "launches_kernel", "replay_model"]
