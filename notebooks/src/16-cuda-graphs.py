# %% [markdown]
# # 16 · CUDA graphs with DualPipeV, and the data-parallel all-reduce kept outside them
#
# **The question.** A training step of a small or finely split model launches tens of thousands of small
# kernels; each costs the host Python, dispatcher and launch time, and whenever the host falls behind the
# GPU, the GPU waits. A CUDA graph records a region's kernels once and replays them with one launch. The
# source article combines it with DualPipeV and "data-parallel separation", and says the DualPipeV version
# is still in progress (1F1B + CUDA graphs + DP separation works). What does a graph remove, what does it
# forbid, and why must the data-parallel gradient all-reduce stay outside the captured region?
#
# ## The idea
#
# ```
#  eager     host │py·dispatch·launch│py·dispatch·launch│ ... N_ops times per chunk
#            GPU        └─ k1 ─┘            └─ k2 ─┘           idle while the host is behind
#  graphed   host │replay│
#            GPU     └k1┘└k2┘└k3┘└k4┘ ...                     the same kernels, back to back
#
#  model per chunk:   eager ≈ max(T_device, N_ops · t_op)        graphed ≈ max(T_device, t_replay)
# ```
#
# A graph replays *exactly* what it recorded: the same shapes, the same buffers (inputs are copied into
# its static buffers), no value read back by the host in between, and any collective on the communicator
# it was captured with. Megatron therefore captures per layer and per in-flight micro-batch, keeps the MoE
# dispatch (data-dependent shapes) eager, silences DDP's gradient-ready hooks during capture, and issues
# the data-parallel reduce itself after the replays — the "separation". In a pipeline the stage's
# gradients are final after its *last* backward of the step, so the reduce of one stage can run while the
# schedule still computes the others; and inside that last backward the gradients come out layer by layer,
# last layer first, so the reduce can leave bucket by bucket while the rest of the backward runs:
#
# ```
#  DualPipeV rank r holds stages r and 2p−1−r:
#  compute  ... B(2p−1−r, last) ... B(r, last)  W ...            (graphs: one per chunk and pass)
#  DP comm                     └─ all-reduce(stage 2p−1−r) ──┘└─ all-reduce(stage r) ─┘
#                                                                      (eager, async)
#  bucketed, inside the last W of stage r:   dW(fc2) dW(fc1) dW(proj) dW(qkv) ─┐
#                                               └─ bucket 1 ─┘└─ bucket 2 ─┘ ... └─ last bucket ─┘
# ```
#
# This machine has no GPU, so nothing is captured here. We measure what a graph would remove (ATen ops
# per chunk and the host's real cost per op), find what would break a capture, and run DualPipeV on
# dp × pp processes with the DP all-reduce separated per stage and bucket by bucket, against the plain one
# after the step.
# `benchmarks/gpu/cuda_graphs.py` does the capture on a GPU, but on a sequential chain of stages with one
# micro-batch in flight, not inside DualPipeV: see "What runs where" at the end.

# %% tags=["parameters"]
import os
from typing import Optional

world_size: int = 4
pp: Optional[int] = None  # pipeline ranks, the data-parallel size world_size // pp (None: the preset's)
n_layer: Optional[int] = None  # None: the preset's; DualPipeV needs a multiple of 2·pp
m: Optional[int] = None  # micro-batches per replica, DualPipeV needs at least 2·pp (None: the preset's)
preset: str = os.environ.get("TOOLKIT_PRESET", "default")  # smoke | default | full
backend: str = "auto"  # auto | gloo | nccl
cluster: str = "h100-ib400"  # emulated cluster (pp ranks per node): h100-ib400 | a100-ib200 | pcie-100gbe | none
micro_batch: Optional[int] = None  # sequences per micro-batch (None: the preset's)
timeout_s: int = 600

# %%
import inspect

from IPython.display import Markdown, display

from toolkit import launch, viz
from toolkit.graphs import cuda_graphs, replay_model
from toolkit.lessons import l16_cuda_graphs as lesson
from toolkit.pipeline import dp_separate
from toolkit.report import band, headline
from toolkit.runtime.bench import check, not_decidable
from toolkit.runtime.bench import verdict

