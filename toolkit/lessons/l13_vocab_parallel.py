"""Lesson 13: vocabulary parallelism. Per rank (p ranks = p pipeline stages)::

    reference     the whole GPT on one process (``PipelineSetup``): loss and every gradient, for comparison
    pass costs    each rank in turn (the others wait) times its passes for one micro-batch, both layouts
                  (CPU time of the rank's thread on CPU, so other processes on the cores do not count);
                  every rank gets every rank's times; rank 0 also calibrates this CPU for the cost model
    schedules     ``vocab_1f1b(p, m, algorithm, measured costs)``: the simulator places the S and T passes
                  into 1F1B; every rank builds the same action lists from the same gathered times
    1f1b          baseline: embedding on stage 0, head + loss on stage p-1, 1F1B through ``PipelineExecutor``
    vocab-1/-2    both tables split in p row blocks, the same action lists run by the executor with the
                  ``VocabPasses`` hook: S/T on every rank, C0 on a comm thread, async collectives
                  (Algorithm 1: C1; Algorithm 2: fused dX)
    one checked step of each: loss, gradients against the reference, activation bytes, waits, collectives;
    then all three timed side by side (``toolkit.runtime.bench.compare``).
    emulated      with ``launch(..., cluster=)``, twice: at the toy's shapes and matched to the paper's layer
                  (``PAPER_LAYER``: every op at its FLOPs, every tensor at its activation's bytes; the toy's
                  vocabulary-to-layer balance kept). Each rank times its passes on the virtual clock, every rank
                  builds the vocabulary schedules from those gathered times (not from this machine's, which
                  change from run to run), and one step of each run is read on the virtual clock, its spans too.
    true shapes   (``true_shapes``, in the notebook's process) the paper's own setting, PP = 8 and V = 256k: the same
                  pass code traced at its true shapes on fake tensors, the schedules simulated from those costs.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from toolkit.models.gpt import lm_loss, split_stages
from toolkit.pipeline import vocab_parallel as vp
from toolkit.pipeline import vocab_passes as vx
from toolkit.pipeline.executor import PipelineExecutor
from toolkit.pipeline.harness import Job, PipelineSetup, check_stage_per_rank, check_step
from toolkit.pipeline.schedule import one_f_one_b
from toolkit.runtime.bench import compare, measure, replayed
from toolkit.runtime.cluster import Cluster
from toolkit.runtime.config import Param, common, resolve
from toolkit.runtime.timeline import Timeline

WORLD_SIZE = 4
PARAMS = {**common("n_layer", "seq_len", "m", "micro_batch", "warmup", "bench_steps", "rounds"),
          "vocab_size": Param(int, "tokens in the vocabulary (a multiple of world_size)", ge=1),
          "d_model": Param(int, "hidden size", ge=1),
          "n_head": Param(int, "attention heads (must divide d_model)", ge=1)}
PRESETS = {
    "smoke": dict(vocab_size=1024, n_layer=4, d_model=32, n_head=2, seq_len=32, micro_batch=2, m=6,
                  warmup=1, bench_steps=1, rounds=1),
    "default": dict(vocab_size=8192, n_layer=4, d_model=128, n_head=4, seq_len=128, micro_batch=2, m=8,
                    warmup=1, bench_steps=1, rounds=3),
    "full": dict(vocab_size=65536, n_layer=8, d_model=1024, n_head=16, seq_len=1024, micro_batch=1, m=16,
                 warmup=2, bench_steps=5, rounds=5),
}
TOL = 1e-5  # fp32: the sharded softmax and the all-reduces only reorder sums
RUNS = ("1f1b", "vocab-1", "vocab-2")
PAPER = vp.Workload(vp.gpt("the paper's 4B GPT", layers=32, hidden=3072, vocab=256_000, seq_len=4096))
"""The paper's setting (Yeung et al., section 6, and its artifact's quick run): 32 layers of hidden 3072, V = 256k,
sequence 4096, micro-batch 1, at PP = ``PAPER_P``."""
PAPER_P, PAPER_M = 8, 24
"""Its pipeline stages, and the micro-batches per step simulated here (3p: our choice; the artifact runs 128)."""
PAPER_LAYER = {"tokens": PAPER.micro_batch * PAPER.seq_len, "hidden": PAPER.hidden, "ffn": PAPER.model.ffn}
"""The paper's layer, that the emulated cluster's matched step times the toy's ops as (``matched.dense_layer_op``)."""


