"""EDGC as a DDP communication hook: any model wrapped in ``DistributedDataParallel`` gets entropy-driven
low-rank gradient compression without changing its training loop.

Each DDP bucket is one EDGC stage (``toolkit.comm.edgc`` groups parameters by pipeline stage; DDP groups
them by bucket, about 25 MB each, in backward order). DDP calls the hook once per bucket as soon as the
bucket's gradients are ready, on every rank, in the same order::

    loss.backward()
      bucket 0 ready ─► hook(state, bucket 0):  sample entropy of its gradients  (every isr_every-th step)
                                              PowerSGD-reduce its gradients at the stage's rank (None: plain
                                              all-reduce, the warm-up), in place in the bucket's buffer
      bucket 1 ready ─► hook(state, bucket 1):  ...
      last bucket    ─► hook(...), then, before a window starts: rank 0 maps each stage's mean entropy over
                        the window to a rank, a broadcast makes it every rank's (checked: all agree)
    DDP copies the averaged buckets into each parameter's .grad

Use::

    ddp = DDP(model)
    ddp.register_comm_hook(EDGCHook(EDGCConfig(warmup=20, window=20)), EDGCHook.hook)
    loss = ddp(x).sum(); loss.backward()          # gradients averaged, compressed after the warm-up

At a fixed rank (``r_min == r_init == r_max``) the hook computes what torch's ``powerSGD_hook`` computes
(same per-bucket error feedback, warm start and random Q, seeded the same way), bit for bit; the
difference is that EDGC moves the rank with the gradient's entropy. The collectives are synchronous (the
hook returns a completed future), so the ledger counts them like any other call.
"""
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from .edgc import EDGCConfig, PowerSGDReducer, rank_from_entropy, sample_entropy


@dataclass
class _Stage:
    ids: list[int]  # the parameters DDP put in this bucket
    reducer: PowerSGDReducer
    samples: list[tuple[int, float]] = field(default_factory=list)  # (step, entropy) of the sampled steps
    h_ref: float | None = None  # entropy at the stage's first decision (the warm-up's grid)


class EDGCHook:
    """The state of the hook (one per DDP model); ``EDGCHook.hook`` is the function DDP calls.

    Args:
        cfg: EDGC's knobs (``toolkit.comm.edgc.EDGCConfig``); ``warmup`` must be >= 2 (DDP settles its
            buckets after the first step). Ranks are decided at the end of the step before a window, from the
            entropy sampled in the window before (every ``isr_every``-th step, and always on that last step).
        group: the data-parallel process group (default: the world).

    After each step ``history[-1]`` holds ``{"step", "entropy": {bucket: bits}, "ranks": [rank per bucket]}``.
    """

    def __init__(self, cfg: EDGCConfig | None = None, group=None):
        self.cfg = (cfg or EDGCConfig()).validate()
        if self.cfg.warmup < 2:
            raise ValueError("warmup must be >= 2 for the DDP hook: DDP rebuilds its buckets after the first step "
                             "(torch's powerSGD_hook asks start_powerSGD_iter >= 2 for the same reason)")
        self.group, self.step = group, 0
        self.rng = np.random.RandomState(self.cfg.seed)  # one generator for all buckets, as torch's PowerSGDState
        self.gen = torch.Generator().manual_seed(self.cfg.seed)
        self.stages: dict[int, _Stage] = {}
        self.history: list[dict] = []
        self._entropy: dict[int, float] = {}

    @staticmethod
    def hook(state: "EDGCHook", bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """``ddp.register_comm_hook(state, EDGCHook.hook)``: average one bucket (see the module docstring)."""
        return state.reduce_bucket(bucket)

    def reduce_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        index, params, grads = bucket.index(), bucket.parameters(), bucket.gradients()
        stage = self._stage(index, params)
        cfg = self.cfg
        nxt = self.step + 1
        decide = nxt >= cfg.warmup and (nxt - cfg.warmup) % cfg.window == 0  # at the end of this step
        if self.step % cfg.isr_every == 0 or decide:  # every stage has a sample in the window it is decided on
            h = sample_entropy(grads, cfg.gsr, cfg.bins, self.gen)
            stage.samples.append((self.step, h))
            self._entropy[index] = h
        stage.reducer.reduce_([grads])  # in place: grads are views of bucket.buffer()
        if bucket.is_last():
            if decide:
                self._decide()
            self.history.append({"step": self.step, "entropy": dict(self._entropy), "ranks": self.ranks})
            self._entropy = {}
            self.step += 1
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    @property
    def ranks(self) -> list[int | None]:
        """The rank of each bucket now (None: plain all-reduce)."""
        return [self.stages[i].reducer.ranks[0] for i in sorted(self.stages)]

    def _stage(self, index: int, params: list[torch.nn.Parameter]) -> _Stage:
        """This bucket's stage; a new one when DDP rebuilt its buckets (after the first step)."""
        ids = [id(p) for p in params]
        stage = self.stages.get(index)
        if stage is None or stage.ids != ids:
            reducer = PowerSGDReducer([params], None, self.group, self.cfg.min_compression_rate,
                                      seed=self.cfg.seed)
            reducer.rng = self.rng
            stage = self.stages[index] = _Stage(ids, reducer)
        return stage

    def _decide(self) -> None:
        """Rank 0 maps each stage's mean entropy over the window to a rank; the broadcast makes it global."""
        cfg, order = self.cfg, sorted(self.stages)
        ranks = []
        for i in order:
            stage = self.stages[i]
            recent = [h for s, h in stage.samples if s > self.step - cfg.window]
            if not recent:  # a stage DDP has just formed, with no sample yet: stays plain this window
                ranks.append(0)
                continue
            mean = sum(recent) / len(recent)
            if stage.h_ref is None:  # its first decision freezes the grid: r_init
                stage.h_ref = mean
            ranks.append(rank_from_entropy(mean, stage.h_ref, cfg.ref_bits, cfg.r_init, cfg.r_min, cfg.r_max))
            stage.samples = [(s, h) for s, h in stage.samples if s > self.step - cfg.window]
        device = self.stages[order[0]].reducer.buckets[0].params[0].device
        decided = torch.tensor(ranks, dtype=torch.int64, device=device)
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
            dist.broadcast(decided, src=src, group=self.group)
        for i, r in zip(order, decided.tolist()):
            self.stages[i].reducer.set_ranks([int(r) or None])
