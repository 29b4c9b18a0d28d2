"""Expert parallelism: one token dispatcher (``dispatcher``), the tiny GPT's MoE layer on it (``layer``),
and DeepEP-style variants (``deepep``: two-hop forwarding over nodes, low-latency fixed buffers).

Building blocks for lessons on top of it::

    disp = TokenDispatcher(n_slots, top_k, group, codec="int8", combine_codec="bf16", dedup=False)
    plan = disp.plan(slot_ids, weights, x)            # collective; plan.counts [R, n_slots], plan.recv_counts
    pend = disp.dispatch(x, plan, async_op=True)      # issued; compute something else here
    h = pend.wait()                                   # expert input, slot-major, split by plan.recv_counts
    y = disp.combine(run_experts(experts, h, plan.recv_counts), plan, async_op=True).wait()

    layer = ExpertParallelMoE(moe, group, spare_slots=1)   # home experts + one empty slot per rank
    layer.set_slot(layer.local, clone)                     # fill it (e.g. a copy of a hot expert)
    layer.place = lambda ids: ...                          # expert ids [T,K] -> slot ids (home or clone)
"""
from .dispatcher import (CODECS, Codec, Layout, Pending, Plan, TokenDispatcher, all_to_all, dispatch_layout, route,
                         run_experts)
from .layer import ExpertParallelMoE, expert_parallel

__all__ = ["CODECS", "Codec", "Layout", "Pending", "Plan", "TokenDispatcher", "all_to_all", "dispatch_layout",
           "route", "run_experts", "ExpertParallelMoE", "expert_parallel"]
