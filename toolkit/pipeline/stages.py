"""Any model as pipeline stages: cut a list of layers into the stages a schedule runs.

The executor (``PipelineExecutor``) runs ``{stage: module}`` on each rank; the tiny GPT has its own
``split_stages``. For your model, give the layers in order (an ``nn.Sequential``, an ``nn.ModuleList`` or a
list of modules whose outputs feed the next one) and let the schedule say which stages this rank holds::

    layers  [L0 L1 L2 L3 L4 L5 L6 L7]                      split into schedule.n_stages contiguous stages
    1F1B,      p = 2:   stage 0 = L0..L3 (rank 0)         stage 1 = L4..L7 (rank 1)
    DualPipeV, p = 2:   stages 0..3 of two layers each;   the V puts stages 0 and 3 on rank 0, 1 and 2 on rank 1

    pipeline_stages(layers, schedule, rank) -> {stage: nn.Sequential of its layers}   (parameters shared)

Every activation between two stages must have the same shape (the executor's ``act_shape``), e.g.
[micro_batch, hidden] for an MLP or [micro_batch, seq, d_model] for a transformer; stage 0 gets the
micro-batch inputs and the last stage's output goes to the loss with the targets.
"""
from __future__ import annotations

from typing import Sequence

import torch.nn as nn

from .schedule import Schedule


def split_layers(layers: nn.Module | Sequence[nn.Module], n_stages: int,
                 sizes: Sequence[int] | None = None) -> list[nn.Sequential]:
    """``layers`` in ``n_stages`` contiguous ``nn.Sequential`` stages: ``sizes[i]`` layers each, or as equal as
    possible (the first stages take one more when the count does not divide). Parameters are shared."""
    layers = list(layers.children()) if isinstance(layers, nn.Module) else list(layers)
    if not isinstance(n_stages, int) or isinstance(n_stages, bool) or n_stages < 1:
        raise ValueError(f"n_stages must be a positive int, got {n_stages!r}")
    if not all(isinstance(layer, nn.Module) for layer in layers):
        raise ValueError("layers must be nn.Module objects (an nn.Sequential, an nn.ModuleList or a list)")
    if sizes is None:
        if len(layers) < n_stages:
            raise ValueError(f"{len(layers)} layers cannot fill {n_stages} stages (one layer at least each)")
        base, extra = divmod(len(layers), n_stages)
        sizes = [base + (i < extra) for i in range(n_stages)]
    sizes = list(sizes)
    if len(sizes) != n_stages or any(not isinstance(s, int) or s < 1 for s in sizes) or sum(sizes) != len(layers):
        raise ValueError(f"sizes={sizes} must be {n_stages} positive ints summing to the {len(layers)} layers")
    out, start = [], 0
    for size in sizes:
        out.append(nn.Sequential(*layers[start:start + size]))
        start += size
    return out


def pipeline_stages(layers: nn.Module | Sequence[nn.Module], schedule: Schedule, rank: int,
                    sizes: Sequence[int] | None = None) -> dict[int, nn.Sequential]:
    """This rank's stages of ``schedule`` (``{stage: nn.Sequential}``), cut from ``layers`` by ``split_layers``."""
    stages = split_layers(layers, schedule.n_stages, sizes)
    return {s: stages[s] for s in schedule.stages_of(rank)}
