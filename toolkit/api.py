"""The public API: what you import from ``toolkit`` for each technique, stated in one table.

``import toolkit`` is fast (nothing heavy is imported); each name below is imported on first use::

    from toolkit import launch, ZeroDataParallel, PipelineExecutor, pipeline_stages, dualpipev

Every entry says what it is, the shapes it takes and returns, what runs on every rank (collectives must be
called by all ranks of their group, in the same order), and a three-line example. ``toolkit.doc(name)``
prints an entry with the object's own docstring; ``tools/api_page.py`` writes them all to
``out/html/api.html``. The objects live in their technique modules (``where``); these names are the stable
way to reach them.
"""
from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass


@dataclass(frozen=True)
class Entry:
    name: str
    where: str  # "module:attribute"
    area: str
    what: str  # one line
    shapes: str
    ranks: str  # what runs on every rank
    example: str  # three lines

    def load(self):
        module, _, attr = self.where.partition(":")
        return getattr(importlib.import_module(module), attr)


AREAS = ["Launch and measure", "Data and tensor parallelism", "Pipeline parallelism", "Quantization and compressed "
         "communication", "Optimizers and memory", "Models and data", "Context parallelism", "Expert parallelism"]

ENTRIES: list[Entry] = [
    # ---- launch and measure ---------------------------------------------------------------------------------
    Entry("launch", "toolkit.runtime.launch:launch", AREAS[0],
          "Run fn(ctx, cfg) on N processes (accelerate launch; gloo on CPU, nccl on GPUs); one result per rank.",
          "cfg: a JSON-able dict; returns RankResults (a list, index = rank, plus .wall_s and .log)",
          "the launching process checks the arguments and the function; every rank then calls fn(ctx, cfg)",
          'def exp(ctx, cfg):\n    return {"rank": ctx.rank}\nresults = launch(exp, world_size=2)'),
    Entry("LaunchError", "toolkit.runtime.launch:LaunchError", AREAS[0],
          "A rank raised or crashed: the message names the root cause first (rank; exception, out of memory, signal "
          "or exit code), then the other ranks' failures; .rank is its rank, .traceback its traceback, .log the "
          "launcher log.",
          "-", "raised in the launching process; no rank is left",
          'try:\n    launch("my_module:exp", 2)\nexcept LaunchError as e:\n    print(e.rank, e.traceback)'),
    Entry("LaunchTimeout", "toolkit.runtime.launch:LaunchTimeout", AREAS[0],
          "The launch ran past timeout_s; .traceback holds the stack of every unfinished rank.",
          "-", "raised in the launching process; no rank is left",
          'try:\n    launch("my_module:exp", 2, timeout_s=30)\nexcept LaunchTimeout as e:\n    print(e.traceback)'),
    Entry("Context", "toolkit.runtime.context:Context", AREAS[0],
          "One rank's view: rank, world_size, device, backend, ledger, timeline, make_grid, phase/progress.",
          "-", "built by the rank process on every rank and passed as ctx; ctx.make_grid is collective",
          'def exp(ctx, cfg):\n    grid = ctx.make_grid(dp=2, tp=ctx.world_size // 2)\n'
          '    return {"tp_rank": grid.rank_in("tp"), "device": str(ctx.device)}'),
    Entry("CommLedger", "toolkit.runtime.ledger:CommLedger", AREAS[0],
          "Counts every torch.distributed call: op, group, bytes on the wire (textbook algorithm), seconds.",
          "bytes from tensor sizes, e.g. all_reduce of S bytes on n ranks: 2(n-1)/n * S sent",
          "installed on every rank as ctx.ledger; each rank counts its own calls",
          'with ctx.ledger.tag("grads"):\n    dist.all_reduce(g)\nsent = ctx.ledger.total("sent_bytes", tag="grads")'),
    Entry("MemoryTracker", "toolkit.runtime.memory:MemoryTracker", AREAS[0],
          "Live tensor bytes by category (param, grad, optim, act, comm, host) over time, from storages.",
          "samples: [{'t', 'label', 'param', 'grad', 'optim', 'act', 'comm', 'host', 'total'}]; peak by category",
          "local to each rank (no collectives); use it inside fn on every rank you want to measure",
          'with MemoryTracker(model, optimizer) as mem:\n    model(x).sum().backward(); mem.mark("backward")\n'
          'print(mem.peak, mem.samples[-1])'),
    Entry("Timeline", "toolkit.runtime.timeline:Timeline", AREAS[0],
          "Spans (kind, start, end, meta) on clocks aligned across ranks, for Gantt charts (toolkit.viz.gantt).",
          "to_json(): [{'rank', 'kind', 'start', 'end', 'meta'}], seconds since the launch barrier",
          "ctx.timeline on every rank; merge the ranks' to_json() lists in the notebook",
          'with ctx.timeline.span("forward", mb=0):\n    y = model(x)\nspans = ctx.timeline.to_json()'),
    Entry("measure", "toolkit.runtime.bench:measure", AREAS[0],
          "Time one step function: warm-up, rounds of timed steps, trimmed mean of round means, stability.",
          "returns BenchResult(mean_s, median_s, std_s, throughput_stability, round_means_s, step_times_s)",
          "local; call it on every rank (with a barrier inside step if ranks must line up)",
          'res = measure(lambda: model(x).sum().backward(), warmup=2, steps=5, rounds=3)\n'
          'print(res.mean_s, res.throughput_stability)\nrow = res.to_dict()'),
    Entry("compare", "toolkit.runtime.bench:compare", AREAS[0],
          "Time several candidates side by side, round-robin with a rotating order (same machine load for all).",
          "candidates: {name: step function}; returns {name: BenchResult}",
          "every rank calls it with the same candidates; sync=ctx.barrier lines the ranks up per block",
          'res = compare({"baseline": step_a, "technique": step_b}, warmup=1, steps=3, rounds=5,\n'
          '              sync=ctx.barrier)\nspeedup = res["baseline"].mean_s / res["technique"].mean_s'),
    Entry("verdict", "toolkit.runtime.bench:verdict", AREAS[0],
          "Is B faster than A? Faster / slower / within noise, from the paired rounds of a compare, with the interval.",
          "a, b: BenchResults (or to_dict(), or one per rank: each round's slowest); returns Verdict(word, ratio, "
          "low, high, rounds, paired, clock)",
          "in the notebook (or any process) on the results the ranks returned",
          'res = compare({"baseline": step_a, "technique": step_b}, sync=ctx.barrier)\n'
          'v = verdict(res["baseline"], res["technique"])\nprint(v.text())  # "technique 0.82x ...: faster"'),
    Entry("cluster", "toolkit.runtime.cluster:cluster", AREAS[0],
          "A target cluster for the emulator and the cost models: GPU, NVLink/IB/PCIe links, disk, placement.",
          "a preset name (h100-ib400, a100-ib200, pcie-100gbe) and fields to replace; returns a checked Cluster",
          "anywhere; launch(..., cluster=...) carries it to every rank",
          'c = cluster("h100-ib400", ranks_per_node=2)  # two nodes for a 4-rank launch\nprint(c.describe())\n'
          'launch("my_module:exp", 4, cluster=c)'),
    Entry("Emulator", "toolkit.runtime.emulator:Emulator", AREAS[0],
          "A rank's virtual clock on an emulated cluster: ops timed at the GPU's calibrated kernel rates, "
          "collectives as NCCL times them.",
          "ctx.emulator.now() in seconds; scaled(flops=, bytes=) times ops as a bigger model's; graph_replay(); "
          "paused() for sections that measure the real run only; report() per op and per transfer",
          "built on every rank by launch(..., cluster=); results stay bitwise those of the run without it",
          'def exp(ctx, cfg):\n    t0 = ctx.emulator.now(); step()\n'
          '    return {"step_on_h100_s": ctx.emulator.now() - t0}'),
    Entry("sensitivity", "toolkit.runtime.emulator:sensitivity", AREAS[0],
          "Re-time a recorded emulated run on other cluster figures by replay, without running it again: its value, "
          "the band over compute x0.7-1.3 and links x0.8-1.2, and a what-if grid.",
          "traces (Emulator.traces()), a Cluster, quantity(clocks) -> number or dict; grid {compute: [...], "
          "bandwidth: [...]}; returns value, band, low, high, grid, replays, wall_s",
          "any process, from the traces rank 0 gathered; inside a launch ctx.replay(quantity) runs it with progress",
          'traces = ctx.emulator.traces()  # on rank 0: every rank\'s ops and transfers\n'
          'out = sensitivity(traces, ctx.emulator.cluster, lambda clocks: replayed(clocks, "step"))\n'
          'print(out["low"], out["value"], out["high"])'),
    Entry("calibration_checks", "toolkit.runtime.calibration:checks", AREAS[0],
          "The cluster presets against published measurements (data/published/): per row, the model's figure and "
          "the measured one, within its bound, or why the row is not checked.",
          "returns list[Check] (table, what, hardware, measured, model, unit, bound, checked, reason, source); "
          "calibration.summary() per table",
          "anywhere, no launch; pytest -k calibration asserts every checked row",
          'rows = calibration_checks()\nprint(sum(r.checked for r in rows), "rows checked against", len(rows))'),
    Entry("Param", "toolkit.runtime.config:Param", AREAS[0],
          "One configuration knob: type, meaning, allowed range or choices; drives validation and bad-input tests.",
          "-", "used in the launching process by validate(cfg, world_size), before any rank starts",
          'PARAMS = {"steps": Param(int, "training steps", ge=1),\n'
          '          "mode": Param(str, "what to run", choices=("a", "b"))}\ncfg = resolve(cfg, PRESETS, PARAMS)'),
    Entry("resolve", "toolkit.runtime.config:resolve", AREAS[0],
          "{**PRESETS[cfg['preset']], **cfg} after checking every key and value (ValueError naming it).",
          "cfg: dict -> dict with every knob filled",
          "in the launching process (a module's validate runs before any rank starts)",
          'def validate(cfg, world_size):\n    cfg = resolve(cfg, PRESETS, PARAMS)\n    return cfg'),
    # ---- data and tensor parallelism ----------------------------------------------------------------------------
    Entry("ZeroDataParallel", "toolkit.parallel.zero:ZeroDataParallel", AREAS[1],
          "Data parallelism with ZeRO stage 0/1/2/3 around any nn.Module (units: its children with parameters).",
          "forward takes what the model takes; step() updates; memory_by_category() bytes at rest on this rank",
          "every rank of the dp group builds the same model (same seed) and calls forward/backward/step together",
          'zdp = ZeroDataParallel(model, stage=3)\nzdp(x).pow(2).mean().backward()\nzdp.step(); zdp.zero_grad()'),
    Entry("ColumnParallelLinear", "toolkit.parallel.tensor:ColumnParallelLinear", AREAS[1],
          "Megatron column-parallel Linear: this rank keeps out_features/tp rows of W; backward all-reduces dx.",
          "x [..., in] -> y [..., out/tp]", "every rank of the tp group (collective in backward)",
          'fc1 = ColumnParallelLinear.from_linear(mlp[0], group=grid.group("tp"))\n'
          'fc2 = RowParallelLinear.from_linear(mlp[2], group=grid.group("tp"))\ny = fc2(torch.relu(fc1(x)))'),
    Entry("RowParallelLinear", "toolkit.parallel.tensor:RowParallelLinear", AREAS[1],
          "Megatron row-parallel Linear: this rank keeps in_features/tp columns of W; forward all-reduces y.",
          "x [..., in/tp] -> y [..., out]", "every rank of the tp group (collective in forward)",
          'fc2 = RowParallelLinear.from_linear(linear, group=grid.group("tp"))\n'
          'y = fc2(x_shard)           # x_shard [..., in/tp], from a ColumnParallelLinear\ny.sum().backward()'),
    Entry("tensor_parallel_mlp", "toolkit.parallel.tensor:tensor_parallel_mlp", AREAS[1],
          "Shard an MLP with .fc1/.fc2 Linears in place: fc1 column-parallel, fc2 row-parallel.",
          "the MLP's shapes are unchanged: [..., D] -> [..., D]", "every rank of the tp group, in place",
          'grid = ctx.make_grid(tp=ctx.world_size)\ntensor_parallel_mlp(block.mlp, grid.group("tp"))\ny = block(x)'),
    # ---- pipeline parallelism -------------------------------------------------------------------------------
    Entry("make_schedule", "toolkit.pipeline.schedule:make_schedule", AREAS[2],
          "A schedule by name (gpipe, 1f1b, interleaved_1f1b, zb_h1, dualpipev): per-rank action lists, as data.",
          "p ranks, m micro-batches -> Schedule (n_stages, stages_of(rank), ranks[r] = [Action, ...], table())",
          "pure data: build the same schedule on every rank (and in the notebook to draw it)",
          's = make_schedule("dualpipev", p=4, m=8)\nprint(s.table())\nprint(s.stages_of(0))   # [0, 7]'),
    Entry("dualpipev", "toolkit.pipeline.schedule:dualpipev", AREAS[2],
          "DeepSeek's DualPipeV: 2p stages in a V (rank r holds stages r and 2p-1-r), F&B pairs, zero-bubble W.",
          "p ranks, m micro-batches (m >= 2p) -> Schedule", "pure data; the same on every rank",
          's = dualpipev(p=2, m=8)\nstages = pipeline_stages(layers, s, ctx.rank)\nexe = PipelineExecutor(s, ctx.rank, stages, loss_fn, act_shape)'),
    Entry("simulate", "toolkit.pipeline.simulate:simulate", AREAS[2],
          "Event-simulate a schedule from op costs: per-rank timelines, bubble, makespan, activation memory.",
          "Schedule, Costs(F, B, W, ...) or action -> seconds; returns SimResult (summary(), bubble_fraction)",
          "no processes (a cost model: label its results as simulated)",
          'sim = simulate(make_schedule("1f1b", 4, 8), Costs(F=1, B=2))\nprint(sim.summary())\n'
          'print(sim.bubble_fraction)'),
    Entry("Costs", "toolkit.pipeline.simulate:Costs", AREAS[2],
          "Durations of one action on one stage chunk (F, B, W, FB, R, comm), any time unit.",
          "-", "no processes", 'c = Costs(F=1.0, B=2.0, W=1.0, comm=0.1)\nsim = simulate(dualpipev(4, 8), c)\n'
          'print(sim.summary())'),
    Entry("pipeline_stages", "toolkit.pipeline.stages:pipeline_stages", AREAS[2],
          "Cut any list of layers (nn.Sequential, ModuleList, list) into a schedule's stages; this rank's ones.",
          "layers in order; returns {stage: nn.Sequential} sharing the layers' parameters",
          "every rank builds the same full model (same seed) and keeps its own stages",
          'layers = [nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(8)]\n'
          's = make_schedule("1f1b", p=2, m=4)\nmine = pipeline_stages(layers, s, ctx.rank)'),
    Entry("PipelineExecutor", "toolkit.pipeline.executor:PipelineExecutor", AREAS[2],
          "Run one rank's part of any schedule for real: isend/irecv between stages, loss/m, grads into .grad.",
          "modules {stage: module}; act_shape: every inter-stage activation's shape (one micro-batch); "
          "step(inputs [m x stage-0 input], targets [m x last-stage target]) -> mean loss on the last stage's rank",
          "every rank of the pipeline calls step() with the same schedule; each runs only its own actions",
          'exe = PipelineExecutor(s, ctx.rank, mine, loss_fn, act_shape=(8, 64), timeline=ctx.timeline)\n'
          'loss = exe.step(inputs, targets)     # lists of m micro-batches\nfor p in params: p.grad  # as one process'),
    Entry("ExecutorHook", "toolkit.pipeline.executor:ExecutorHook", AREAS[2],
          "One extension of PipelineExecutor: override the points you need (forward_context, before_backward, "
          "after_backward, after_op, after_action, step_begin/step_end, stage_fn, ops); the rest are no-ops.",
          "PipelineExecutor(..., hooks=[h1, h2]): called in list order going in, reverse order coming out",
          "the hooks of every rank's executor run on that rank, around its own ops",
          'class Count(ExecutorHook):\n    def after_op(self, a): self.n = getattr(self, "n", 0) + 1\n'
          'PipelineExecutor(s, ctx.rank, mine, loss_fn, act_shape, hooks=[Count()]).step(inputs, targets)'),
    Entry("with_recompute", "toolkit.pipeline.schedule:with_recompute", AREAS[2],
          "Checkpoint some forwards of a 1F1B/interleaved schedule; recompute inline or in the bubble (R actions). "
          "Policy 'cap' (at most keep held) or 'cooldown' (bubble-aware: backwards in the rank's cool-down).",
          "Schedule of F and B actions -> Schedule with .checkpointed and R actions (gradients bitwise unchanged)",
          "pure schedule arithmetic, the same on every rank; the executor runs it with hooks=[Recompute()]",
          's = with_recompute(interleaved_1f1b(4, 8, v=2), "bubble", policy="cooldown")\n'
          'print(s.table(), sorted(s.checkpointed))\nsimulate(s, Costs(0.5, 1, 0.5)).peak_mb'),
    Entry("VocabPasses", "toolkit.pipeline.vocab_passes:VocabPasses", AREAS[2],
          "Vocabulary parallelism run for real, as an executor hook: vocab_1f1b's S/T actions on every rank, C0 "
          "on a comm thread, every collective async in micro-batch order per group.",
          "VocabStage(model, rank, p) (its blocks + rows [lo, hi) of both tables); act_shape [B, T, D]; "
          "the executor's step(inputs, targets) -> mean loss on every rank",
          "every rank builds the groups (vocab_groups) and steps the same VocabSchedule",
          'stage = VocabStage(model, ctx.rank, ctx.world_size)\n'
          'hooks = [VocabPasses(stage, vocab_groups(list(range(ctx.world_size))))]\n'
          'loss = PipelineExecutor(vocab_1f1b(p, m, 2, costs), ctx.rank, {ctx.rank: stage}, None, (B, T, D), '
          'hooks=hooks).step(xs, ys)'),
    # ---- quantization and compressed communication ------------------------------------------------------------
    Entry("quantize_blockwise", "toolkit.quant:quantize_blockwise", AREAS[3],
          "Symmetric block-wise int8/int4 quantization: integer payload + one fp32 scale per block.",
          "x [any shape] -> Quantized(payload int8 [numel_padded] | uint8 [numel_padded/2], scales fp32 [blocks])",
          "local (no collectives)",
          'q = quantize_blockwise(x, bits=8, block=128)\nx_hat = dequantize_blockwise(q)\nprint(q.nbytes(), qsnr_db(x, x_hat))'),
    Entry("dequantize_blockwise", "toolkit.quant:dequantize_blockwise", AREAS[3],
          "Quantized -> tensor of the original shape (codes times their block scale).",
          "Quantized -> [shape] of dtype", "local", 'q = quantize_fp8_blockwise(x, block=128)\n'
          'x_hat = dequantize_blockwise(q, dtype=torch.bfloat16)\nerr = (x - x_hat).abs().max()'),
    Entry("quantize_fp8_blockwise", "toolkit.quant:quantize_fp8_blockwise", AREAS[3],
          "Block-wise FP8-E4M3: s = amax/448 per block; payload is the fp8 bits as uint8 (gloo can send it).",
          "x [any shape] -> Quantized(payload uint8 [numel_padded], scales fp32 [blocks])", "local",
          'q = quantize_fp8_blockwise(x)\nwire = q.payload            # uint8: sendable by every backend\n'
          'x_hat = dequantize_blockwise(q)'),
    Entry("fake_quantize", "toolkit.quant:fake_quantize", AREAS[3],
          "Quantize then dequantize in one call (int8, int4, fp8_e4m3): the error a format adds.",
          "x [any shape] -> same shape and dtype", "local",
          'y = fake_quantize(x, "fp8_e4m3", block=128)\nprint(qsnr_db(x, y))\nz = fake_quantize(x, "int4", block=32)'),
    Entry("qsnr_db", "toolkit.quant:qsnr_db", AREAS[3],
          "Quantization signal-to-noise ratio, 10 log10(|x|^2 / |x - x_hat|^2), in dB.",
          "two tensors of one shape -> float", "local",
          'x_hat = fake_quantize(x, "int8")\ndb = qsnr_db(x, x_hat)\nassert db > 30'),
    Entry("all_to_all_quantized", "toolkit.comm.quant_a2a:all_to_all_quantized", AREAS[3],
          "all_to_all_single of token rows with an int8/int4/bf16 payload and fp32 scales per block.",
          "x [T, H], in_splits[j] rows to rank j -> [sum(out_splits), H]",
          "collective over group: every rank calls it with matching splits (checked: a mismatch raises everywhere)",
          'y = all_to_all_quantized(x, in_splits=[2, 2], out_splits=[2, 2], mode="int8")\n'
          'ref = torch.empty_like(y); dist.all_to_all_single(ref, x, [2, 2], [2, 2])\nprint((y - ref).abs().max())'),
    Entry("reduce_scatter_tlq", "toolkit.comm.sdp4bit:reduce_scatter_tlq", AREAS[3],
          "SDP4Bit's two-level quantized reduce-scatter (Hadamard, 8-bit inside a node, 4-bit across nodes).",
          "g [N] (N divisible by world x 128) -> the mean of this rank's shard [N / world]",
          "collective over the topology's two groups: every rank calls it",
          'topo = make_topology(nodes=2)\nshard = reduce_scatter_tlq(g, topo)\n'
          'ref = reduce_scatter_fp32(g)             # the exact mean, to compare'),
    Entry("all_gather_qwd", "toolkit.comm.sdp4bit:all_gather_qwd", AREAS[3],
          "SDP4Bit's weight all-gather: 4-bit quantized differences between each owner's master shard and the "
          "replica; every rank applies the same ones, so replicas stay bitwise identical.",
          "replica [N] (updated in place and returned), master: this rank's shard [N / world]",
          "collective over group: every rank calls it with its own shard",
          'S = replica.numel() // dist.get_world_size()\nmaster = replica[rank * S:(rank + 1) * S].clone() - lr * g\n'
          'all_gather_qwd(replica, master)          # replica ~ concatenated masters (4-bit deltas)'),
    Entry("make_topology", "toolkit.comm.sdp4bit:make_topology", AREAS[3],
          "The intra-node and inter-node groups of nodes x ranks-per-node (emulated nodes on one machine).",
          "nodes must divide world_size", "collective (builds process groups): every rank calls it",
          'topo = make_topology(nodes=2, ledger=ctx.ledger)\nprint(topo)\nshard = reduce_scatter_tlq(g, topo)'),
    # ---- optimizers and memory ---------------------------------------------------------------------------------
    Entry("EDGCHook", "toolkit.comm.edgc_ddp:EDGCHook", AREAS[4],
          "EDGC (entropy-driven low-rank gradient compression) as a DDP comm hook: one EDGC stage per DDP bucket.",
          "any DDP-wrapped model; history[-1]: {'step', 'entropy', 'ranks'}",
          "every rank registers it on its DDP model; DDP calls it per bucket, in the same order on every rank",
          'ddp = DDP(model)\nddp.register_comm_hook(EDGCHook(EDGCConfig(warmup=10, window=10)), EDGCHook.hook)\n'
          'ddp(x).sum().backward()               # grads averaged, low-rank after the warm-up'),
    Entry("EDGCConfig", "toolkit.comm.edgc:EDGCConfig", AREAS[4],
          "EDGC's knobs: warm-up steps, window, entropy sampling rates, rank range and its sensitivity.",
          "-", "the same values on every rank",
          'cfg = EDGCConfig(warmup=20, window=20, r_init=4, r_min=1, r_max=16)\ncfg.validate()\n'
          'hook = EDGCHook(cfg)'),
    Entry("EDGC", "toolkit.comm.edgc:EDGC", AREAS[4],
          "EDGC without DDP: average parameter groups (e.g. pipeline stages) after backward, ranks from entropy.",
          "stages: [[params of stage 0], ...]; sync(step) -> {'step', 'entropy', 'ranks'}",
          "every rank of the data-parallel group calls sync(step) after backward",
          'edgc = EDGC([list(m[:2].parameters()), list(m[2:].parameters())], EDGCConfig(warmup=5, window=5))\n'
          'loss.backward(); edgc.sync(step)\nopt.step()'),
    Entry("PowerSGDReducer", "toolkit.comm.edgc:PowerSGDReducer", AREAS[4],
          "PowerSGD at a fixed rank per bucket (error feedback, warm start), equal to torch's powerSGD_hook.",
          "buckets: [[params]], ranks: [int | None]; reduce_() averages their .grad in place",
          "every rank of the group calls reduce_() after backward",
          'red = PowerSGDReducer([list(model.parameters())], [4])\nloss.backward(); red.reduce_()\nopt.step()'),
    Entry("ShardedDP", "toolkit.comm.sdp4bit:ShardedDP", AREAS[4],
          "SDP4Bit as the optimizer: ZeRO-style sharded AdamW over one flat buffer with 4-bit weight/gradient comm.",
          "any model; parameters become views of a flat [N_pad] buffer; step(i) returns the gradient shard",
          "every rank builds the same model and calls zero_grad / backward / step(i) together",
          'sdp = ShardedDP(model, SDPConfig(nodes=2), make_topology(2), lr=1e-3)\n'
          'sdp.zero_grad(); model(x).sum().backward()\nsdp.step(i)'),
    Entry("SDPConfig", "toolkit.comm.sdp4bit:SDPConfig", AREAS[4],
          "SDP4Bit's choices: weights (bf16, qwd, direct4, fp32), grads (bf16, tlq, fp32), groups, bits, nodes.",
          "-", "the same on every rank", 'cfg = SDPConfig(weights="qwd", grads="tlq", nodes=2)\n'
          'cfg.validate(world_size=4)\nsdp = ShardedDP(model, cfg, make_topology(2), lr=1e-3)'),
    Entry("ReuseAdamW", "toolkit.memory.param_reuse:ReuseAdamW", AREAS[4],
          "AdamW on bf16 parameters whose fp32 master is the bf16 weight + an int16 residual (4 B/param, not 6).",
          "bf16 parameters of any model; state: residual int16, exp_avg and exp_avg_sq fp32; master(p) -> fp32",
          "local (use it under any data parallelism)",
          'model = model.to(torch.bfloat16)\nopt = ReuseAdamW(model.parameters(), lr=1e-3)\n'
          'model(x).float().pow(2).mean().backward(); opt.step()'),
    Entry("MasterAdamW", "toolkit.memory.param_reuse:MasterAdamW", AREAS[4],
          "The baseline: bf16 parameters with a separate fp32 master each (rounding='away' is ReuseAdamW's reference).",
          "bf16 parameters; master(p) -> fp32", "local",
          'opt = MasterAdamW(model.parameters(), lr=1e-3, rounding="away")\n'
          'model(x).float().sum().backward(); opt.step()\nmaster = opt.master(next(model.parameters()))'),
    Entry("ActivationOffloader", "toolkit.memory.offload:ActivationOffloader", AREAS[4],
          "Pipeline-aware activation offload: saved tensors go to the host after their forward, come back one "
          "group ahead of their backward; policy 'all' works on any model, named kinds on the GPT's modules.",
          "modules {stage: module}; order [(op, (stage, mb, chunk))] of this rank; budget_bytes per forward "
          "(Megatron's per-rank budget: per_rank_budget(bytes one forward saves, order)); resident_bytes()",
          "local to each rank (it follows that rank's action order)",
          'off = ActivationOffloader({0: model}, [("F", (0, 0, 0)), ("B", (0, 0, 0))], policy="all")\n'
          'with off.forward((0, 0, 0)):\n    loss = model(x).sum()\n'
          'off.backward_begin((0, 0, 0)); loss.backward(); off.backward_end((0, 0, 0))'),
    Entry("Offload", "toolkit.memory.offload:Offload", AREAS[4],
          "The pipeline executor's hook for an ActivationOffloader, around every forward and backward; "
          "long_lived(order, k) picks the micro-batches worth offloading (backward more than k actions away).",
          "Offload(ActivationOffloader(modules, order, groups=long_lived(order, 1))), in PipelineExecutor's hooks",
          "every rank of the pipeline steps the same schedule; each offloads by its own action order",
          'order = schedule_order(s, ctx.rank)\noff = ActivationOffloader(mine, order, groups=long_lived(order, 1))\n'
          'PipelineExecutor(s, ctx.rank, mine, loss_fn, act_shape, hooks=[Offload(off)]).step(inputs, targets)'),
    Entry("OffloadAdamW", "toolkit.memory.optim_offload:OffloadAdamW", AREAS[4],
          "AdamW with its state in (pinned) host memory: 'cpu' = master+m+v and the gradients on the host (each "
          "sent down as backward produces it), host update (ZeRO-Offload); 'stream' = m, v streamed to the device "
          "per shard on a side stream.",
          "any parameters (e.g. ZeroDataParallel's shards); host_bytes(), moved_per_step [{'h2d', 'd2h'}]",
          "local to each rank (use it as ZeroDataParallel's optimizer)",
          'zdp = ZeroDataParallel(model, lambda ps: OffloadAdamW(ps, mode="cpu"), stage=3)\n'
          'zdp(x, y).backward()\nzdp.step()                       # no optimizer or gradient bytes on the device'),
    Entry("DiskAdamW", "toolkit.memory.nvme:DiskAdamW", AREAS[4],
          "AdamW with m, v (and ZeRO-3 shards, with DiskParams) in one pre-allocated, unlinked file per rank, "
          "streamed through buffer_count buffers of buffer_size elements (NVMe offload).",
          "any parameters; buffer_size a multiple of 1024; stats[-1]: bytes read/written, exposed I/O, AdamW time",
          "local to each rank (each rank has its own file)",
          'opt = lambda ps: DiskAdamW(ps, "/nvme", buffer_count=4, buffer_size=1 << 20)\n'
          'zdp = ZeroDataParallel(model, opt, stage=3)\nzdp(x, y).backward(); zdp.step()'),
    Entry("DiskParams", "toolkit.memory.nvme:DiskParams", AREAS[4],
          "ZeRO-3 parameter shards kept in a DiskAdamW's file: read before each all-gather, the next unit read ahead.",
          "a ZeroDataParallel(stage=3) whose optimizer is DiskAdamW(offload_params=True)",
          "local to each rank; the all-gathers stay collective",
          'zdp = ZeroDataParallel(model, lambda ps: DiskAdamW(ps, d, 2, 4096, offload_params=True), stage=3)\n'
          'DiskParams(zdp, zdp.optimizer)\nzdp(x, y).backward(); zdp.step()'),
    Entry("DiskSpill", "toolkit.memory.spill:DiskSpill", AREAS[4],
          "Saved activations (e.g. checkpointed segments' inputs) to a pre-allocated file-backed mapping, one "
          "region per saved storage, read back in backward.",
          "capacity in bytes (count with saved_activation_bytes); bytes_written, regions, verify()",
          "local",
          'spill = DiskSpill("/nvme", capacity)\nwith spill.hooks(list(model.parameters())):\n'
          '    loss = model(x, y)\nloss.backward(); spill.reset()'),
    Entry("SideChannel", "toolkit.comm.side_channel:SideChannel", AREAS[3],
          "Per-step values (top-k, metrics) to one rank on a gloo group of their own, non-blocking, waited later.",
          "post(t, label) any shape/device; collect(leave=n) -> {label: [tensor of each rank]} on dst",
          "collective construction (new_group); every rank posts the same shapes in the same order",
          'ch = SideChannel(dst=0)\nch.post(logits.topk(5, dim=-1).indices, label=step)\n'
          'got = ch.collect(leave=1)               # all but the newest post, long arrived'),
    Entry("shard_rows", "toolkit.pipeline.vocab_parallel:shard_rows", AREAS[4],
          "Vocabulary parallelism: the [lo, hi) rows of the output layer / embedding each of p ranks holds.",
          "V divisible by p -> (lo, hi)", "pure arithmetic, the same on every rank",
          'lo, hi = shard_rows(vocab_size=256, p=ctx.world_size, rank=ctx.rank)\n'
          'w = nn.Parameter(full_head.weight[lo:hi].detach().clone())    # [V/p, D]\nprint(lo, hi)'),
    Entry("s_pass", "toolkit.pipeline.vocab_parallel:s_pass", AREAS[4],
          "Vocabulary-parallel head, S pass: local logits and softmax statistics of this rank's rows.",
          "x [N, D], weight [V/p, D], target [N] -> SState (then c0 -> loss [N], dx_fused -> dX [N, D], t_pass -> dW)",
          "local; c0 and dx_fused are all-reduces every rank of the group calls",
          'st = s_pass(x, w, target, lo, algorithm=2)\nloss = c0(st).mean()             # per-token loss, all-reduced\n'
          'dx = dx_fused(st, 1 / len(target)); t_pass(st, w, 1 / len(target), algorithm=2)'),
    # ---- models and data --------------------------------------------------------------------------------------
    Entry("GPT", "toolkit.models.gpt:GPT", AREAS[5],
          "The toolkit's tiny pre-norm GPT (attention split into qkv/core/proj, optional MoE).",
          "idx [B, T] (, targets [B, T]) -> logits [B, T, V] (or the loss)", "local",
          'model = GPT(preset("smoke"))\nloss = model(x, y)\nloss.backward()'),
    Entry("model_spec", "toolkit.models.catalog:get", AREAS[5],
          "A real model's shapes by name (Llama 2 and 3, Mixtral, DeepSeek-V3, GPT-3): SwiGLU, GQA and experts "
          "counted in its parameters and FLOPs.",
          "model_spec('llama2-13b') -> ModelSpec: layers, hidden, heads, kv_heads, ffn, vocab, experts, top_k; "
          "params(), flops_per_token(seq_len)",
          "anywhere, no launch; the planner, the cost models and the workload-matched runs read the same catalog",
          'spec = model_spec("llama2-13b")\nprint(spec.params() / 1e9, "B parameters,", '
          'spec.flops_per_token(4096) / 1e9, "GFLOP per token")'),
    Entry("batches", "toolkit.data:batches", AREAS[5],
          "Real byte-level text (Python's standard library source), shipped with the project: (inputs, targets).",
          "yields x [batch_size, seq_len], y [batch_size, seq_len] (next bytes), vocabulary 256",
          "each rank takes its own slice of every global batch (rank=, world=)",
          'for x, y in batches(8, 64, steps=10, rank=ctx.rank, world=ctx.world_size):\n    loss = model(x, y)\n'
          '    loss.backward()'),
    # ---- context parallelism -----------------------------------------------------------------------------------
    Entry("ring_attention", "toolkit.context.ring_attention:ring_attention", AREAS[6],
          "Causal attention of packed sequences sharded over a CP group: K/V round the ring (isend/irecv overlapped "
          "with the block compute), online softmax; the backward runs the ring again (dK/dV travel home).",
          "q, k, v [heads, T_local, head_dim] in CPLayout local order -> [heads, T_local, head_dim]",
          "every rank of the CP group calls it with the same layout (p2p inside the group)",
          'layout = CPLayout([512, 128], cp=2)\nidx = layout.coords(rank_in_group)[2]       # my tokens of the pack\n'
          'out = ring_attention(q[:, idx], k[:, idx], v[:, idx], layout, group)'),
    Entry("CPLayout", "toolkit.context.ring_attention:CPLayout", AREAS[6],
          "Where packed sequences' tokens live in a CP group: rank j holds chunks j and 2cp-1-j of each sequence.",
          "lengths (each a multiple of 2*cp when cp > 1), cp -> coords(j): (sequence id, position, packed index)",
          "local (no collectives)",
          'layout = CPLayout([16, 8], cp=2)\nseq, pos, idx = layout.coords(0)\nprint(idx.tolist())'),
    Entry("schedule_dynamic", "toolkit.context.dynamic_cp:schedule_dynamic", AREAS[6],
          "Dynamic CP (Megatron's DefaultDynamicCPScheduler; with cost=, the toolkit's refill and merge steps, taken "
          "where the modelled time, ring included, goes down): per micro-batch, a CP size per sequence and aligned "
          "power-of-two CP groups of equal work L^2/cp.",
          "lengths [n], n_ranks (DP x CP, a power of two), cap tokens per rank, cost (a GroupCost, e.g. "
          "dcp_sim.CostModel(); None: Megatron's rules) -> Plan (micro-batches of groups)",
          "local and deterministic: every rank computes the same plan from the all-gathered lengths",
          'plan = schedule_dynamic([900, 300, 120, 40], n_ranks=4, cap=512)\nplan.check()\n'
          'print(plan.balance(), plan.cp_sizes())'),
    Entry("schedule_static", "toolkit.context.dynamic_cp:schedule_static", AREAS[6],
          "Static CP: one CP size, sequences packed (in data order, or longest first) up to cp*cap tokens per DP "
          "replica.",
          "lengths [n], n_ranks, cp, cap, order ('data' | 'length') -> Plan", "local and deterministic",
          'plan = schedule_static([900, 300, 120, 40], n_ranks=4, cp=2, cap=512)\nprint(plan.balance())'),
    Entry("reroute", "toolkit.context.dynamic_cp:reroute", AREAS[6],
          "Send every rank the CP shards of the sequences its groups hold, all micro-batches, one all_to_all_single.",
          "plan, owner[s] (loading rank), my samples {s: [L_s, C]} -> per micro-batch {rows, positions, layout, key}",
          "collective over the DP x CP ranks: every rank calls it with the same plan",
          'groups = prebuilt_groups(world)               # once, collective\nshards = reroute(plan, owner, mine, rank)\n'
          'mb = shards[0]; group = groups.get(mb["key"])'),
    # ---- expert parallelism ------------------------------------------------------------------------------------
    Entry("TokenDispatcher", "toolkit.moe.dispatcher:TokenDispatcher", AREAS[7],
          "MoE tokens to the ranks owning their experts and back (all_to_all_single with split sizes), autograd "
          "through both, payload codec none/bf16/int8/int4/fp8, optional dedup, capacity, async handles.",
          "plan(slot ids [T,K], weights [T,K], x) -> Plan; dispatch(x [T,H], plan) -> expert input [P,H] slot-major "
          "(split by plan.recv_counts); combine([P,H], plan) -> [T,H]",
          "plan, dispatch and combine are collective over the ep group (plan all-gathers the per-expert counts and "
          "raises the same ValueError on every rank)",
          'disp = TokenDispatcher(n_slots=8, top_k=2, codec="int8", combine_codec="bf16")\n'
          'plan = disp.plan(ids, weights, x)\n'
          'y = disp.combine(run_experts(experts, disp.dispatch(x, plan), plan.recv_counts), plan)'),
    Entry("ExpertParallelMoE", "toolkit.moe.layer:ExpertParallelMoE", AREAS[7],
          "The tiny GPT's MoE layer with its experts spread over an ep group; a placement hook and spare slots "
          "(e.g. for clones of hot experts).",
          "x [B,T,D] -> [B,T,D]; rank r keeps experts [r*E/ep, (r+1)*E/ep)", "every rank of the ep group calls it",
          'layer = ExpertParallelMoE(model.blocks[0].mlp, group=None, codec="bf16")\ny = layer(x)\n'
          'print(layer.last_plan.tokens_per_expert)'),
    Entry("expert_parallel", "toolkit.moe.layer:expert_parallel", AREAS[7],
          "Make every MoE layer of a GPT expert parallel in place; returns (replicated params, this rank's experts).",
          "model -> (list of params to average over ranks, list of expert params)",
          "every rank calls it on an identically initialised model",
          'torch.manual_seed(0)\nmodel = GPT(preset("smoke", n_expert=4))\n'
          'replicated, experts = expert_parallel(model, codec="int8")'),
    Entry("dispatch_layout", "toolkit.moe.dispatcher:dispatch_layout", AREAS[7],
          "DeepEP's get_dispatch_layout: tokens per rank / node / expert and the token-in-rank mask.",
          "ids [T,K], n_slots, n_ranks, ranks_per_node -> Layout", "local (no collectives)",
          'lay = dispatch_layout(ids, n_slots=16, n_ranks=4, ranks_per_node=2)\n'
          'print(lay.tokens_per_rank, lay.tokens_per_node)'),
    Entry("TwoHop", "toolkit.moe.deepep:TwoHop", AREAS[7],
          "DeepEP-style internode dispatch: once per remote node over the rdma group, then fan-out inside the node "
          "(nvl group); the combine reverses it.",
          "dispatch(x [T,H], slot ids [T,K], weights [T,K]) -> (expert input [P,H], handle); combine([P,H], handle) "
          "-> [T,H]",
          "the constructor creates the process groups (collective); dispatch and combine are collective",
          'hop = TwoHop(n_slots=16, ranks_per_node=2, codec="fp8")\nh, handle = hop.dispatch(x, ids, weights)\n'
          'y = hop.combine(h, handle)'),
    Entry("LowLatency", "toolkit.moe.deepep:LowLatency", AREAS[7],
          "DeepEP-style low-latency dispatch/combine: fixed receive buffers [local experts, max_tokens*R, H] with "
          "counts, and a receive hook that completes a transfer issued earlier.",
          "dispatch(x [T<=max_tokens,H], ids, weights, return_recv_hook) -> (recv_x, recv_count, handle, hook)",
          "dispatch and combine are collective over the group",
          'll = LowLatency(n_slots=16, max_tokens=64, codec="fp8", combine_codec="bf16")\n'
          '_, _, handle, hook = ll.dispatch(x, ids, weights, return_recv_hook=True)\nrecv_x, count = hook()'),
    Entry("moe_overlap_step", "toolkit.moe.overlap:step", AREAS[7],
          "One training step of an expert-parallel MoE GPT over micro-batches, serial or overlapped (one micro-batch's "
          "dispatch/combine in flight while the other computes; backward interleaved by autograd).",
          "model, [(idx [B,T], targets [B,T]), ...], schedule 'serial' | 'overlapped' -> per-micro-batch losses "
          "(gradients accumulated)",
          "every rank of the ep group calls it with the same schedule and number of micro-batches",
          'expert_parallel(model)\nlosses = moe_overlap_step(model, [(x[::2], y[::2]), (x[1::2], y[1::2])], "overlapped")\n'
          'optimizer.step()'),
    Entry("Echo", "toolkit.moe.echo:Echo", AREAS[7],
          "ECHO hot-expert cloning on an ExpertParallelMoE with spare slots: plans clones each forward (greedy, the same "
          "on every rank), copies the weights into spare slots, places tokens on home and clones; reduce_grads() sends "
          "clone gradients home.",
          "installed as layer.place: expert ids [T,K] -> slot ids [T,K]; last_plan: ClonePlan (loads before/after)",
          "collective: the forward all-gathers counts and all-to-alls weights; reduce_grads() after backward on every rank",
          'layer = ExpertParallelMoE(moe, spare_slots=1)\necho = Echo(layer)\n'
          '(layer(x) * g).sum().backward(); echo.reduce_grads()'),
    Entry("plan_clones", "toolkit.moe.echo:plan_clones", AREAS[7],
          "ECHO's greedy planner (pure, integers): spill of over-loaded ranks' hot experts onto spare slots of "
          "under-loaded ranks by interval overlap; one expert per slot, budget, reclaim of small clones.",
          "counts [R, E] (pairs per source rank per expert), local, spare_slots -> ClonePlan (split(e): the pairs "
          "each source sends home and to each clone)", "local (no collectives)",
          'plan = plan_clones([[10, 50, 5, 5], [0, 30, 5, 15]], local=2, spare_slots=1)\n'
          'print(plan.load_before, plan.load_after, plan.clones)'),
]
BY_NAME = {e.name: e for e in ENTRIES}


def signature(obj) -> str:
    """``name(args)`` of a function or a class's constructor (empty when Python cannot tell)."""
    try:
        return f"{obj.__name__}{inspect.signature(obj)}"
    except (TypeError, ValueError):
        return getattr(obj, "__name__", "")


def describe(name: str) -> str:
    """The entry of ``name`` and the object's own docstring, as text."""
    if name not in BY_NAME:
        raise ValueError(f"{name!r} is not in the public API; names: {sorted(BY_NAME)}")
    e = BY_NAME[name]
    obj = e.load()
    example = "\n".join("    " + line for line in e.example.splitlines())
    return (f"{signature(obj)}\n    ({e.where.replace(':', '.')})\n\n{e.what}\n\nshapes:    {e.shapes}\n"
            f"every rank: {e.ranks}\n\nexample:\n{example}\n\n{inspect.getdoc(obj) or ''}")


def overview() -> str:
    """One line per public name, grouped by area (used in ``toolkit``'s docstring)."""
    lines = []
    for area in AREAS:
        lines.append(f"\n{area}:")
        lines += [f"    {e.name:<24} {e.what}" for e in ENTRIES if e.area == area]
    return "\n".join(lines)
