"""Recompute in the bubble (MindSpeed RiPipe): checkpoint a forward now, rebuild it whenever the rank idles.

Plain activation checkpointing recomputes inside the backward, i.e. *after* the gradient has arrived,
so the recompute sits on the critical path. But the recompute needs only the stage input, not the
gradient: it can run earlier, while the rank would otherwise wait (the 1F1B cool-down, a gradient still
in flight). The schedule says where, with an ``R`` action right before the backward::

    F (checkpointed)                       R (in a bubble)                         B
    ────────────────                       ───────────────                         ─
    save x.detach(), RNG state             restore RNG state (forked)              backward through the
    out = stage(x) under no_grad           out = stage(x) with grad                rebuilt graph: same ops,
    send out          ──► recompute queue  ──► (x, out) for the backward  ──►      same values: gradients
                           per (stage, mb, chunk)                                  bitwise equal to no recompute

    plain checkpoint:  [wait for gradient] [recompute + B]      (torch.utils.checkpoint, inline)
    in the bubble:     [recompute] [wait for gradient] [B]      (the wait hides the recompute)

The RNG state is saved at the checkpointed forward and restored for the recompute inside
``torch.random.fork_rng``, so dropout masks repeat exactly and the global RNG stream is untouched.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch

from .schedule import Action, Schedule

Key = tuple[int, int, int]  # (stage, micro-batch, sequence chunk)


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


class RecomputeQueue:
    """Checkpointed forwards waiting for their recompute, by (stage, micro-batch, chunk)."""

    def __init__(self):
        self._pending: dict[Key, tuple[torch.Tensor, Callable[[], tuple[torch.Tensor, torch.Tensor]]]] = {}

    def forward(self, key: Key, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """Run ``fn(x)`` keeping no activations; queue a closure that rebuilds them (same RNG state)."""
        x = x.detach()
        cpu_state, cuda_state = _rng_state(x.device)
        with torch.no_grad():
            out = fn(x)

        def recompute() -> tuple[torch.Tensor, torch.Tensor]:
            devices = [x.device] if cuda_state is not None else []
            with torch.random.fork_rng(devices=devices), torch.enable_grad():
                torch.set_rng_state(cpu_state)
                if cuda_state is not None:
                    torch.cuda.set_rng_state(cuda_state, x.device)
                x_again = x.requires_grad_(x.is_floating_point())
                return x_again, fn(x_again)

        self._pending[key] = (x, recompute)
        return out

    def input_of(self, key: Key) -> torch.Tensor:
        """The detached input a pending recompute will start from (all a checkpointed forward keeps)."""
        return self._pending[key][0]

    def recompute(self, key: Key) -> tuple[torch.Tensor, torch.Tensor]:
        """Rebuild the activations of ``key``: returns (input with grad, output with graph)."""
        if key not in self._pending:
            raise RuntimeError(f"recompute of {key} requested but its forward was not checkpointed")
        return self._pending.pop(key)[1]()

    def __len__(self) -> int:
        return len(self._pending)


# ------------------------------------------------------------------------------------------------
# Which forwards to checkpoint, and where their recompute goes (a schedule transformation)
# ------------------------------------------------------------------------------------------------
MODES = ("none", "inline", "bubble")
POLICIES = ("cap", "cooldown")


def _held_peak(order: list[Action], checkpointed: set[Key]) -> int:
    """Most stage-chunks of activations a rank holds at once, walking its order, when the forwards of
    ``checkpointed`` keep nothing and rebuild their activations right before their backward."""
    held = peak = 0
    for a in order:
        key = (a.stage, a.mb, a.chunk)
        held += 1 if (a.op == "F" and key not in checkpointed) or (a.op == "B" and key in checkpointed) else 0
        peak = max(peak, held)
        held -= 1 if a.op == "B" else 0
    return peak


def cap_policy(order: list[Action], keep: int) -> set[Key]:
    """Checkpoint as few forwards as the cap needs: walking the rank's order, a forward keeps its
    activations unless that would break ``keep`` even if every later forward were checkpointed."""
    mine: set[Key] = set()
    undecided = {(a.stage, a.mb, a.chunk) for a in order if a.op == "F"}
    for a in order:
        if a.op == "F":
            key = (a.stage, a.mb, a.chunk)
            undecided.discard(key)
            if _held_peak(order, mine | undecided) > keep:
                mine.add(key)
    return mine


def cooldown_policy(order: list[Action]) -> set[Key]:
    """Bubble-aware: checkpoint exactly the forwards whose backward the rank runs in its cool-down (the backwards
    after the one paired with its last forward), where it waits for each gradient to come back down the pipeline. Their recompute then fits
    in that wait instead of delaying anything. Under interleaved stages these include early warm-up chunks
    (long-lived: their backward comes last), so the peak drops too; under plain 1F1B the peak is reached
    before the cool-down and stays."""
    last_f = max(i for i, a in enumerate(order) if a.op == "F")
    tail = [a for a in order[last_f + 1:] if a.op == "B"][1:]  # the first pairs with the last forward (steady)
    return {(a.stage, a.mb, a.chunk) for a in tail}


def with_recompute(schedule: Schedule, mode: str, policy: str = "cap", keep: int | None = None) -> Schedule:
    """``schedule`` with some forwards checkpointed and their activations rebuilt before their backward.

    ``mode``: ``"none"`` (unchanged), ``"inline"`` (the backward recomputes after its gradient arrived,
    ``torch.utils.checkpoint``) or ``"bubble"`` (an R action right before the backward: it needs no gradient,
    so it runs while the rank waits for one). ``policy``: which forwards, per rank: ``"cap"`` (``cap_policy``:
    at most ``keep`` stage-chunks held, default ceil(p/2) micro-batches' worth) or ``"cooldown"``
    (``cooldown_policy``; takes no ``keep``). Works on schedules of single F and B actions (GPipe, 1F1B,
    interleaved 1F1B).
    """
    if mode not in MODES:
        raise ValueError(f"recompute={mode!r}; allowed: {MODES}")
    if policy not in POLICIES:
        raise ValueError(f"policy={policy!r}; allowed: {POLICIES}")
    if policy == "cooldown" and keep is not None:
        raise ValueError(f"policy='cooldown' picks the forwards from the schedule and takes no keep (got keep={keep})")
    ops = {part.op for acts in schedule.ranks for a in acts for part in a.parts}
    if not ops <= {"F", "B"} or schedule.checkpointed:
        raise ValueError(f"{schedule.name}: recompute needs a schedule of F and B actions only, without "
                         f"checkpointing yet (it has {sorted(ops)})")
    if policy == "cap":
        keep = -(-schedule.p // 2) * schedule.stages_per_rank * schedule.k if keep is None else keep
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
            raise ValueError(f"keep must be an int >= 1, got {keep!r}")
    if mode == "none":
        return schedule
    ranks, ckpt = [], set()
    for order in schedule.ranks:
        mine = cap_policy(order, keep) if policy == "cap" else cooldown_policy(order)
        ckpt |= mine
        if mode == "bubble":
            order = [x for a in order for x in
                     ([Action("R", a.stage, a.mb, a.chunk), a] if a.op == "B" and (a.stage, a.mb, a.chunk) in mine
                      else [a])]
        ranks.append(list(order))
    name = f"{schedule.name}-recompute-{mode}" + ("-cooldown" if policy == "cooldown" else "")
    return replace(schedule, name=name, ranks=ranks, checkpointed=frozenset(ckpt),
                   meta={**schedule.meta, "recompute": mode, "policy": policy, "keep": keep}).check()
