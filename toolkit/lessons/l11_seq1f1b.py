"""Lesson 11: Seq1F1B. Per rank (p ranks = p pipeline stages of the tiny GPT)::

    reference        the whole GPT on one process over all micro-batches: loss and every gradient
    1f1b             1F1B on whole sequences (k = 1)                        ┐ real P2P through the pipeline
    seq1f1b-tokens   Seq1F1B, k chunks of equal length                      │ executor with the
    seq1f1b-compute  Seq1F1B, k chunks of equal FLOPs (earlier ones longer) ┘ seq1f1b.SequenceChunks hook

For each run: loss and max |grad - reference| on this rank's stage, the peak number of chunks whose
activations this rank held (counted), the peak bytes of saved activations (the executor's
``ActivationMeter``, plus the KV cache and the filed dK/dV), and the timeline of F/B spans. Model, data and
reference come from ``toolkit.pipeline.harness.PipelineSetup``.
"""
from __future__ import annotations


import torch
import torch.distributed as dist

from toolkit.pipeline import seq1f1b as s1
from toolkit.pipeline.executor import PipelineExecutor
from toolkit.pipeline.harness import PipelineSetup, check_stage_per_rank
from toolkit.runtime.config import Param, common, resolve

PARAMS = {**common("n_layer", "seq_len", "m", "micro_batch"),
          "d_model": Param(int, "hidden size", ge=1),
          "n_head": Param(int, "attention heads (must divide d_model)", ge=1),
          "seq_chunks": Param(int, "k, sequence chunks per micro-batch (k = 1 is plain 1F1B)", ge=1),
          "partitions": Param(list, "how Seq1F1B cuts a sequence into chunks", of=str, choices=s1.PARTITIONS)}
PRESETS = {
    "smoke": dict(n_layer=4, d_model=32, n_head=2, seq_len=32, micro_batch=2, m=4, seq_chunks=4,
                  partitions=list(s1.PARTITIONS)),
    "default": dict(n_layer=4, d_model=128, n_head=4, seq_len=256, micro_batch=2, m=8, seq_chunks=4,
                    partitions=list(s1.PARTITIONS)),
    "full": dict(n_layer=8, d_model=1024, n_head=16, seq_len=4096, micro_batch=1, m=16, seq_chunks=4,
                 partitions=list(s1.PARTITIONS)),
}
TOL = 1e-5  # fp32: chunked attention and the split dK/dV sums only reorder additions
RUN_NAME = {"equal_tokens": "seq1f1b-tokens", "equal_compute": "seq1f1b-compute"}


def validate(cfg: dict, world_size: int) -> dict:
    cfg = resolve(cfg, PRESETS, PARAMS)
    k = cfg["seq_chunks"]
    if k > cfg["seq_len"]:
        raise ValueError(f"seq_chunks={k} is more chunks than the seq_len={cfg['seq_len']} tokens; "
                         f"need 1 <= seq_chunks <= {cfg['seq_len']}")
    check_stage_per_rank(cfg, world_size, "a pipeline")
    return cfg


def setup_of(cfg: dict, device="cpu") -> PipelineSetup:
    """The lesson's model (``toolkit.models`` smoke preset with this config's sizes), data and reference."""
    return PipelineSetup.build("smoke", m=cfg["m"], micro_batch=cfg["micro_batch"], n_layer=cfg["n_layer"],
                               seq_len=cfg["seq_len"], n_head=cfg["n_head"], d_model=cfg["d_model"], device=device)


def run(ctx, cfg: dict) -> dict:
    r, p = ctx.rank, ctx.world_size
    setup = setup_of(cfg, ctx.device)
    mcfg, m, k = setup.model_cfg, setup.m, cfg["seq_chunks"]
    a, b = s1.flop_coefficients(mcfg)
    out = {"rank": r, "ref_loss": setup.ref_loss, "runs": {}, "lengths": {}}
    runs = [("1f1b", 1, "equal_tokens")] + [(RUN_NAME[name], k, name) for name in cfg["partitions"]]

    def executor(kk: int, lengths: list[int], **kwargs):
        """(model, schedule, executor, its chunks hook) on a fresh copy of the model."""
        model = setup.fresh()
        schedule = s1.seq1f1b(p, m, kk)
        stage = setup.stages(model, schedule, r)[r]
        chunks = s1.SequenceChunks(stage, lengths, mcfg.n_head)
        ex = PipelineExecutor(schedule, r, {r: stage}, None, setup.act_shape, device=ctx.device, hooks=[chunks],
                              **kwargs)
        return model, schedule, ex, chunks

    # One untimed step first: gloo opens its point-to-point connections on first use.
    executor(1, [mcfg.seq_len])[2].step(setup.inputs, setup.targets)
    for done, (name, kk, partition) in enumerate(runs):
        lengths = s1.partition(mcfg.seq_len, kk, partition, a, b)
        model, schedule, ex, chunks = executor(kk, lengths, timeline=ctx.timeline, meter=True)
        ctx.barrier()
        n_spans = len(ctx.timeline.spans)
        with ctx.ledger.tag(name):
            loss = ex.step(setup.inputs, setup.targets)
        loss = torch.tensor([loss or 0.0], device=ctx.device)
        dist.broadcast(loss, src=p - 1)
        for span in ctx.timeline.spans[n_spans:]:
            span.meta["run"] = name
        out["lengths"][name] = lengths
        out["runs"][name] = {"k": kk, "loss": loss.item(), "max_grad_diff": setup.grad_diff(model, schedule, r),
                             "peak_chunks": chunks.peak_chunks, "peak_mb": chunks.peak_chunks / kk,
                             "act_peak_bytes": ex.meter.peak, "memory": ex.memory,
                             "p2p_bytes": ctx.ledger.total("sent_bytes", tag=name)}
        ctx.progress(done + 1, len(runs), name)
    out["spans"] = ctx.timeline.to_json()
    return out
