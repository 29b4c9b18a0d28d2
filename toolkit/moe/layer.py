"""The tiny GPT's MoE layer under expert parallelism: the router is replicated, the experts are spread.

::

    toolkit.models.MoE (every expert on every rank)      ExpertParallelMoE on rank r of ep ranks
    ───────────────────────────────────────────────      ───────────────────────────────────────────────────────
    router ─► for e in experts: index_add(...)      ─►   router ─► place(ids) ─► TokenDispatcher.plan
                                                          ─► dispatch ─► run_experts(slots) ─► combine
                                                          rank r keeps experts [r*E/ep, (r+1)*E/ep) in slots
                                                          0..E/ep-1 and ``spare_slots`` empty slots after them

``place`` is the hook for expert placement: it maps expert ids [T,K] to slot ids (default: each expert's
home slot); a cloning scheme (ECHO) fills spare slots with copies of hot experts (``set_slot``) and sends
part of their tokens there. ``last_plan`` keeps the most recent :class:`~toolkit.moe.dispatcher.Plan`
(per-slot token counts, drops) for inspection.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from .dispatcher import Codec, Plan, TokenDispatcher, run_experts


class ExpertParallelMoE(nn.Module):
    """The router and this rank's experts of a ``toolkit.models.MoE``; tokens travel by all-to-all.

    Keyword arguments go to :class:`TokenDispatcher` (``codec``, ``combine_codec``, ``block``, ``dedup``,
    ``capacity``, ``overflow``).
    """

    def __init__(self, moe: nn.Module, group=None, spare_slots: int = 0, **dispatcher_kwargs):
        super().__init__()
        ep, rank = dist.get_world_size(group), dist.get_rank(group)
        n_expert = len(moe.experts)
        if n_expert % ep:
            raise ValueError(f"n_expert={n_expert} experts must be divisible by the expert-parallel size ep={ep} "
                             "(each rank owns n_expert/ep experts)")
        if not isinstance(spare_slots, int) or spare_slots < 0:
            raise ValueError(f"spare_slots={spare_slots!r} must be an int >= 0")
        self.n_expert, self.local = n_expert, n_expert // ep
        self.router = moe.router
        self.experts = nn.ModuleList(moe.experts[rank * self.local:(rank + 1) * self.local])
        self.slots: list[nn.Module | None] = [*self.experts, *([None] * spare_slots)]
        self.slots_per_rank = self.local + spare_slots
        self.dispatcher = TokenDispatcher(ep * self.slots_per_rank, moe.router.top_k, group, **dispatcher_kwargs)
        self.place = self.home_slots
        """Hook: expert ids [T,K] -> slot ids [T,K] (the same tokens may go to a clone instead of home)."""
        self.last_plan: Plan | None = None

    @property
    def phase(self):
        return self.dispatcher.phase

    @phase.setter
    def phase(self, fn) -> None:  # e.g. lambda name: ctx.ledger.tag(f"train/{name}")
        self.dispatcher.phase = fn

    def home_slots(self, ids: torch.Tensor) -> torch.Tensor:
        """Each expert's own slot: expert e lives on rank e // local, in its local slot e % local."""
        return (ids // self.local) * self.slots_per_rank + ids % self.local

    def set_slot(self, slot: int, module: nn.Module | None) -> None:
        """Put a module (e.g. a clone of a hot expert) into local spare slot ``slot`` (or empty it)."""
        if not self.local <= slot < self.slots_per_rank:
            raise ValueError(f"slot={slot}: spare slots are {self.local}..{self.slots_per_rank - 1}")
        self.slots[slot] = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B,T,D] -> [B,T,D]
        flat = x.reshape(-1, x.shape[-1])
        weights, ids = self.router(flat)  # [N,K]
        slots = self.place(ids)  # home_slots keeps an id outside 0..n_expert-1 outside the slots: the plan raises
        plan = self.last_plan = self.dispatcher.plan(slots, weights, flat)
        expert_in = self.dispatcher.dispatch(flat, plan)
        expert_out = run_experts(self.slots, expert_in, plan.recv_counts)
        return self.dispatcher.combine(expert_out, plan).view_as(x)


def expert_parallel(model: nn.Module, group=None, **kwargs) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """Replace every ``toolkit.models.MoE`` of ``model`` by an :class:`ExpertParallelMoE` (in place).

    Returns (replicated params, expert params): the first need a data-parallel gradient average, the
    second are this rank's own experts (their gradients already sum over every rank's tokens).
    """
    from toolkit.models.gpt import MoE
    for name, module in list(model.named_modules()):
        if isinstance(module, MoE):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, ExpertParallelMoE(module, group, **kwargs))
    expert_ids = {id(p) for m in model.modules() if isinstance(m, ExpertParallelMoE) for p in m.experts.parameters()}
    params = list(model.parameters())
    return [p for p in params if id(p) not in expert_ids], [p for p in params if id(p) in expert_ids]


__all__ = ["ExpertParallelMoE", "expert_parallel", "Codec"]