def validate(cfg: dict, world_size: int) -> dict:
    cfg = resolve(cfg, PRESETS, PARAMS)
    check_stage_per_rank(cfg, world_size, "vocabulary parallelism (one pipeline stage per rank)")
    vp.shard_rows(cfg["vocab_size"], world_size, 0)  # raises, naming vocab_size, unless p divides it
    return cfg


def setup_of(cfg: dict, device="cpu") -> PipelineSetup:
    """The lesson's GPT (the smoke preset of ``toolkit.models`` with this config's sizes), data and reference."""
    return PipelineSetup.build("smoke", m=cfg["m"], micro_batch=cfg["micro_batch"], n_layer=cfg["n_layer"],
                               vocab_size=cfg["vocab_size"], seq_len=cfg["seq_len"], d_model=cfg["d_model"],
                               n_head=cfg["n_head"], device=device)


# ---------------------------------------------------------------------------------------------
def run(ctx, cfg: dict) -> dict:
    r, p = ctx.rank, ctx.world_size
    setup = setup_of(cfg, ctx.device)
    m = setup.m
    groups = vx.vocab_groups(list(range(p)))
    for name, group in groups.items():
        ctx.ledger.name_group(group, name)
    out = {"rank": r, "ref_loss": setup.ref_loss, "runs": {}}
    ticks, total = [0], (4 if ctx.emulator is not None else 3)  # the bar: pass costs, checked, timed, emulated

    def tick(msg):
        ticks[0] += 1
        ctx.progress(ticks[0], total, msg)

    with ctx.paused():  # the real run: the emulated cluster's clock is read in _emulated() only
        # Pass costs, one rank at a time so ranks do not share the cores while timed; then everyone has all.
        for turn in range(p):
            ctx.barrier()
            if r == turn:
                out["times"] = _time_passes(setup.fresh(), setup.inputs[0], setup.targets[0], r, p, cfg["bench_steps"])
                if r == 0:
                    out["calibration"] = _calibrate(cfg, p, ctx.device)
        everyone = [None] * p
        dist.all_gather_object(everyone, out["times"])
        tick("pass costs")

        # The schedules: what the simulator builds from the measured costs, the same on every rank.
        schedules = {"1f1b": one_f_one_b(p, m)}
        for alg in vp.ALGORITHMS:
            _, rows = measured_rows([{"times": t} for t in everyone], alg)
            schedules[f"vocab-{alg}"] = vp.vocab_1f1b(p, m, alg, vp.StageCosts(rows))
        out["schedules"] = {name: s.to_strings() for name, s in schedules.items()}

        # One checked step of each.
        record, _ = check_step(ctx, setup, Job(schedules["1f1b"]))
        loss = torch.tensor([record["loss"] or 0.0], device=ctx.device)
        dist.broadcast(loss, src=p - 1)  # the last stage computed it
        out["runs"]["1f1b"] = {"loss": loss.item(), "max_grad_diff": record["grad_diff"],
                               "peak_act_bytes": record["peak_act_bytes"]}
        for alg in vp.ALGORITHMS:
            name = f"vocab-{alg}"
            model, stage, ex, passes = _vocab_executor(ctx, setup, schedules[name], groups, meter=True)
            with ctx.ledger.tag(name):
                loss = ex.step(setup.inputs, setup.targets)
            out["runs"][name] = {
                "loss": loss, "max_grad_diff": vx.vocab_grad_diff(model, stage, setup.reference),
                "peak_act_bytes": ex.meter.peak, "peak_vocab_bytes": passes.vocab_meter.peak,
                "peak_total": passes.peak_total, "peak_held": passes.peak_held, "forward_bytes": passes.forward_bytes,
                "waits": ex.waits, "comm_spans": passes.comm_spans, "collectives": passes.collectives,
                "comm": _comm_per_mb(ctx, name, m)}
        tick("checked steps")

        # All three timed side by side, round-robin, each on a fresh copy; spans of each one's last step.
        def timeline() -> Timeline:
            t = Timeline(r)
            t.origin = ctx.timeline.origin  # aligned across ranks by the launch barrier
            t.virtual = ctx.timeline.virtual  # the emulated cluster's clock, when there is one
            return t

        timed = {"1f1b": (*setup.executor(schedules["1f1b"], r, timeline=timeline()), None, None)}
        for alg in vp.ALGORITHMS:
            model, stage, ex, passes = _vocab_executor(ctx, setup, schedules[f"vocab-{alg}"], groups,
                                                       timeline=timeline())
            timed[f"vocab-{alg}"] = (model, ex, stage, passes)

        def stepper(model, ex, stage):
            def go():
                model.zero_grad(set_to_none=True)
                if stage is not None:
                    stage.zero_grad(set_to_none=True)
                ex.timeline.spans.clear()
                ex.step(setup.inputs, setup.targets)
            return go

        with ctx.part(2, total, "timing"):
            bench = compare({name: stepper(*timed[name][:3]) for name in RUNS}, warmup=cfg["warmup"],
                            steps=cfg["bench_steps"], rounds=cfg["rounds"], sync=ctx.barrier, on_round=ctx.progress)
        for name in RUNS:
            _, ex, _, passes = timed[name]
            out["runs"][name]["bench"] = bench[name].to_dict()
            out["runs"][name]["spans"] = ex.timeline.to_json()  # the last timed step
            out["runs"][name]["timed_waits"] = ex.waits
            if passes is not None:
                out["runs"][name]["timed_comm_spans"] = passes.comm_spans
    if ctx.emulator is None:
        out["emulated"] = None
    else:
        with ctx.part(3, total, "emulated cluster"):  # the last quarter of the bar (a quarter of the default run)
            out["emulated"] = _emulated(ctx, cfg, setup, groups, timed, stepper, timeline)
    out["param_bytes"] = {"baseline": _param_bytes_baseline(setup, r, p),
                          "vocab": sum(q.numel() * q.element_size() for q in timed["vocab-2"][2].parameters())}
    return out


