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

Which forwards are checkpointed and where their R goes is a schedule transformation
(``schedule.with_recompute``, policies ``cap`` and ``cooldown``); this module runs it: ``RecomputeQueue`` holds
the checkpointed forwards, ``Recompute`` is the executor hook that uses it.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint

from .executor import ExecutorHook, key_of
from .schedule import Action, Key


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


class Recompute(ExecutorHook):
    """The executor hook that runs a schedule's checkpointed forwards (``Schedule.checkpointed``)::

        F of a key with an R (``Schedule.recomputed``)   no activations kept, queued for its R: only the
                                                        input stays (``RecomputeQueue``)
        R                                               rebuild them (inside the forward_context of the hooks)
        F of another checkpointed key                   ``torch.utils.checkpoint``: the backward recomputes

    ``PipelineExecutor`` refuses a schedule that checkpoints forwards without this hook.
    """

    def ops(self) -> dict[str, Callable[[Action], None]]:
        return {"R": self.recompute}

    def step_begin(self, inputs, targets) -> None:
        self.queue = RecomputeQueue()

    def stage_fn(self, a: Action, fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
        key, ex = key_of(a), self.executor
        if key in ex.schedule.recomputed:  # activations rebuilt later by an R action
            def queued(x: torch.Tensor) -> torch.Tensor:
                out = self.queue.forward(key, fn, x)
                ex.hold(key, [self.queue.input_of(key)])
                return out
            return queued
        if key in ex.schedule.checkpointed:  # recomputed inside the backward
            def inline(x: torch.Tensor) -> torch.Tensor:
                out = checkpoint(fn, x, use_reentrant=False)
                ex.hold(key, [x])
                return out
            return inline
        return fn

    def recompute(self, a: Action) -> None:
        """R: rebuild the activations of a checkpointed forward (no gradient needed yet)."""
        key, ex = key_of(a), self.executor
        with ex.forward_context(a), ex.recording(key):
            ex.saved[key] = self.queue.recompute(key)

    def step_end(self, loss: float | None) -> float | None:
        if len(self.queue):
            raise RuntimeError(f"rank {self.executor.rank}: step ended with {len(self.queue)} checkpointed "
                               "forwards never recomputed: the schedule is inconsistent")
        return loss
