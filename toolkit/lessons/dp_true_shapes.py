"""Compressed data parallelism in a paper's own setting, at its true shapes (lessons 05 and 06).

One data-parallel rank's optimizer step of the paper's model on the paper's GPU count, every op run on fake
tensors (``toolkit.runtime.shapes.estimate``: nothing computed, no memory taken) and timed by the emulated
cluster's efficiency model; every collective on torch's fake process group, timed on the link its group spans.
A symmetric job: one rank stands for all. The step is two traces, nothing overlapped (the papers' baselines
overlap nothing either; lesson 05's and 06's runs neither)::

    compute   one micro-batch through one of the model's layers: the project's GPT ``Block`` split tp ways
              (``toolkit.parallel.tensor``; its all-reduces on the fake group of the tp ranks of one node),
              forward and backward; and through its ends (embedding, ln_f, head, loss), unsplit
                  stage   = layers/pp · layer + ends/tp          (the last stage: the slowest)
                  compute = (m + pp − 1) · stage                 (1F1B over m micro-batches, its bubble)
    update    the lesson's OWN code after the backward, on the fake group of one DP group's dp ranks,
              ``per_node`` of them on a node (tp innermost, then dp: Megatron's order): the gradients'
              sync (plain, or the compressed codec: its kernels and its collectives), and the optimizer (in the
              update where the lesson's code runs it there, else traced once for every scheme)
    step      compute + update (+ optimizer)

Every identical layer costs the same, so one is traced and multiplied (the trace of a whole model would take
minutes on a laptop for the same sum); traces are cached per shape. The sensitivity band re-times the same
ops on ``hw.perturbed(...)`` (``Estimate.on``; ``emulator_report.over_band``), as lesson 13 does. Left out: the
overlap of the sync with the backward (none in the papers' baselines), the pipeline's point-to-point sends,
Megatron's vocabulary-parallel head (the ends are traced unsplit and divided by tp), data loading. A model,
labelled so wherever shown.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from toolkit.models.catalog import ModelSpec
from toolkit.runtime.cluster import Cluster, cluster as make_cluster
from toolkit.runtime.emulator_report import over_band
from toolkit.runtime.shapes import Estimate, default_dtype, estimate


@dataclass(frozen=True)
class Setting:
    """A paper's training job: its model, its GPUs split as dp · tp · pp, and the tokens of one step."""

    name: str
    model: ModelSpec
    gpus: int
    tp: int
    pp: int
    micro_batch: int
    """Sequences (of ``model.seq_len``) per micro-batch."""
    micro_batches: int
    """Micro-batches per optimizer step on one replica (gradient accumulation, or the pipeline's)."""
    hw: Cluster
    """The preset standing for the paper's cluster, ``gpus_per_node`` as the paper's nodes."""

    def __post_init__(self):
        for name in ("gpus", "tp", "pp", "micro_batch", "micro_batches"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Setting {name}={v!r} must be an int >= 1")
        if self.gpus % (self.tp * self.pp) or self.tp > self.hw.gpus_per_node:
            raise ValueError(f"Setting {self.name}: tp·pp = {self.tp * self.pp} must divide gpus = {self.gpus}, "
                             f"and tp = {self.tp} fit a node of {self.hw.gpus_per_node}")
        if self.model.layers % self.pp or self.model.heads % self.tp or self.model.ffn % self.tp:
            raise ValueError(f"Setting {self.name}: pp must divide the layers, tp the heads and the MLP width")

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    @property
    def per_node(self) -> int:
        """Ranks of one DP group on a node: a node's GPUs hold gpus_per_node / tp of them (tp innermost)."""
        return max(1, min(self.dp, self.hw.gpus_per_node // self.tp))

    @property
    def tokens(self) -> int:
        """Tokens one replica trains on per optimizer step."""
        return self.micro_batch * self.model.seq_len * self.micro_batches

    def compute_cluster(self, hw: Cluster | None = None) -> Cluster:
        """``hw`` (None: the setting's) with the tp ranks of a layer on one node."""
        return make_cluster(hw or self.hw, ranks_per_node=None if self.tp == 1 else self.tp)

    def sync_cluster(self, hw: Cluster | None = None) -> Cluster:
        """``hw`` (None: the setting's) with one DP group's dp ranks, ``per_node`` of them on each node."""
        return make_cluster(hw or self.hw, ranks_per_node=self.per_node)


# ---- the compute: one layer and the ends, traced once per shape -------------------------------------------------
@functools.lru_cache(maxsize=32)
def trace_compute(model: ModelSpec, tp: int, micro_batch: int, hw: Cluster) -> dict[str, Estimate]:
    """``layer``: one of ``model``'s layers (the project's GPT ``Block``, split tp ways on the fake group of tp
    ranks) forward and backward on one micro-batch, in bf16; ``ends``: the embedding, the final norm, the head
    and the loss (logits in fp32) forward and backward, unsplit. ``hw`` places the tp ranks on one node."""
    from toolkit.models.gpt import Block, Embedding, GPTConfig, Head, lm_loss
    from toolkit.parallel.tensor import tensor_parallel_block
    cfg = GPTConfig(vocab_size=model.vocab, seq_len=model.seq_len, n_layer=1, n_head=model.heads,
                    d_model=model.hidden, d_ff=model.ffn)
    B, T, D = micro_batch, model.seq_len, model.hidden

    def layer():
        with default_dtype(torch.bfloat16):  # a fake module cannot be converted after it is made
            block = Block(cfg)
            if tp > 1:
                tensor_parallel_block(block, dist.group.WORLD)  # the fake group of the tp ranks
            return block, torch.empty(B, T, D, requires_grad=True)  # x [B,T,D]

    def layer_step(block, x):
        with default_dtype(torch.bfloat16):
            block(x).backward(torch.ones(B, T, D))

    def ends():
        with default_dtype(torch.bfloat16):
            return Embedding(cfg), Head(cfg), torch.zeros(B, T, dtype=torch.long)  # ids and targets: values unread

    def ends_step(embed, head, idx):
        lm_loss(head(embed(idx)), idx).backward()  # the layers between are the ``layer`` trace's

    return {"layer": estimate(layer, layer_step, hw, world_size=tp), "ends": estimate(ends, ends_step, hw)}


def stage_s(s: Setting, traced: dict[str, Estimate], hw: Cluster | None = None) -> float:
    """One micro-batch through the last pipeline stage (its layers and the ends' 1/tp share), on ``hw``."""
    on = (lambda e: e) if hw is None else (lambda e: e.on(hw))
    return s.model.layers // s.pp * on(traced["layer"]).step_s + on(traced["ends"]).step_s / s.tp


def compute_s(s: Setting, traced: dict[str, Estimate], hw: Cluster | None = None) -> float:
    """One replica's forward and backward for a step: 1F1B over its micro-batches, (m + pp − 1) stage times."""
    return (s.micro_batches + s.pp - 1) * stage_s(s, traced, hw)


def traced_flops(s: Setting, traced: dict[str, Estimate]) -> float:
    """FLOPs of one step over the whole job, from the traces: every layer on its tp GPUs and the ends once, per
    micro-batch of every replica."""
    per_replica = s.model.layers * s.tp * traced["layer"].flops + traced["ends"].flops
    return per_replica * s.micro_batches * s.dp


# ---- the update: the lesson's own code on one DP group ----------------------------------------------------------
def trace_update(s: Setting, build: Callable[[], Any], step: Callable[..., Any]) -> Estimate:
    """The lesson's update (``build`` makes its state, ``step`` runs it) on the fake group of the dp ranks of one
    DP group, ``s.per_node`` to a node: its collectives timed on the link that placement spans."""
    return estimate(build, step, s.sync_cluster(), world_size=s.dp)


def steps(s: Setting, traced: dict[str, Estimate], updates: dict[str, Estimate], optimizer: Estimate | None = None,
          hw: Cluster | None = None) -> dict[str, dict[str, float]]:
    """Per scheme, one step's seconds by part on ``hw`` (None: the setting's cluster; the band passes it perturbed):
    ``compute_s``, ``update_s`` (the update's ops and collectives, one after another), ``wire_s`` (its collectives
    alone), ``codec_s`` (its kernels), ``optimizer_s`` (``optimizer``'s, when the update leaves it out), ``step_s``
    (their sum)."""
    hw_c, hw_s = s.compute_cluster(hw), s.sync_cluster(hw)
    compute = compute_s(s, traced, hw_c)
    opt = optimizer.on(hw_c).step_s if optimizer is not None else 0.0
    out = {}
    for name, est in updates.items():
        u = est.on(hw_s)
        out[name] = {"compute_s": compute, "update_s": u.step_s, "wire_s": u.comm_s, "codec_s": u.kernels_s,
                     "optimizer_s": opt, "step_s": compute + u.step_s + opt}
    return out


def _timed(s: Setting, traced: dict[str, Estimate], updates: dict[str, Estimate], optimizer: Estimate | None
           ) -> dict:
    """``steps`` at the calibrated figures and, under ``sensitivity``, over the band (``report.band`` reads it)."""
    sensitivity = over_band(lambda hw: steps(s, traced, updates, optimizer, hw), s.hw)
    return {"steps": sensitivity["value"], "sensitivity": sensitivity}


Program = tuple[Callable[[], Any], Callable[..., Any]]
"""(build, step), as ``estimate`` takes them."""


def true_shapes(s: Setting, updates: dict[str, Program], optimizer: Program | None = None) -> dict:
    """The setting's step per scheme: ``compute`` (the traced layer and ends), ``updates`` (each scheme's traced
    update), ``optimizer`` (traced once, the same for every scheme; None: the updates run it), ``steps`` (seconds
    by part) and ``sensitivity`` (the steps re-timed over the band: ``emulator_report.over_band``)."""
    traced = trace_compute(s.model, s.tp, s.micro_batch, s.compute_cluster())
    done = {name: trace_update(s, build, step) for name, (build, step) in updates.items()}
    opt = estimate(*optimizer, s.compute_cluster()) if optimizer is not None else None
    return {"setting": s, "compute": traced, "updates": done, "optimizer": opt, **_timed(s, traced, done, opt)}


def with_batch(result: dict, micro_batches: int) -> dict:
    """``result`` (``true_shapes``') at another number of micro-batches per step: the same traces re-summed."""
    s = dataclasses.replace(result["setting"], micro_batches=micro_batches)
    return {**result, "setting": s, **_timed(s, result["compute"], result["updates"], result["optimizer"])}


def verdict(result: dict, claim, quantity: str, key: Callable[[dict], float]) -> tuple[dict, Any]:
    """``quantity`` (``key`` of a ``steps`` dict) over ``result``'s sensitivity band (``report.band``), and
    ``claim`` judged on it (``bench.judge``: reproduced, direction only, not reproduced, not decidable)."""
    from toolkit.report import SENSITIVITY, band
    from toolkit.runtime.bench import judge
    b = band(quantity, result["sensitivity"], key=key)
    return b, judge(claim, b["value"], b["low"], b["high"], SENSITIVITY)
