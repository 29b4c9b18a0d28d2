"""Lesson 11: Seq1F1B. Per rank (p ranks = p pipeline stages of the tiny GPT)::

    reference        the whole GPT on one process over all micro-batches: loss and every gradient
    1f1b             1F1B on whole sequences (k = 1)                        ┐ real P2P through
    seq1f1b-tokens   Seq1F1B, k chunks of equal length                      │ seq1f1b.Seq1F1BExecutor (the
    seq1f1b-compute  Seq1F1B, k chunks of equal FLOPs (earlier ones longer) ┘ pipeline executor + chunks)

For each run: loss and max |grad - reference| on this rank's stage, the peak number of chunks whose
activations this rank held (counted), the peak bytes of saved activations (the executor's
``ActivationMeter``, plus the KV cache and the filed dK/dV), and the timeline of F/B spans.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from toolkit.data import batches
from toolkit.models.gpt import GPT, GPTConfig, split_stages
from toolkit.pipeline import seq1f1b as s1
from toolkit.runtime.config import require_positive_ints, resolve_preset

PRESETS = {
    "smoke": dict(n_layer=4, d_model=32, n_head=2, seq_len=32, micro_batch=2, micro_batches=4, seq_chunks=4),
    "default": dict(n_layer=4, d_model=128, n_head=4, seq_len=256, micro_batch=2, micro_batches=8, seq_chunks=4),
    "full": dict(n_layer=8, d_model=1024, n_head=16, seq_len=4096, micro_batch=1, micro_batches=16, seq_chunks=4),
}
TOL = 1e-5  # fp32: chunked attention and the split dK/dV sums only reorder additions
RUN_NAME = {"equal_tokens": "seq1f1b-tokens", "equal_compute": "seq1f1b-compute"}


def validate(cfg: dict, world_size: int) -> dict:
    cfg = resolve_preset(cfg, PRESETS)
    p = world_size
    require_positive_ints(cfg, "n_layer", "d_model", "n_head", "seq_len", "micro_batch", "micro_batches")
    k = cfg["seq_chunks"]
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"seq_chunks={k!r} must be an int >= 1 (k = 1 is plain 1F1B)")
    if k > cfg["seq_len"]:
        raise ValueError(f"seq_chunks={k} is more chunks than the seq_len={cfg['seq_len']} tokens; "
                         f"need 1 <= seq_chunks <= {cfg['seq_len']}")
    if p < 2:
        raise ValueError(f"world_size={p}: a pipeline needs at least 2 stages")
    if cfg["n_layer"] % p:
        raise ValueError(f"n_layer={cfg['n_layer']} must be divisible by world_size={p} (layers per stage)")
    if cfg["micro_batches"] < p:
        raise ValueError(f"micro_batches={cfg['micro_batches']} is fewer than the {p} stages; need >= {p}")
    partitions = cfg.setdefault("partitions", list(s1.PARTITIONS))
    if isinstance(partitions, str):
        partitions = cfg["partitions"] = [partitions]
    if not partitions:
        raise ValueError(f"partitions is empty; give one or more of {s1.PARTITIONS}")
    for name in partitions:
        if name not in s1.PARTITIONS:
            raise ValueError(f"partitions: {name!r} is not known; allowed: {s1.PARTITIONS}")
    GPTConfig(seq_len=cfg["seq_len"], n_layer=cfg["n_layer"], n_head=cfg["n_head"], d_model=cfg["d_model"])
    return cfg


def run(ctx, cfg: dict) -> dict:
    r, p = ctx.rank, ctx.world_size
    mcfg = GPTConfig(seq_len=cfg["seq_len"], n_layer=cfg["n_layer"], n_head=cfg["n_head"], d_model=cfg["d_model"])
    torch.manual_seed(0)
    model = GPT(mcfg).to(ctx.device)
    data = [(x.to(ctx.device), y.to(ctx.device))
            for x, y in batches(cfg["micro_batch"], cfg["seq_len"], cfg["micro_batches"], seed=1)]
    m, k = len(data), cfg["seq_chunks"]
    a, b = s1.flop_coefficients(mcfg)

    model.zero_grad()
    ref_loss = 0.0
    for idx, tgt in data:
        loss = model(idx, tgt) / m
        loss.backward()
        ref_loss += loss.item()
    ref = {n: q.grad.clone() for n, q in model.named_parameters()}
    model.zero_grad()

    stage = split_stages(model, p)[r]
    names = {id(q): n for n, q in model.named_parameters()}
    inputs, targets = [x for x, _ in data], [y for _, y in data]
    out = {"rank": r, "ref_loss": ref_loss, "runs": {}, "lengths": {}}
    runs = [("1f1b", 1, "equal_tokens")] + [(RUN_NAME[name], k, name) for name in cfg["partitions"]]
    # One untimed step first: gloo opens its point-to-point connections on first use.
    s1.Seq1F1BExecutor(s1.seq1f1b(p, m, 1), r, stage, [mcfg.seq_len], mcfg.n_head, cfg["micro_batch"],
                       mcfg.d_model, device=ctx.device).step(inputs, targets)
    model.zero_grad()
    for done, (name, kk, partition) in enumerate(runs):
        lengths = s1.partition(mcfg.seq_len, kk, partition, a, b)
        ex = s1.Seq1F1BExecutor(s1.seq1f1b(p, m, kk), r, stage, lengths, mcfg.n_head, cfg["micro_batch"],
                                mcfg.d_model, device=ctx.device, timeline=ctx.timeline, meter=True)
        ctx.barrier()
        n_spans = len(ctx.timeline.spans)
        t0 = time.perf_counter()
        with ctx.ledger.tag(name):
            loss = ex.step(inputs, targets)
        wall = time.perf_counter() - t0
        loss = torch.tensor([loss or 0.0], device=ctx.device)
        dist.broadcast(loss, src=p - 1)
        diff = max((q.grad - ref[names[id(q)]]).abs().max().item() for q in stage.parameters())
        model.zero_grad()
        for span in ctx.timeline.spans[n_spans:]:
            span.meta["run"] = name
        out["lengths"][name] = lengths
        out["runs"][name] = {"k": kk, "loss": loss.item(), "max_grad_diff": diff, "peak_chunks": ex.peak_chunks,
                             "peak_mb": ex.peak_chunks / kk, "act_peak_bytes": ex.meter.peak, "wall_s": wall,
                             "memory": ex.memory, "p2p_bytes": ctx.ledger.total("sent_bytes", tag=name)}
        ctx.progress(done + 1, len(runs), name)
    out["spans"] = ctx.timeline.to_json()
    return out