def _emulated(ctx, cfg: dict, setup: PipelineSetup, groups, timed: dict, stepper, timeline) -> dict:
    """The three runs on the emulated cluster's clock, at the toy's shapes and matched to ``PAPER_LAYER``: in each
    view every rank times its passes on the virtual clock, the vocabulary schedules are built from the gathered
    times, and one step of each run is read on the virtual clock (deterministic: one is enough)."""
    ctx.reserve_for_replay()  # the bar's last quarter: the run replayed on other figures
    from toolkit.models import matched
    emu, r, p, m = ctx.emulator, ctx.rank, ctx.world_size, setup.m
    hw = emu.cluster
    scales = matched.matched_scales(
        matched.dense_layer_op(cfg["micro_batch"] * cfg["seq_len"], cfg["d_model"], 4 * cfg["d_model"], hw.float_bytes),
        matched.dense_layer_op(PAPER_LAYER["tokens"], PAPER_LAYER["hidden"], PAPER_LAYER["ffn"], hw.float_bytes))
    link = hw.link_between(list(range(p)), p)
    out = {"cluster": hw.name, "gpu": hw.gpu.name, "link": link.name, "host_op_s": hw.gpu.efficiency.host_op_s,
           "scales": scales, "paper_layer": PAPER_LAYER}
    for view, factors in (("toy", {}), ("matched", scales)):
        with emu.scaled(**factors), ctx.ledger.tag(f"emulated/{view}"):
            mine = _virtual_passes(emu, setup.fresh(), setup.inputs[0], setup.targets[0], r, p)
            everyone = [None] * p
            dist.all_gather_object(everyone, mine)
            runs = {"1f1b": timed["1f1b"][:3]}
            schedules = {}
            for alg in vp.ALGORITHMS:
                _, rows = measured_rows([{"times": t} for t in everyone], alg)
                schedules[f"vocab-{alg}"] = vp.vocab_1f1b(p, m, alg, vp.StageCosts(rows))
                model, stage, ex, passes = _vocab_executor(ctx, setup, schedules[f"vocab-{alg}"], groups,
                                                           timeline=timeline())
                runs[f"vocab-{alg}"] = (model, ex, stage, passes)
            bench = compare({name: stepper(*run[:3]) for name, run in runs.items()}, warmup=0, steps=1, rounds=1,
                            sync=ctx.barrier, clock="virtual", label=f"emulated {view}")
        out[view] = {"times": mine, "schedules": {name: s.to_strings() for name, s in schedules.items()}, "runs": {}}
        for name, run in runs.items():
            ex, passes = run[1], (run[3] if len(run) > 3 else None)
            out[view]["runs"][name] = {"bench": bench[name].to_dict(), "spans": ex.timeline.to_json(),
                                       "waits": ex.waits, "comm_spans": passes.comm_spans if passes else []}
    names = list(out["matched"]["runs"])
    out["sensitivity"] = ctx.replay(lambda clocks: {name: replayed(clocks, f"emulated matched/{name}") for name in names})
    return out


