"""Data-parallel training in one of three ways behind one interface, so they can run side by side.

Each trainer takes its own copy of the same base model and the same per-rank batches; what differs is who
holds which bytes and what crosses the wire::

    kind    how                                                          at rest per rank after backward
    ddp     torch DistributedDataParallel with the stock all-reduce      Ψ params + Ψ grads + 2Ψ AdamW state
            comm hook (it calls dist.all_reduce, so the ledger sees it;
            the default C++ reducer calls the process group directly)
    zero    toolkit's ZeroDataParallel, stage 0-3 (``zero.py``)           by stage: see ``memory_per_rank``
    fsdp2   torch ``fully_shard`` per unit (``default_units``) and on    params, grads, AdamW state sharded:
            the whole model; ``reshard=False`` keeps the gathered        every parameter's dim 0 cut as
            parameters from forward to backward (True re-gathers         torch.chunk does (ceil(d/n) rows each,
            them; None: torch's default); ``cpu_offload`` keeps the      stored padded)
            shards on the host (``CPUOffloadPolicy``)

    trainer = DataParallelTrainer("zero", base, group, stage=3)
    loss = trainer.fwd_bwd(x, y); trainer.step()         # every rank of ``group``, in step
    trainer.memory()          {"params", "grads", "optim"}: bytes of the distinct storages at rest
    trainer.closed_forms()    {"bytes": {op: sent per step}, "memory": {...}}: what the formulas predict
    trainer.full_parameters() every parameter gathered, to compare the kinds bit for bit

The optimizer is any factory ``params -> torch.optim.Optimizer`` (AdamW by default; e.g. an offloading one
for ZeRO); the closed forms assume AdamW on the device.
"""
from __future__ import annotations

import copy
import math
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from .zero import ZeroDataParallel, adamw, default_units, memory_per_rank, optimizer_state, storage_bytes

KINDS = ("ddp", "zero", "fsdp2")


class DataParallelTrainer:
    """One data-parallel way to train a copy of ``base`` over ``group`` (module docstring).

    Args:
        kind: ``"ddp"``, ``"zero"`` or ``"fsdp2"``.
        base: the model; the trainer deep-copies it (every rank passes the same weights).
        group: the data-parallel process group (default: the world).
        optimizer: ``params -> Optimizer`` (default AdamW, lr 1e-3).
        stage: ZeRO stage 0-3 (``kind="zero"`` only).
        reshard: FSDP2's ``reshard_after_forward`` (``kind="fsdp2"`` only; None: torch's default, True for the
            units, False for the root, which holds no parameters of its own here).
        cpu_offload: FSDP2's ``CPUOffloadPolicy`` (``kind="fsdp2"`` only).
    """

    def __init__(self, kind: str, base: nn.Module, group=None,
                 optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] = adamw, stage: int = 0,
                 reshard: bool | None = None, cpu_offload: bool = False):
        if kind not in KINDS:
            raise ValueError(f"kind={kind!r} is not known; allowed: {KINDS}")
        self.kind, self.group, self.zero = kind, group or dist.group.WORLD, None
        self.reshard, self.cpu_offload = reshard, cpu_offload
        self.n = dist.get_world_size(self.group)
        model = copy.deepcopy(base)
        if kind == "zero":
            self.zero = ZeroDataParallel(model, optimizer, stage=stage, group=self.group)
            self.model, self.optimizer = self.zero, self.zero.optimizer
        elif kind == "ddp":
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
            from torch.nn.parallel import DistributedDataParallel as DDP
            self.model = DDP(model, process_group=self.group, gradient_as_bucket_view=True)
            self.model.register_comm_hook(self.group, allreduce_hook)  # divide by n, then sum: as the C++ reducer
            self.optimizer = optimizer(list(self.model.parameters()))
        else:
            from torch.distributed.device_mesh import DeviceMesh
            from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard
            device = next(model.parameters()).device
            policy = CPUOffloadPolicy(pin_memory=device.type == "cuda") if cpu_offload else OffloadPolicy()
            mesh = DeviceMesh.from_group(self.group, device.type)
            self._chunks = [(math.ceil(p.shape[0] / self.n), p.shape[0], p[0].numel()) for p in model.parameters()]
            for unit in default_units(model):
                fully_shard(unit, mesh=mesh, reshard_after_forward=reshard, offload_policy=policy)
            fully_shard(model, mesh=mesh, reshard_after_forward=reshard, offload_policy=policy)
            self.model, self.optimizer = model, optimizer(list(model.parameters()))

    def fwd_bwd(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """Forward and backward of one batch (gradients synchronised as the kind does it); the loss."""
        loss = self.model(x, y)
        loss.backward()
        return loss.item()

    def step(self) -> None:
        """The optimizer step; gradients are cleared."""
        if self.zero is not None:
            self.zero.step()
        else:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)

    def memory(self) -> dict[str, int]:
        """Bytes at rest on this rank now, by category (distinct storages; AdamW's 0-dim step counters left out)."""
        if self.zero is not None:
            return self.zero.memory_by_category()
        params = list(self.model.parameters())
        return {"params": storage_bytes(params), "grads": storage_bytes([p.grad for p in params]),
                "optim": storage_bytes(optimizer_state(self.optimizer))}

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter, whole (gathered from the shards), by name."""
        if self.zero is not None:
            return self.zero.full_parameters()
        module = self.model.module if self.kind == "ddp" else self.model
        return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                for name, p in module.named_parameters()}

    def closed_forms(self) -> dict[str, dict[str, int]]:
        """What this rank should send per step (ledger convention) and hold after backward, fp32 and AdamW::

            ddp     all_reduce 2(n-1)/n·4Ψ                              memory_per_rank(0, Ψ, n)
            zero    ZeroDataParallel.closed_forms()
            fsdp2   all_gather (1 if reshard=False, else 2)·(n-1)/n·4Ψ' memory_per_rank(3, Ψ', n), AdamW state
                    reduce_scatter (n-1)/n·4Ψ'                          8 B per element of this rank's chunk
                    (Ψ' = Ψ with every dim 0 padded to n·ceil(d/n))
        """
        if self.zero is not None:
            return self.zero.closed_forms()
        n = self.n
        if self.kind == "ddp":
            psi = sum(p.numel() for p in self.model.module.parameters())
            return {"bytes": {"all_reduce": 2 * (n - 1) * psi * 4 // n}, "memory": memory_per_rank(0, psi, n)}
        r = dist.get_rank(self.group)
        psi = sum(c * n * row for c, _, row in self._chunks)
        mine = sum(max(0, min(c, d - r * c)) * row for c, d, row in self._chunks)  # the unpadded shard
        gather = (n - 1) * psi * 4 // n
        return {"bytes": {"all_gather_into_tensor": (1 if self.reshard is False else 2) * gather,
                          "reduce_scatter_tensor": gather},
                "memory": {**memory_per_rank(3, psi, n), "optim": 2 * 4 * mine}}


__all__ = ["DataParallelTrainer", "KINDS"]