# %% [markdown]
# ## 1 · The code that matters
#
# Counting ops: a `TorchDispatchMode` sees every ATen op of the forward and, run around `backward()`, every op
# autograd runs for it — the ops a graph would replay without the host.

# %%
print(inspect.getsource(cuda_graphs.OpCounter))

# %% [markdown]
# Separating the DP all-reduce: the `DataParallelSeparation` hook's `after_op` fires after every single op; when it
# is the last B, I or W of a stage on this rank, that stage's gradients are final and their all-reduce leaves
# (`async_op=True`). The step waits for all of them at its end. "Plain" issues the same all-reduces, on the
# same buffers, after the step. "Bucketed" cuts the stage's parameters, in reverse order, into buckets of
# `bucket_bytes`; around the stage's last gradient op (`op_context`) every parameter that op writes reports its
# final gradient — a post-accumulate-grad hook for what autograd accumulates, the `WeightGradStore`'s
# `grad_ready` for the weight gradients a W runs — and each bucket leaves as soon as it is complete.

# %%
print(inspect.getsource(dp_separate.DataParallelSeparation.after_op))
print(inspect.getsource(dp_separate.DataParallelSeparation._bucketing))
print(inspect.getsource(dp_separate.last_grad_ops))

# %% [markdown]
# ## 2 · The run
#
# `l16_cuda_graphs` on `world_size` processes: a grid of dp × pp (`pp` pipeline ranks, `world_size // pp`
# replicas), DualPipeV over the pp ranks of each replica, each replica on its own micro-batches of real text.