def _vocab_executor(ctx, setup: PipelineSetup, schedule, groups, **kwargs):
    """(model, stage, executor, its vocabulary hook): a fresh copy of the model, this rank's ``VocabStage`` of
    it, the pipeline executor with the ``VocabPasses`` hook."""
    model = setup.fresh()
    stage = vx.VocabStage(model, ctx.rank, ctx.world_size)
    passes = vx.VocabPasses(stage, groups)
    ex = PipelineExecutor(schedule, ctx.rank, {ctx.rank: stage}, None, setup.act_shape, device=ctx.device,
                          hooks=[passes], **kwargs)
    return model, stage, ex, passes


def _comm_per_mb(ctx, tag: str, m: int) -> dict:
    """Bytes this rank put on the wire per micro-batch in the step tagged ``tag``, by group and op."""
    rows = [row for row in ctx.ledger.summary(by=("tag", "group", "op")) if row["tag"] == tag]
    return {f"{row['group']}:{row['op']}": row["sent_bytes"] // m for row in rows}


def _param_bytes_baseline(setup: PipelineSetup, r: int, p: int) -> int:
    stage = split_stages(setup.base, p)[r]
    return sum(q.numel() * q.element_size() for q in stage.parameters())


# ---------------------------------------------------------------------------------------------
def _passes(model, idx: torch.Tensor, tgt: torch.Tensor, r: int, p: int) -> dict:
    """This rank's passes for one micro-batch, in both layouts, as functions to time (keys as ``measured_rows``
    reads them)."""
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

    fns = {"base_F": base_f, "base_FB": base_fb, "blocks_F": blocks_f, "blocks_FB": blocks_fb,
           "input_F": lambda: vp.partial_embedding(tok.detach(), idx, lo), "input_FB": input_fb}
    for alg in vp.ALGORITHMS:
        st = vp.s_pass(X, W, tgt.reshape(-1), lo, alg)
        st.alpha = torch.full_like(st.s, 1.0 / p)  # what C0 would set; the T pass cost does not depend on it
        fns[f"S{alg}"] = lambda alg=alg: vp.s_pass(X, W, tgt.reshape(-1), lo, alg)
        fns[f"T{alg}"] = lambda alg=alg, st=st: vp.t_pass(st, W, 1.0, alg)
    return fns


def _time_passes(model, idx: torch.Tensor, tgt: torch.Tensor, r: int, p: int, steps: int) -> dict:
    """Median seconds of each pass of this rank for one micro-batch, in both layouts."""
    out = {name: _seconds(fn, steps) for name, fn in _passes(model, idx, tgt, r, p).items()}
    model.zero_grad()
    return out


def _virtual_passes(emu, model, idx: torch.Tensor, tgt: torch.Tensor, r: int, p: int) -> dict:
    """Each pass of this rank for one micro-batch on the emulated cluster's clock (deterministic: one call), from
    an idle device to its end, as ``_time_passes`` times them on this machine."""
    out = {}
    for name, fn in _passes(model, idx, tgt, r, p).items():
        emu.synchronize()
        t0 = emu.now()
        fn()
        emu.synchronize()
        out[name] = emu.now() - t0
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
    """This CPU's achieved rates, for ``vp.from_rates``: matmul FLOP/s (a layer's and the head's shapes), elementwise bytes/s,
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
    """The lesson's model as the cost model sees it (``toolkit.models.catalog.gpt``)."""
    return vp.Workload(vp.gpt("the lesson's GPT", cfg["n_layer"], cfg["d_model"], cfg["vocab_size"], cfg["seq_len"]),
                       micro_batch=cfg["micro_batch"])


def cost_model_check(cfg: dict, results: list[dict], algorithm: int = 2) -> list[dict]:
    """The cost model, calibrated on this CPU, against the measured pass times: one row per rank and layout."""
    cal = results[0]["calibration"]
    hw = vp.from_rates("this CPU (calibrated)", cal["matmul_flops"], cal["mem_bw"], cal["op_overhead_s"],
                       link_bytes_per_s=1e9)
    p = len(results)
    rows_b, rows_v = measured_rows(results, algorithm)
    pred = {layout: vp.stage_costs(workload(cfg), p, hw, layout, algorithm, elem=4)  # fp32 on this machine
            for layout in ("baseline", "vocab")}
    out = []
    for layout, measured in (("baseline", rows_b), ("vocab", rows_v)):
        for r in range(p):
            m = sum(measured[r][k] for k in "FBST")
            q = sum(pred[layout][r][k] for k in "FBST")
            out.append({"layout": layout, "rank": r, "measured_ms": m * 1e3, "model_ms": q * 1e3,
                        "model/measured": q / m})
    return out


# ---- the cost model's head against the same head traced at its true shapes ---------------------------------------
def traced_head(w: vp.Workload, hw) -> dict:
    """The output layer of ``w`` (its logits in fp32, cross-entropy, forward and backward) two ways on ``hw``'s
    GPU: as the cost model writes its passes by hand (``vp.pass_ops``: head_f, head_b), and as PyTorch issues
    them, run with fake tensors at the true shapes (``toolkit.runtime.shapes.estimate``: nothing computed).
    Returns both times in ms, their GEMM parts and the kernels of each (a model either way)."""
    from toolkit.runtime.efficiency import kernel_seconds
    from toolkit.runtime.shapes import estimate
    N, D, V = w.micro_batch * w.seq_len, w.model.hidden, w.model.vocab
    ops = vp.pass_ops(w, 1)
    hand = ops["head_f"] + ops["head_b"]

    def build():
        return (torch.nn.Linear(D, V, bias=False, dtype=torch.bfloat16),
                torch.empty(N, D, dtype=torch.bfloat16, requires_grad=True), torch.empty(N, dtype=torch.long))

    def step(head, x, y):
        torch.nn.functional.cross_entropy(head(x).float(), y).backward()  # [N, V] logits in fp32

    traced = estimate(build, step, hw)
    g = hw.gpu
    hand_gemm = sum(kernel_seconds(k, g.bf16_flops, g.hbm_bytes_per_s, g.sms, g.efficiency) for k in hand
                    if k.kind == "gemm")
    return {"model_ms": vp.op_time(hand, hw) * 1e3, "traced_ms": traced.step_s * 1e3,
            "model_gemm_ms": hand_gemm * 1e3, "traced_gemm_ms": traced.by_kind()["gemm"] * 1e3,
            "model_kernels": len(hand), "traced_kernels": [name for name, _, _ in traced.kernels]}


# ---- the paper's setting at its true shapes: every pass traced, the schedules simulated ----------------------------
def true_shapes(w: vp.Workload = PAPER, p: int = PAPER_P, m: int = PAPER_M, hw: str | Cluster = "a100-ib200") -> dict:
    """Vocabulary parallelism against 1F1B for ``w`` at PP = ``p`` on ``hw``, from its passes traced at their true
    shapes in bf16 (``toolkit.runtime.shapes.estimate``: fake tensors, nothing computed, every ATen op timed by the
    emulated cluster's efficiency model)::

        _passes(GPT of w, rank r)   the code the lesson times on real ranks: the project's GPT split into p stages
                                    (embedding on stage 0, ln_f + head + loss on stage p-1), vp.s_pass / t_pass on
                                    a V/p shard, the partial embedding        ──► seconds of each pass, each rank
        vp.c0, vp.dx_fused, C1,     on torch's fake process group of p ranks, timed on hw's link
        the broadcast of X                                                    ──► the wait of a cross-rank step
        measured_rows ──► vp.simulate_layouts(1F1B, vocab_1f1b)               ──► step times and speed-up

    The same simulator and comm convention as the cost model's (one delay per cross-rank dependency: the longer of
    the broadcast of X and C0 with dX or C1). Left out: the optimizer step, the input layer's all-reduce and dE
    broadcast (they run ahead of and after the pipeline), compute slowed by collectives beside it, data
    parallelism. Ranks 1..p-2 run the same code at the same shapes, so one is traced for all; every rank's S, T
    and input passes have the same shapes, so rank 0's stand for all.

    Returns each rank's pass seconds (``times``), the simulator's per-stage rows and waits, both simulations per
    algorithm (``sims``: ``simulate_layouts``'), ``speedup``, the traced ``passes`` (an ``Estimate`` each), and
    ``sensitivity`` (``report.band`` reads it): the speed-ups with every kernel and collective re-timed on the
    cluster's band (``hw.perturbed``: the traced ops do not depend on it), the action lists kept, as the emulated
    cluster's replays keep a run's."""
    from toolkit.runtime.cluster import cluster
    from toolkit.runtime.emulator_report import over_band
    hw = cluster(hw)
    passes, comm = _trace_passes(w, p, hw), _trace_comm(w, p, hw)

    def on(c, schedules: dict | None = None) -> dict:
        times = [{"times": {name: est.on(c).step_s for name, est in rank.items()}} for rank in passes]
        waits = {alg: max(e.on(c).step_s for e in comm[alg]) for alg in vp.ALGORITHMS}
        rows = {alg: measured_rows(times, alg) for alg in vp.ALGORITHMS}  # (baseline, vocab) per-stage F, B, S, T
        sims = {alg: vp.simulate_layouts(*rows[alg], m, alg, waits[alg], schedule=schedules and schedules[alg])
                for alg in vp.ALGORITHMS}
        return {"times": [t["times"] for t in times], "rows": rows, "comm": waits, "sims": sims}

    out = on(hw)
    schedules = {alg: out["sims"][alg]["schedule"] for alg in vp.ALGORITHMS}  # the band replays these lists
    speedup = lambda got: {alg: got["sims"][alg]["speedup"] for alg in vp.ALGORITHMS}  # noqa: E731
    out.update(cluster=hw.name, p=p, m=m, passes=passes, speedup=speedup(out),
               sensitivity=over_band(lambda c: speedup(on(c, schedules)), hw))
    return out


def _trace_passes(w: vp.Workload, p: int, hw) -> list[dict]:
    """Per rank, ``_passes``' every pass for one micro-batch of ``w``, each traced on its own (``estimate``)."""
    from toolkit.models.gpt import GPT, GPTConfig
    from toolkit.runtime.shapes import default_dtype, estimate
    cfg = GPTConfig(vocab_size=w.model.vocab, seq_len=w.seq_len, n_layer=w.layers, n_head=w.heads,
                    d_model=w.hidden, d_ff=w.model.ffn)

    def build(r: int):
        def made() -> dict:
            with default_dtype(torch.bfloat16):  # made in bf16 (a fake module cannot be converted after)
                idx = torch.zeros(w.micro_batch, w.seq_len, dtype=torch.long)  # ids and targets: values unread
                return _passes(GPT(cfg), idx, idx, r, p)
        return made

    def run(name: str):
        def step(fns: dict) -> None:
            with default_dtype(torch.bfloat16):  # the inputs a pass makes (blocks_F's h) in bf16 too
                fns[name]()
        return step

    layers = ("base_F", "base_FB", "blocks_F", "blocks_FB")
    vocab = ("input_F", "input_FB") + tuple(f"{x}{alg}" for alg in vp.ALGORITHMS for x in "ST")
    roles = sorted({0, min(1, p - 1), p - 1})  # first, a middle one, last
    traced = {(r, name): estimate(build(r), run(name), hw)
              for r in roles for name in layers + (vocab if r == 0 else ())}
    return [{**{name: traced[(r if r in roles else 1, name)] for name in layers},
             **{name: traced[(0, name)] for name in vocab}} for r in range(p)]


def _trace_comm(w: vp.Workload, p: int, hw) -> dict[int, list]:
    """Per algorithm, the collectives a cross-rank dependency of the vocabulary passes waits on, traced on the
    fake process group of ``p`` ranks: the broadcast of X, and C0 with Algorithm 2's fused dX or Algorithm 1's
    C1 (as the hook issues them, ``vocab_passes.VocabPasses``)."""
    from toolkit.runtime.shapes import estimate
    N, D, V = w.micro_batch * w.seq_len, w.hidden, w.model.vocab

    def state(alg: int):
        def made():
            x, weight = torch.empty(N, D, dtype=torch.bfloat16), torch.empty(V // p, D, dtype=torch.bfloat16)
            st = vp.s_pass(x, weight, torch.zeros(N, dtype=torch.long), 0, alg)
            st.alpha = torch.full_like(st.s, 1.0 / p)
            return st, (vp.t_pass(st, weight, 1.0, alg) if alg == 1 else None)  # Algorithm 1's dX_i
        return made

    def c0_and_dx(st: vp.SState, dx_i: torch.Tensor | None) -> None:
        vp.c0(st)
        if dx_i is None:
            vp.dx_fused(st, 1.0)
        else:
            dist.all_reduce(dx_i)  # C1

    bcast = estimate(lambda: torch.empty(N, D, dtype=torch.bfloat16), lambda x: dist.broadcast(x, src=p - 1), hw,
                     world_size=p)
    return {alg: [bcast, estimate(state(alg), c0_and_dx, hw, world_size=p)] for alg in vp.ALGORITHMS}
