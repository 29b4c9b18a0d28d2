"""Lesson 13: vocabulary parallelism. Per rank (p ranks = p pipeline stages)::

    reference     the whole GPT on one process: loss and every gradient (each rank, for comparison)
    baseline      pipeline, embedding on stage 0, head + loss on stage p-1           (GPipe order, real P2P)
    vocab 1 / 2   pipeline, both tables split in p row blocks, S/C0/T(/C1) passes on every rank
    timings       each rank in turn (the others wait) times its passes for one micro-batch (CPU time of
                  the rank's thread on CPU, so other processes on the cores do not count)
    calibration   matmul FLOP/s, memory bytes/s and per-op overhead of this CPU, for the cost model

The real runs use GPipe order (all forwards, the vocabulary passes, all backwards) so every rank issues
its collectives in the same order; the throughput of 1F1B schedules comes from the simulator
(``toolkit.pipeline.vocab_parallel.simulate``), fed with the measured pass times here and with the
cost model at the paper's scale.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from toolkit.data import batches
from toolkit.models.gpt import GPT, GPTConfig, lm_loss, split_stages
from toolkit.pipeline import vocab_parallel as vp
from toolkit.runtime.bench import measure
from toolkit.runtime.config import require_positive_ints, resolve_preset

PRESETS = {
    "smoke": dict(vocab_size=1024, n_layer=4, d_model=32, n_head=2, seq_len=32, micro_batch=2, micro_batches=4,
                  bench_steps=3),
    "default": dict(vocab_size=8192, n_layer=4, d_model=128, n_head=4, seq_len=128, micro_batch=2, micro_batches=8,
                    bench_steps=5),
    "full": dict(vocab_size=65536, n_layer=8, d_model=1024, n_head=16, seq_len=1024, micro_batch=1,
                 micro_batches=16, bench_steps=10),
}
TOL = 1e-5  # fp32: the sharded softmax and the all-reduces only reorder sums


def validate(cfg: dict, world_size: int) -> dict:
    cfg = resolve_preset(cfg, PRESETS)
    p = world_size
    if p < 2:
        raise ValueError(f"world_size={p}: vocabulary parallelism needs at least 2 pipeline stages")
    require_positive_ints(cfg, "vocab_size", "n_layer", "d_model", "n_head", "seq_len", "micro_batch", "micro_batches",
                          "bench_steps")
    vp.shard_rows(cfg["vocab_size"], p, 0)  # raises, naming vocab_size, unless p divides it
    if cfg["n_layer"] % p:
        raise ValueError(f"n_layer={cfg['n_layer']} must be divisible by world_size={p} (layers per stage)")
    if cfg["micro_batches"] < p:
        raise ValueError(f"micro_batches={cfg['micro_batches']} is fewer than the {p} stages; need >= {p}")
    GPTConfig(vocab_size=cfg["vocab_size"], seq_len=cfg["seq_len"], n_layer=cfg["n_layer"], n_head=cfg["n_head"],
              d_model=cfg["d_model"])  # its own checks (d_model % n_head)
    return cfg


# ---------------------------------------------------------------------------------------------
def run(ctx, cfg: dict) -> dict:
    r, p = ctx.rank, ctx.world_size
    mcfg = GPTConfig(vocab_size=cfg["vocab_size"], seq_len=cfg["seq_len"], n_layer=cfg["n_layer"],
                     n_head=cfg["n_head"], d_model=cfg["d_model"])
    torch.manual_seed(0)
    model = GPT(mcfg).to(ctx.device)
    data = [(x.to(ctx.device), y.to(ctx.device))
            for x, y in batches(cfg["micro_batch"], cfg["seq_len"], cfg["micro_batches"], seed=1)]
    m = len(data)

    ref_loss, ref_grads = _reference(model, data)
    out = {"rank": r, "ref_loss": ref_loss, "runs": {}}
    progress = [0]

    def tick(msg):
        progress[0] += 1
        ctx.progress(progress[0], 6, msg)

    with ctx.ledger.tag("baseline"):
        loss, grads = _baseline(ctx, model, data)
    out["runs"]["baseline"] = {"loss": loss, "max_grad_diff": _diff(grads, ref_grads)}
    tick("baseline")
    for alg in vp.ALGORITHMS:
        ctx.ledger.reset()
        loss, grads, sbytes = _vocab(ctx, model, data, alg)
        out["runs"][f"vocab{alg}"] = {"loss": loss, "max_grad_diff": _diff(grads, ref_grads),
                                      "s_state_bytes": sbytes, "comm": _comm_per_mb(ctx, m)}
        tick(f"vocab algorithm {alg}")
    out["param_bytes"] = {"baseline": _param_bytes_baseline(model, r, p), "vocab": _param_bytes_vocab(model, r, p)}

    # Pass times, one rank at a time so ranks do not share the cores while timed.
    for turn in range(p):
        ctx.barrier()
        if r == turn:
            out["times"] = _time_passes(model, data[0], r, p, cfg["bench_steps"])
            if r == 0:
                out["calibration"] = _calibrate(cfg, p, ctx.device)
    ctx.barrier()
    tick("timings")
    return out


def _reference(model: GPT, data) -> tuple[float, dict]:
    model.zero_grad()
    total = 0.0
    for idx, tgt in data:
        loss = model(idx, tgt) / len(data)
        loss.backward()
        total += loss.item()
    grads = {n: q.grad.clone() for n, q in model.named_parameters()}
    model.zero_grad()
    return total, grads


def _diff(grads: dict, ref: dict) -> float:
    """Max |grad - reference| over the parameters (or row slices) this rank owns."""
    worst = 0.0
    for name, (g, rows) in grads.items():
        want = ref[name] if rows is None else ref[name][rows[0]:rows[1]]
        worst = max(worst, (g - want).abs().max().item())
    return worst


def _owned(model: GPT, r: int, p: int) -> dict:
    """Names of the block / position / ln_f parameters stage r owns in both layouts."""
    per = len(model.blocks) // p
    names = {}
    for n, q in model.named_parameters():
        if n.startswith("blocks."):
            if r * per <= int(n.split(".")[1]) < (r + 1) * per:
                names[n] = q
        elif n == "embed.pos.weight" and r == 0 or n.startswith("head.ln_f") and r == p - 1:
            names[n] = q
    return names


def _baseline(ctx, model: GPT, data) -> tuple[float, dict]:
    """GPipe order: every forward, then every backward; the first stage embeds, the last computes the loss."""
    r, p, m = ctx.rank, ctx.world_size, len(data)
    stage = split_stages(model, p)[r]
    B, T = data[0][0].shape
    xs, ys = [], []
    for i, (idx, tgt) in enumerate(data):
        with ctx.timeline.span("F", mb=i, run="baseline"):
            x = idx if r == 0 else _recv((B, T, model.cfg.d_model), r - 1, idx.device).requires_grad_()
            y = stage(x)
            if r == p - 1:
                y = lm_loss(y, tgt) / m
            else:
                dist.send(y.detach(), r + 1)
        xs.append(x)
        ys.append(y)
    for i in range(m):
        with ctx.timeline.span("B", mb=i, run="baseline"):
            ys[i].backward(None if r == p - 1 else _recv(ys[i].shape, r + 1, ys[i].device))
            if r > 0:
                dist.send(xs[i].grad, r - 1)
    loss = torch.tensor([sum(y.item() for y in ys) if r == p - 1 else 0.0], device=ctx.device)
    dist.broadcast(loss, src=p - 1)
    grads = {n: (q.grad.clone(), None) for n, q in model.named_parameters() if q.grad is not None}
    model.zero_grad()
    return loss.item(), grads


def _vocab(ctx, model: GPT, data, algorithm: int) -> tuple[float, dict, int]:
    """Vocabulary parallelism in GPipe order: input layer, forwards, S/C0/T(/C1) per micro-batch, backwards."""
    r, p, m = ctx.rank, ctx.world_size, len(data)
    V, D = model.cfg.vocab_size, model.cfg.d_model
    lo, hi = vp.shard_rows(V, p, r)
    tok = model.embed.tok.weight[lo:hi].detach().clone().requires_grad_()  # [V/p,D] this rank's rows
    W = model.head.out.weight[lo:hi].detach().clone().requires_grad_()  # [V/p,D]
    per = len(model.blocks) // p
    blocks = model.blocks[r * per:(r + 1) * per]
    B, T = data[0][0].shape
    N, g = B * T, 1.0 / (B * T * len(data))  # mean over every token of every micro-batch
    dev = ctx.device

    partials, embeds = [], []
    with ctx.ledger.tag("input_fwd"):
        for i, (idx, _) in enumerate(data):
            with ctx.timeline.span("I", mb=i, run=f"vocab{algorithm}"):
                partial, full = vp.embed_forward(tok, idx, lo)
            partials.append(partial)
            embeds.append(full.requires_grad_() if r == 0 else None)
    xs, hs = [], []
    for i in range(m):
        with ctx.timeline.span("F", mb=i, run=f"vocab{algorithm}"), ctx.ledger.tag("p2p"):
            x = embeds[i] + model.embed.pos(torch.arange(T, device=dev)) if r == 0 else \
                _recv((B, T, D), r - 1, dev).requires_grad_()
            h = x
            for block in blocks:
                h = block(h)
            if r == p - 1:
                h = model.head.ln_f(h)  # X, the output layer's input
            else:
                dist.send(h.detach(), r + 1)
        xs.append(x)
        hs.append(h)
    loss, dxs, sbytes = 0.0, [], 0
    for i, (_, tgt) in enumerate(data):
        X = hs[i].detach().reshape(N, D).contiguous() if r == p - 1 else torch.empty(N, D, device=dev)
        with ctx.ledger.tag("bcast_x"):
            dist.broadcast(X, src=p - 1)
        with ctx.timeline.span("S", mb=i, run=f"vocab{algorithm}"):
            st = vp.s_pass(X, W, tgt.reshape(-1), lo, algorithm)
        sbytes = vp.state_bytes(st)
        with ctx.ledger.tag("c0"):
            loss += vp.c0(st).mean().item() / m
        if algorithm == 2:
            with ctx.ledger.tag("dx"):
                dx = vp.dx_fused(st, g)
        with ctx.timeline.span("T", mb=i, run=f"vocab{algorithm}"):
            dx_i = vp.t_pass(st, W, g, algorithm)
        if algorithm == 1:
            with ctx.ledger.tag("c1"):
                dx = vp.c1(dx_i)
        dxs.append(dx.view(B, T, D))
    for i in range(m):
        with ctx.timeline.span("B", mb=i, run=f"vocab{algorithm}"), ctx.ledger.tag("p2p"):
            hs[i].backward(dxs[i] if r == p - 1 else _recv((B, T, D), r + 1, dev))
            if r > 0:
                dist.send(xs[i].grad, r - 1)
    with ctx.ledger.tag("input_bwd"):
        for i in range(m):
            d_embed = embeds[i].grad if r == 0 else torch.empty(B, T, D, device=dev)
            vp.embed_backward(partials[i], d_embed, src=0)
    grads = {n: (q.grad.clone(), None) for n, q in _owned(model, r, p).items()}
    grads["embed.tok.weight"] = (tok.grad, (lo, hi))
    grads["head.out.weight"] = (W.grad, (lo, hi))
    model.zero_grad()
    return loss, grads, sbytes


def _recv(shape, src: int, device) -> torch.Tensor:
    buf = torch.empty(shape, device=device)
    dist.recv(buf, src)
    return buf


def _comm_per_mb(ctx, m: int) -> dict:
    """Bytes this rank put on the wire per micro-batch, by phase, for the last run."""
    return {row["tag"]: row["sent_bytes"] // m for row in ctx.ledger.summary(by=("tag",))}


def _param_bytes_baseline(model: GPT, r: int, p: int) -> int:
    stage = split_stages(model, p)[r]
    return sum(q.numel() * q.element_size() for q in stage.parameters())


def _param_bytes_vocab(model: GPT, r: int, p: int) -> int:
    V, D = model.cfg.vocab_size, model.cfg.d_model
    own = sum(q.numel() * q.element_size() for q in _owned(model, r, p).values())
    return own + 2 * (V // p) * D * 4


# ---------------------------------------------------------------------------------------------
def _time_passes(model: GPT, batch, r: int, p: int, steps: int) -> dict:
    """Median seconds of each pass of this rank for one micro-batch, in both layouts."""
    idx, tgt = batch
    B, T = idx.shape
    V, D = model.cfg.vocab_size, model.cfg.d_model
    N = B * T
    stage = split_stages(model, p)[r]
    dev = idx.device
    x_in = idx if r == 0 else torch.randn(B, T, D, device=dev)
    per = len(model.blocks) // p
    blocks = model.blocks[r * per:(r + 1) * per]
    lo, hi = vp.shard_rows(V, p, r)
    W = model.head.out.weight[lo:hi].detach().clone()
    tok = model.embed.tok.weight[lo:hi].detach().clone().requires_grad_()
    X = torch.randn(N, D, device=dev)

    med = lambda fn: _seconds(fn, steps)

    def base_f():
        y = stage(x_in)
        return lm_loss(y, tgt) if r == p - 1 else y

    def base_fb():
        y = base_f()
        y.backward(None if r == p - 1 else torch.ones_like(y))

    def blocks_f():
        h = torch.randn(B, T, D, device=dev, requires_grad=True)
        for blk in blocks:
            h = blk(h)
        return model.head.ln_f(h) if r == p - 1 else h

    def blocks_fb():
        blocks_f().backward(torch.ones(B, T, D, device=dev))

    def input_fb():
        vp.partial_embedding(tok, idx, lo).backward(torch.ones(B, T, D, device=dev))

    out = {"base_F": med(base_f), "base_FB": med(base_fb), "blocks_F": med(blocks_f), "blocks_FB": med(blocks_fb),
           "input_F": med(lambda: vp.partial_embedding(tok.detach(), idx, lo)), "input_FB": med(input_fb)}
    for alg in vp.ALGORITHMS:
        st = vp.s_pass(X, W, tgt.reshape(-1), lo, alg)
        st.alpha = torch.full((N,), 1.0 / p, device=dev)  # what C0 would set; the T pass cost does not depend on it
        out[f"S{alg}"] = med(lambda: vp.s_pass(X, W, tgt.reshape(-1), lo, alg))
        out[f"T{alg}"] = med(lambda: vp.t_pass(st, W, 1.0, alg))
    model.zero_grad()
    return out


def _seconds(fn, steps: int) -> float:
    """Median seconds of ``fn()``. On CPU the thread's CPU time (``time.thread_time``; torch runs one
    intra-op thread per rank here), which other processes sharing the cores cannot inflate; on GPUs wall
    time with synchronisation (``bench.measure``)."""
    if torch.cuda.is_available():
        return measure(fn, warmup=1, steps=steps, rounds=3, trim=1).median_s
    fn()
    times = []
    for _ in range(3 * steps):
        t0 = time.thread_time()
        fn()
        times.append(time.thread_time() - t0)
    return statistics.median(times)


def _calibrate(cfg: dict, p: int, device) -> dict:
    """This CPU as a ``Hardware``: matmul FLOP/s (a layer's and the head's shapes), elementwise bytes/s,
    fixed cost of one eager op."""
    N, D, Vp = cfg["micro_batch"] * cfg["seq_len"], cfg["d_model"], cfg["vocab_size"] // p
    x, w_ff, w_head = (torch.randn(*shape, device=device) for shape in ((N, D), (D, 4 * D), (D, Vp)))
    big, tiny = torch.randn(max(N * Vp, 1 << 16), device=device), torch.zeros(1, device=device)
    rates = [2 * N * D * n / _seconds(lambda: x @ w, 10) for n, w in ((4 * D, w_ff), (Vp, w_head))]
    bandwidth = 2 * big.numel() * 4 / _seconds(lambda: torch.exp(big), 10)  # read + write
    return {"matmul_flops": statistics.fmean(rates), "mem_bw": bandwidth, "op_overhead_s": _seconds(lambda: tiny + 1, 50)}


# ---------------------------------------------------------------------------------------------
# From the results to the simulator and the cost model (called by the notebook)
# ---------------------------------------------------------------------------------------------
def measured_rows(results: list[dict], algorithm: int) -> tuple[list[dict], list[dict]]:
    """Per-stage seconds (F, B, S, T) of one micro-batch, measured, for the baseline and vocab layouts."""
    base, vocab = [], []
    for r in results:
        t = r["times"]
        base.append({"F": t["base_F"], "B": max(t["base_FB"] - t["base_F"], 1e-9), "S": 0.0, "T": 0.0})
        vocab.append({"F": t["blocks_F"], "B": max(t["blocks_FB"] - t["blocks_F"], 1e-9),
                      "S": t[f"S{algorithm}"] + t["input_F"],
                      "T": t[f"T{algorithm}"] + max(t["input_FB"] - t["input_F"], 0.0)})
    return base, vocab


def workload(cfg: dict) -> vp.Workload:
    """The lesson's model as the cost model sees it (fp32 on this machine)."""
    return vp.Workload(cfg["n_layer"], cfg["d_model"], 4 * cfg["d_model"], cfg["vocab_size"], cfg["seq_len"],
                       cfg["micro_batch"], act_bytes=4, logit_bytes=4)


def cost_model_check(cfg: dict, results: list[dict], algorithm: int = 2) -> list[dict]:
    """The cost model, calibrated on this CPU, against the measured pass times: one row per rank and layout."""
    cal = results[0]["calibration"]
    hw = vp.Hardware("this CPU (calibrated)", cal["matmul_flops"], cal["mem_bw"], 1e9, cal["op_overhead_s"])
    p = len(results)
    rows_b, rows_v = measured_rows(results, algorithm)
    pred = {layout: vp.stage_costs(workload(cfg), p, hw, layout, algorithm) for layout in ("baseline", "vocab")}
    out = []
    for layout, measured in (("baseline", rows_b), ("vocab", rows_v)):
        for r in range(p):
            m = sum(measured[r][k] for k in "FBST")
            q = sum(pred[layout][r][k] for k in "FBST")
            out.append({"layout": layout, "rank": r, "measured_ms": m * 1e3, "model_ms": q * 1e3,
                        "model/measured": q / m})
    return out