# %%
run_cfg = {"preset": preset, "pp": pp, "dp": None if pp is None else max(1, world_size // pp), "n_layer": n_layer,  # None: the preset's
           "m": m, "micro_batch": micro_batch}
cfg = lesson.validate(run_cfg, world_size)  # a bad combination stops here, before any process starts
from toolkit.runtime.cluster import cluster as make_cluster

# the grid's ranks run dp fastest (a replica's pp ranks are dp apart), so nodes of dp ranks hold the replicas of
# one pipeline stage: the DP all-reduce stays in a node, the pipeline's p2p crosses nodes
target = None if cluster == "none" else make_cluster(cluster, ranks_per_node=cfg["dp"])
results = launch("l16_cuda_graphs", world_size, run_cfg, backend=backend, timeout_s=timeout_s, cluster=target)
r0 = results[0]
where = (f"this CPU ({len(results)} ranks sharing {os.cpu_count()} cores)" if r0["device"] == "cpu"
         else f"{r0['device']} (one device per rank)")
print(f"dp = {r0['dp']} × pp = {r0['pp']}, m = {r0['m']} micro-batches per replica, {r0['model']['n_layer']} layers, "
      f"d_model {r0['model']['d_model']}; wall {results.wall_s:.1f} s")

# %% [markdown]
# **Checks.**
# - Separated and plain DP communication give *bitwise* the same gradients and loss (the same all-reduces
#   of the same buffers; only their timing differs). Bucketed cuts the buffers differently: bitwise the same
#   at dp = 2 (each element's sum has two terms, one order), within float rounding beyond.
# - All three equal one process that runs all dp·m micro-batches (max |gradient difference| ≤ 1e-5), and the
#   mean of the replicas' losses equals its loss (≤ 1e-5).
# - All three send the same bytes: per rank, the DP all-reduce of its two stages' gradients and the same p2p;
#   bucketed in more calls.

# %%
last = [r for r in results if r["runs"]["plain"]["loss"] is not None]  # the ranks computing the loss
for r in results:
    assert r["grads_bitwise_plain_vs_separated"] and r["losses_equal"], r["rank"]
    assert r["grads_bitwise_plain_vs_bucketed"] or r["dp"] > 2, r["rank"]
    for name in lesson.VARIANTS:
        assert r["runs"][name]["grad_max_diff"] <= 1e-5, (r["rank"], name)
        assert r["runs"][name]["dp_bytes"] == r["runs"]["plain"]["dp_bytes"] > (0 if r["dp"] > 1 else -1)
        assert r["runs"][name]["p2p_bytes"] == r["runs"]["plain"]["p2p_bytes"]
    assert len(r["runs"]["bucketed"]["reduces"]) > len(r["runs"]["separated"]["reduces"]) == len(r["stages"])
mean_loss = sum(r["runs"]["separated"]["loss"] for r in last) / len(last)
assert len(last) == r0["dp"] and abs(mean_loss - r0["ref_loss"]) <= 1e-5

# %%
# NBVAL_CHECK_OUTPUT
print("gradients bitwise equal, separated vs plain:", [r["grads_bitwise_plain_vs_separated"] for r in results])
print("gradients bitwise equal, bucketed vs plain:", [r["grads_bitwise_plain_vs_bucketed"] for r in results])
for r in results:
    print(f"rank {r['rank']} (pp {r['pp_rank']}, dp {r['dp_rank']}) stages {r['stages']}: DP all-reduce "
          f"{r['runs']['separated']['dp_bytes']:,} B sent, p2p {r['runs']['separated']['p2p_bytes']:,} B, "
          f"reduces per stage {[(x['stage'], x['bytes']) for x in r['runs']['separated']['reduces']]}, "
          f"buckets (stage, bytes) {[(x['stage'], x['bytes']) for x in r['runs']['bucketed']['reduces']]}")

# %% [markdown]
# ## 3 · Where the all-reduce runs: one traced step
#
# Per rank, the pipeline's ops (F, B, I, W; F&B pairs are drawn as their two halves) and, on the `dp` row,
# each stage's (or bucket's) all-reduce from its issue to the first action boundary at which it was seen
# complete (an upper bound of its end).

# %%
for name in lesson.VARIANTS:
    spans = [s for r in results for s in r["traced"][name]["spans"]]
    display(viz.gantt(spans, title=f"DualPipeV, DP all-reduce {name}", lane="lane", label="mb"))

# %%
rows = []
for r in results:
    for name in lesson.VARIANTS:
        t = r["traced"][name]
        rows.append({"rank": r["rank"], "variant": name, "traced step (ms)": t["step_s"] * 1e3,
                     "waited for DP at the end (ms)": t["waits_s"] * 1e3,
                     "issued before the end (ms), per stage": ", ".join(
                         f"{x['stage']}: {x['before_end_s'] * 1e3:.1f}" for x in t["reduces"]),
                     "bench step (ms)": r["bench"][name]["mean_s"] * 1e3})
display(viz.table(rows, title=f"Step time and the exposed DP wait (measured on {where}; timings are noisy)",
                  formats={k: ".2f" for k in rows[0] if k.endswith("(ms)")}))

# %% [markdown]
# How much of the schedule is left to hide a stage's all-reduce behind? The position of each stage's last
# gradient op in its rank's op list (rank 0 of DualPipeV, from the schedule alone), for a few pipeline sizes:

# %%
# NBVAL_CHECK_OUTPUT
from toolkit.pipeline import make_schedule

for p in (2, 4, 8):
    s = make_schedule("dualpipev", p, 2 * p)
    last, n = dp_separate.last_grad_ops(s, 0), sum(len(a.parts) for a in s.ranks[0])
    print(f"p = {p}, m = {2 * p}: rank 0 has {n} ops; " + ", ".join(
        f"stage {st} done after op {i + 1} ({n - i - 1} ops left)" for st, i in sorted(last.items(), key=lambda x: x[1])))

# %% [markdown]
# ## 4 · What a graph would remove: ops and host cost per chunk
#
# For each stage a rank holds: ATen ops of one micro-batch's forward and backward, the chunk's time at the
# run's shape, and at one token, where the kernels do almost nothing: that time divided by the op count is
# the host's real cost per op on this machine (Python, dispatcher, autograd, allocator) — the part a graph
# replay removes (on a GPU the kernel launch itself adds to it; there the chunk is timed with a synchronize
# before and after each pass). Every ATen op costs the host a dispatch, but views (`t`, `view`, `transpose`,
# `detach`, ...) and empty allocations launch no kernel: "compute ops" counts the rest, about one kernel
# launch each on a GPU (the GPU check sets the profiler's `cudaLaunchKernel` count beside it).

# %%
chunks, op_rows = [], []
for r in results:
    if r["dp_rank"]:
        continue  # replicas run the same stages
    for s, c in r["chunks"].items():
        for pass_ in ("forward", "backward"):
            n, n_tiny = c["ops"][pass_], c["tiny_ops"][pass_]
            t_op = c["tiny_time_s"][f"{pass_}_s"] / n_tiny
            chunks.append({"stage": int(s), "pass": pass_, "ATen ops": n, "compute ops": c["compute_ops"][pass_],
                           "host µs per op": t_op * 1e6,
                           "host cost (ms)": n * t_op * 1e3, "chunk time (ms)": c["time_s"][f"{pass_}_s"] * 1e3,
                           "host share": min(1.0, n * t_op / c["time_s"][f"{pass_}_s"])})
chunks.sort(key=lambda x: (x["stage"], x["pass"]))
display(viz.table(chunks, title=f"Per chunk (one micro-batch), measured on {where}",
                  formats={"host µs per op": ".1f", "host cost (ms)": ".3f", "chunk time (ms)": ".3f",
                           "host share": ".2f"}))
display(viz.bars([{"stage": f"stage {x['stage']}", "pass": x["pass"], "ops": x["ATen ops"]} for x in chunks],
                 x="stage", y="ops", color="pass", title="ATen ops per micro-batch and chunk", text_format="d"))

# %%
# NBVAL_CHECK_OUTPUT
per_mb, per_mb_compute = sum(x["ATen ops"] for x in chunks), sum(x["compute ops"] for x in chunks)
print("ATen ops per micro-batch, forward + backward, by stage:",
      {x["stage"]: sum(y["ATen ops"] for y in chunks if y["stage"] == x["stage"]) for x in chunks})
print("  of them compute ops (not views or empty allocations):",
      {x["stage"]: sum(y["compute ops"] for y in chunks if y["stage"] == x["stage"]) for x in chunks})
print(f"whole pipeline, one micro-batch: {per_mb} ATen ops, {per_mb_compute} compute ops; one step of {r0['m']} "
      f"micro-batches × dp {r0['dp']}: {per_mb * r0['m'] * r0['dp']} ATen ops whose host dispatch a graph replay "
      f"skips, {per_mb_compute * r0['m'] * r0['dp']} of them compute ops (about one kernel launch each on a GPU)")

# %% [markdown]
# **The replay model** (a model, not a measurement: no graph runs here). With the measured op counts and host
# cost per op, and a replay costing what one eager op costs on this host (an assumption), the speed-up of a
# chunk as a function of its device time: launch-bound chunks (left) gain up to N_ops×, compute-bound ones
# (right of N_ops · t_op) nothing.

# %%
import math

series, xs = {}, [10 ** (k / 4) for k in range(-8, 17)]  # device time per chunk, µs
for x in chunks:
    if x["stage"] in (0, 1):
        t_op = x["host µs per op"] * 1e-6
        series[f"stage {x['stage']} {x['pass']} ({x['ATen ops']} ops)"] = [
            replay_model(x["ATen ops"], t_op, t_dev * 1e-6, t_op)["speedup"] for t_dev in xs]
display(viz.lines(series, x=xs, title="Modelled speed-up of replaying a chunk as a graph (model)",
                  xaxis_title="device time of the chunk (µs)", yaxis_title="eager / graphed", log_x=True, log_y=True))
host = {x["stage"]: 0.0 for x in chunks}
for x in chunks:
    host[x["stage"]] += x["host cost (ms)"]
step_ms = r0["bench"]["separated"]["mean_s"] * 1e3
rank0_host = sum(host[s] for s in r0["stages"]) * r0["m"]
display(Markdown(
    f"On {where} the host cost per op measured {min(x['host µs per op'] for x in chunks):.1f}–"
    f"{max(x['host µs per op'] for x in chunks):.1f} µs; rank 0's two stages spend about {rank0_host:.1f} ms of "
    f"host time per step on them ({r0['m']} micro-batches), against a measured step of {step_ms:.1f} ms: the "
    f"most a replay could remove here (model). The crossover of the model — where the device time equals "
    f"N_ops · t_op — is {min(x['host cost (ms)'] for x in chunks) * 1e3:.0f}–"
    f"{max(x['host cost (ms)'] for x in chunks) * 1e3:.0f} µs per chunk: a chunk whose kernels take less device "
    f"time than that is launch-bound, and only such chunks gain from a graph."))

# %% [markdown]
# ## 5 · What capture requires, checked
#
# Each candidate region run under `toolkit.graphs.audit`, a dispatch mode that flags the ops a capture
# cannot hold (data-dependent shapes, host reads) and the collectives, which NCCL *can* capture but which
# Megatron keeps out of its graphs by choice: issued eagerly, the DP reduce starts bucket by bucket as the
# backward makes the gradients and overlaps the rest of it; inside a chunk's graph it could only start when
# the whole chunk had replayed, and DDP's gradient-ready hooks would fire once per capture, not per replay.

# %%
# NBVAL_CHECK_OUTPUT
for region, found in r0["audit"].items():
    print(f"{region:38s} {'capturable' if not found else ''}")
    for op, why in found.items():
        print(f"    {op:28s} {why}")

# %%
assert r0["audit"]["dense stage: forward + backward"] == {}
assert "aten.nonzero" in r0["audit"]["MoE block: forward + backward"]
assert "c10d.allreduce_" in r0["audit"]["DP gradient all-reduce"]
assert "aten._local_scalar_dense" in r0["audit"]["the loss read on the host (.item())"]

# %% [markdown]
# ## 5b · On an emulated H100 cluster: the launches a graph removes, and the DP reduce
#
# The launch also ran on an **emulated cluster** (the `cluster` parameter; `toolkit.runtime.emulator`,
# checked in lesson 00): every ATen op timed at what the target GPU's kernels achieve (a floor per kernel), on a
# stream that runs what a host issues — and the host pays its time per eager op. With kernels as small as this
# model's, the host is
# the bottleneck: the stream waits for the next launch. Each variant ran one more DualPipeV step there,
# eager and with every op (each F, B, I, W chunk) replayed as one CUDA graph (the `GraphReplay` executor hook:
# one launch per chunk), and the DP all-reduce plain, separated or bucketed (bucketed eager only: inside one
# chunk's graph no bucket could leave before the chunk's replay ends). The step, the host's launch time inside
# it, and the time the step's end waited for the DP all-reduces are all virtual time (a model, labelled). The
# data-parallel groups sit on one node and the pipeline spans two (`ranks_per_node = dp`).

# %%
E = r0["emulated"]
if E is None:
    display(Markdown("This run had no emulated cluster (`cluster = none`)."))
else:
    erows = []
    for label in E["runs"]:
        per = [r["emulated"]["runs"][label] for r in results]
        erows.append({"variant": label, "step (µs, slowest rank)": max(x["step_s"] for x in per) * 1e6,
                      "host launches (µs, rank 0)": per[0]["launch_s"] * 1e6,
                      "launch share of the step (rank 0)": per[0]["launch_s"] / per[0]["step_s"],
                      "DP wait at the end (µs, worst rank)": max(x["dp_wait_s"] for x in per) * 1e6})
    display(viz.table(erows, title=f"One DualPipeV step on the emulated {E['gpu']} (virtual time; DP reduce on "
                                   f"{E['dp_link']})",
                      formats={k: ".1f" if "µs" in k else ".2f" for k in erows[0] if k != "variant"}))
    display(viz.bars([{"variant": x["variant"], "µs": x["step (µs, slowest rank)"]} for x in erows], x="variant",
                     y="µs", text_format=".0f", title=f"Step time on the emulated {E['gpu']} (virtual time)"))
    em = {x["variant"]: x for x in erows}
    graph_gain = em["eager · plain"]["step (µs, slowest rank)"] / em["graphed · plain"]["step (µs, slowest rank)"]
    dp_plain, dp_sep = em["graphed · plain"]["DP wait at the end (µs, worst rank)"], \
        em["graphed · separated"]["DP wait at the end (µs, worst rank)"]
    toy_wait = {v: em[f"eager · {v}"]["DP wait at the end (µs, worst rank)"] for v in lesson.VARIANTS}
    display(Markdown(
        f"- Eager, the host's launches are {em['eager · plain']['launch share of the step (rank 0)']:.0%} of rank 0's "
        f"step: the stream idles between kernels that take less than a launch.\n- Replaying each chunk as one graph "
        f"shortens the step {graph_gain:.1f}× on this model (the host then pays "
        f"{em['graphed · plain']['host launches (µs, rank 0)']:.0f} µs of launches).\n- The DP all-reduce left for "
        f"the end of the step keeps the step waiting up to {dp_plain:.1f} µs; separated, issued as each stage's "
        f"gradients are final, {dp_sep:.1f} µs.\n- Eager, bucketed waits up to {toy_wait['bucketed']:.1f} µs against "
        f"{toy_wait['separated']:.1f} µs separated and {toy_wait['plain']:.1f} µs plain: this toy's gradients are "
        "a few kilobytes, so every all-reduce costs its latency α and more buckets only add calls.\n\nThese kernels "
        "are tiny: a real model's chunks are long against a launch, and there the graph's gain shrinks to what "
        "the host cost per op was."))

# %% [markdown]
# ## 5c · The DP reduce at a real layer's size (emulated)
#
# Whether a reduce hides depends on how long the gradients take on the link against the compute left after
# them, which the toy's sizes do not show. So the three variants ran once more on the emulated cluster, eager,
# **matched** to a real model: every toy layer timed as one layer of the model named below (its GEMM FLOPs
# and the activations between stages, `matched.matched_scales`; the gradients as that layer's weights) — a
# model of the real run, labelled, not a measurement. Per rank, the time the step's end waited for the DP
# all-reduces, per stage.

# %%
if E is not None:
    M = E["matched"]
    mrows = []
    for r in results:
        if r["dp_rank"]:
            continue  # replicas wait alike
        done_first, done_last = str(max(r["stages"])), str(min(r["stages"]))  # the phase-1 chunk, the phase-0 chunk
        for v in lesson.VARIANTS:
            x = r["emulated"]["matched"]["runs"][v]
            mrows.append({"pipeline rank": r["pp_rank"], "stages": f"{done_first}, {done_last}", "variant": v,
                          "step (ms)": x["step_s"] * 1e3, "DP wait (ms)": x["dp_wait_s"] * 1e3,
                          "of it: the stage done first (ms)": x["dp_wait_by_stage"][done_first] * 1e3,
                          "of it: the stage done last (ms)": x["dp_wait_by_stage"][done_last] * 1e3,
                          "all-reduces": x["reduces"]})
    display(viz.table(mrows, title=f"DualPipeV step matched to {M['stands_for']}'s layers on the emulated {E['gpu']} "
                                   f"(virtual time, a model)",
                      formats={k: ".3f" for k in mrows[0] if k.endswith("(ms)")}))
    w0 = {v: r0["emulated"]["matched"]["runs"][v] for v in lesson.VARIANTS}
    first = str(min(r0["stages"]))
    last_op = r0["last_grad_op"][first] + 1
    wall = {v: verdict([r["bench"]["plain"] for r in results], [r["bench"][v] for r in results])
                              for v in lesson.VARIANTS[1:]}
    sep_wait = w0["separated"]["dp_wait_by_stage"][first]
    hidden = (f" ({1 - w0['bucketed']['dp_wait_by_stage'][first] / sep_wait:.0%} of the separated wait hidden)"
              if sep_wait > 0 else "")
    display(Markdown(
        f"**Stage {first} at pp = {r0['pp']}** (emulated, matched to {M['stands_for']}):\n\n- its last gradient op is "
        f"op {last_op} of {r0['n_ops']} on pipeline rank 0, the rank's last. The step waited for its all-reduce "
        f"{w0['separated']['dp_wait_by_stage'][first] * 1e3:.3f} ms separated per stage, "
        f"{w0['plain']['dp_wait_by_stage'][first] * 1e3:.3f} ms plain (for its part).\n"
        f"- Stage {max(r0['stages'])}'s chunk finishes first: the wait for its reduce is "
        f"{w0['plain']['dp_wait_by_stage'][str(max(r0['stages']))] * 1e3:.3f} ms plain, "
        f"{w0['separated']['dp_wait_by_stage'][str(max(r0['stages']))] * 1e3:.3f} ms separated.\n- Bucketed, stage "
        f"{first}'s buckets leave inside its last W as its weight gradients come out, and its wait is "
        f"{w0['bucketed']['dp_wait_by_stage'][first] * 1e3:.3f} ms{hidden}.\n"
        f"- Rank 0's whole DP wait: plain {w0['plain']['dp_wait_s'] * 1e3:.3f}, separated "
        f"{w0['separated']['dp_wait_s'] * 1e3:.3f}, bucketed {w0['bucketed']['dp_wait_s'] * 1e3:.3f} ms.\n- What is "
        f"left at the end is the last bucket's reduce, less whatever the averaging of the earlier buckets covers "
        f"(here each bucket is flattened and copied back, HBM work that Megatron's contiguous gradient buffer "
        f"does not have).\n\nOn {where} the step itself (wall, trimmed mean, slowest rank): "
        + "; ".join(f"{v}: {wall[v].text('plain', v)}" for v in wall)
        + f" — four ranks on {os.cpu_count()} cores, where the reduce's threads compete with the compute they "
          "are meant to hide behind."))

# %% [markdown]
# ## 6 · What we found, and where it disagrees with the source

# %%
waits = {v: ", ".join(f"{r['traced'][v]['waits_s'] * 1e3:.1f}" for r in results) for v in lesson.VARIANTS}
bench = {n: max(r["bench"][n]["mean_s"] for r in results) * 1e3 for n in lesson.VARIANTS}
bucket_bits = ("bitwise the same" if all(r["grads_bitwise_plain_vs_bucketed"] for r in results)
               else "the same within float rounding (dp > 2: the buckets' sums add in another order)")
display(Markdown(f"""
- **Exactness.** Separating the DP all-reduce changes no bit: same loss, same gradients, same bytes; bucket by
  bucket the gradients are {bucket_bits}, with the same bytes in more calls.
- **Overlap.** In the traced step the ranks waited at the end for the DP all-reduce {waits['separated']} ms
  when it was separated per stage, {waits['bucketed']} ms bucket by bucket, {waits['plain']} ms when it was
  issued after the step. Trimmed-mean step (slowest rank): plain {bench['plain']:.1f} ms, separated
  {bench['separated']:.1f} ms, bucketed {bench['bucketed']:.1f} ms; these timings come from {where}, so they are
  noisy.
  - On rank 0 the stages' last gradient ops are ops
  {', '.join(str(i + 1) for i in sorted(r0['last_grad_op'].values()))} of {r0['n_ops']}: at pp = {r0['pp']} little of
  the schedule is left to hide the reduces behind (the schedule table above shows how that grows with p), and
  nothing after stage {min(r0['stages'])}'s last op: bucket by bucket its reduce starts inside that op (section 5c).
- **Graphs.** The host cost measured above is what a replay removes; the cost model turns it into a gain
  that is large only when chunks are launch-bound. The audit shows what a capture cannot hold — the MoE
  dispatch (`nonzero`) and any host read of a value — and what Megatron keeps out by choice: the DP
  collective, capturable on NCCL but eager so that it overlaps the backward. No graph is captured inside
  this lesson's DualPipeV executor, here or in the GPU check (which graphs a sequential chain); the emulated
  cluster above times per-op graph replays.
- **Against the source.** The article reports 1F1B + CUDA graphs + DP separation working, and DualPipeV's
  version as work in progress; it gives no numbers, so we have none to compare with. One reason DualPipeV is
  harder, visible in this schedule: its zero-bubble W ops run a chunk's weight gradients *later* than its
  input gradients, so a whole-backward graph (what `make_graphed_callables` captures) cannot be used as
  is: the I and the W need graphs of their own.
"""))

# %% [markdown]
# The headline for the course results page: what this CPU measures (ATen ops a graph would replay, the host's
# cost per op, the separated all-reduce's exactness); capture itself needs a GPU.

# %%
launches = per_mb * r0["m"] * r0["dp"]
host_us = [x["host µs per op"] for x in chunks]
exact = all(r["grads_bitwise_plain_vs_separated"] and r["losses_equal"] for r in results)
emulated = "" if E is None else (
    f"{E['gpu']} (`{E['cluster']}`), this toy model (no workload matched: the claim is about launch-bound chunks): "
    f"eager, the host's launches are {em['eager · plain']['launch share of the step (rank 0)']:.0%} of the step and "
    f"a graph replay per chunk shortens it {graph_gain:.1f}×; the DP wait at the step's end {dp_plain:.1f} µs "
    f"plain, {dp_sep:.1f} µs separated. Matched to {M['stands_for']}'s layers, pipeline rank 0 "
    f"waits for the DP reduce {w0['plain']['dp_wait_s'] * 1e3:.3f} ms plain, "
    f"{w0['separated']['dp_wait_s'] * 1e3:.3f} ms separated per stage (stage {first}'s reduce has nothing left "
    f"to hide behind), {w0['bucketed']['dp_wait_s'] * 1e3:.3f} ms bucket by bucket")
dp_ordered = E is not None and (w0["bucketed"]["dp_wait_s"] <= w0["separated"]["dp_wait_s"] <= w0["plain"]["dp_wait_s"])
# the graph's gain replayed across the model's sensitivity band (eager over graphed step, the toy's shapes): at
# launch-bound shapes the gain is the model's per-op host cost, built in, so it is reported as a check
sens = None if E is None else band("eager / graphed step", E["sensitivity"],
                                   key=lambda v: v["eager · plain"] / v["graphed · plain"])
headline("16", "CUDA graphs with DualPipeV, DP all-reduce separated",
         f"{launches:,} ATen ops per step (dp {r0['dp']} × pp {r0['pp']}, {r0['m']} micro-batches) whose host "
         f"dispatch a graph replay would skip, {per_mb_compute * r0['m'] * r0['dp']:,} of them compute ops (not "
         f"views: about one kernel launch each on a GPU), at {min(host_us):.1f}–{max(host_us):.1f} µs of host time "
         f"per op on {where}; the separated DP all-reduce gives "
         f"{'bitwise the same' if exact else 'different'} gradients and loss",
         value=launches, unit="ATen ops per step",
         claim="1F1B + CUDA graphs + DP separation works; the DualPipeV version is in progress (no numbers given)",
         source="“16 optimizations” article §16; Megatron-LM --cuda-graph-impl",
         reproduced=not_decidable("CUDA graphs with DualPipeV and the DP all-reduce separated",
                                  "capture and replay need a GPU: not run here (the source gives no numbers)"),
         emulated=emulated,
         emulated_reproduced=None if E is None else check(
             "at the toy's launch-bound shapes a graph replay per chunk shortens the step at every point of the "
             "model's sensitivity band, and matched, the DP waits order bucketed <= separated <= plain (the model's "
             "host cost per op, built in: a property of the model, not a measurement of graphs)",
             bool(sens["low"] > 1 and dp_ordered),
             why=f"eager / graphed {sens['value']:.2f}× [{sens['low']:.2f}, {sens['high']:.2f}]"),
         note="capture and replay need a GPU; benchmarks/gpu/cuda_graphs.py graphs a sequential chain of 4 stages "
              "with one micro-batch in flight, not DualPipeV's per-micro-batch F, I and W graphs (not built), and "
              "checks DP separation on NCCL without graphs; here the DP separation is checked bitwise and the "
              "audit finds what a capture cannot hold")

# %% [markdown]
# ## What runs where
#
# | | CPU (this notebook) | CUDA (`benchmarks/gpu/cuda_graphs.py`) |
# |---|---|---|
# | op counts, host cost | `TorchDispatchMode`, timed chunks | compute ops vs `cudaLaunchKernel` |
# | capture | not possible | `make_graphed_callables` per stage of a sequential chain |
# | | | (4 stages, one micro-batch in flight, no schedule): replay vs eager |
# | graphs in DualPipeV | not possible | not checked: no graph per in-flight micro-batch, |
# | | | no separate I and W graphs, no graphed stage in the executor |
# | DP separation | DualPipeV on gloo, `async_op=True` per stage | the same on NCCL, without graphs |
# |  |  | (4 GPUs: `dp=2, pp=2`; 2 GPUs: `dp=2, pp=1`) |
#
# ## Try this
#
# - `pp = 4`, `n_layer = 8` and `m = 8` with `world_size = 4` (dp = 1): more pipeline ranks, earlier phase-1
#   chunks.
# - `world_size = 8` on a GPU node (dp = 4).
# - A larger `micro_batch`: the share of host time in section 4 falls.
#
# ## Sources
#
# NVIDIA, *CUDA Graphs* (CUDA programming guide); PyTorch `torch.cuda.graphs`,
# `make_graphed_callables`, and `torch.compile(mode="reduce-overhead")`; Megatron-LM `--cuda-graph-impl`,
# `--cuda-graph-modules` and its per-layer `_CudaGraphRunner`; DeepSeek-V3 technical report §3.2 and
# `deepseek-ai/DualPipe` (DualPipeV); Qi et al., *Zero Bubble Pipeline Parallelism* (ICLR 2024).
