# %% [markdown]
# # 03 · DualPipeV: folding the pipeline into a V to shrink its bubble
#
# **The question.** A pipeline of p stages idles at both ends of every step: 1F1B wastes (p−1)(F+B) per
# rank. DeepSeek-V3 trains with *DualPipe*, and its "cut-in-half" variant **DualPipeV** runs on p ranks
# with 2p model chunks folded into a V. How much of the bubble does that remove, what does it cost in
# memory, and which part of its gain can a CPU (or any device without overlapping streams) actually get?
#
# Every number below comes from real `torch.distributed` processes (gloo on CPU) running the schedules
# built by `toolkit.pipeline`, beside PyTorch's own `ScheduleDualPipeV` on the same model and data, and
# from the event simulator fed with the op times measured in this very run.
#
# ## The idea
#
# **V layout.** p ranks hold 2p stages; rank r holds stage r (phase 0, going down) and stage 2p−1−r
# (phase 1, coming back up). The turn of the V stays on the last rank, and the loss is computed on rank 0:
#
# ```
#  p = 4    rank 0: stage 0 ──────────────────────────────────── stage 7 ─► loss
#           rank 1:   stage 1 ──────────────────────────── stage 6
#           rank 2:     stage 2 ──────────────────── stage 5
#           rank 3:       stage 3 ──────────── stage 4              (no hop at the turn)
# ```
#
# **Three tricks on top.** (1) *Zero-bubble split*: a backward can compute only the input gradient (I)
# now, and the weight gradient (W) later, where the rank would otherwise idle. (2) *F&B*: in the steady
# state a rank issues the forward of one micro-batch together with the backward of another, so that on a
# GPU one's compute hides the other's communication (all-to-all in MoE, p2p here). (3) The exact per-rank
# order, DeepSeek's eight steps (rank r of p, m micro-batches; F0 = forward of phase 0, B1 = backward of
# phase 1, ...):
#
# ```
#  1. 2(p−r−1) × F0          4. (m−2p+r+1) × [F0&B1, F1&B0]     7. (p−r−1) × [W, B0]
#  2. (r+1)    × [F0, F1]    5. (p−r−1)    × [B1, F1&B0]        8. (r+1)   × W
#  3. (p−r−1)  × [I1, W, F1] 6. (r+1)      × [B1, B0]
#  (W split switched on halfway, by the parity of r)
# ```
#
# The DualPipe README gives its bubble as (PP/2−1)(F&B+B−3W) with PP = 2p stages, against (PP−1)(F+B)
# for 1F1B and (PP−1)(F+B−2W) for ZB-H1 (ZB1P), at the price of holding PP+1 activation chunks.

# %% tags=["parameters"]
import os
from typing import Optional

world_size: int = 2
preset: str = os.environ.get("TOOLKIT_PRESET", "default")  # smoke | default | full
backend: str = "auto"  # auto | gloo | nccl
cluster: str = "h100-ib400"  # emulated cluster under the run: h100-ib400 | a100-ib200 | pcie-100gbe | none
m: Optional[int] = None  # micro-batches per step (None: the preset's)
timeout_s: int = 600

# %%
import inspect

from IPython.display import Markdown, display

from toolkit import launch, viz
from toolkit.models import GPT, GPTConfig
from toolkit.pipeline import Costs, closed_form_bubble, dualpipev, make_schedule, simulate
from toolkit.pipeline import executor as pipeline_executor
from toolkit.pipeline.harness import find, wait_spans
from toolkit.pipeline.simulate import MeasuredCosts, timeline_bubble
from toolkit.pipeline.schedule import torch_order_missing
from toolkit.pipeline.torch_compare import compare_orders
from toolkit.viz.pipeline import explorer, memory_steps, schedule_gantt

# %% [markdown]
# ## 1 · The schedule as data
#
# A schedule is a per-rank list of actions (`toolkit.pipeline.schedule`): `F`, `B` (full backward), `I`
# (input gradient only), `W` (the deferred weight gradient), `FB` (an F&B pair), `R` (recompute), each on
# a (stage, micro-batch). The generator's loop below *is* the eight steps (its helpers `f`, `b` and `w`, left
# out, take a stage's next micro-batch and queue the deferred W); it writes actions in torch's notation
# (`3F1` = forward of stage 3, micro-batch 1; `(0F3;3B1)FB` = an F&B pair).

# %%
print(viz.listing(dualpipev, start="# 1", end="ranks.append"))

# %% [markdown]
# The deferred W needs the weight gradient kept aside. As in DeepSeek's `WeightGradStore`, every
# `nn.Linear` of a chunk whose backward will be an I runs this autograd function; its backward returns dX
# at once and, while the store is enabled, queues a closure for dW = gᵀx under the (stage, micro-batch)
# of the I. The W action pops and runs exactly those closures.

# %%
print(inspect.getsource(pipeline_executor._SplitLinearFn))

# %%
# NBVAL_CHECK_OUTPUT
p_demo, m_demo = 4, 8
demo = dualpipev(p_demo, m_demo)
print(demo.table())
no_torch_order = torch_order_missing("dualpipev")  # None, or why this torch cannot list its DualPipeV order
print("identical to torch.distributed.pipelining.ScheduleDualPipeV:",
      compare_orders(demo, "dualpipev")["identical"] if no_torch_order is None else f"not compared: {no_torch_order}")

# %% [markdown]
# ## 2 · What the closed forms say, and what the simulator says
#
# The simulator (`toolkit.pipeline.simulate`) runs every rank's list in order; an action starts when its
# rank is free and its inputs exist (the previous stage's forward, the next stage's backward). With unit
# costs per *chunk* it reproduces the textbook bubbles exactly — the tests check p = 2…8. For the same
# model on p ranks, a 1F1B stage is two DualPipeV chunks, so 1F1B and ZB-H1 get costs × 2.

# %%
# NBVAL_CHECK_OUTPUT
chunk = Costs(F=1, B=2, W=1)  # per V chunk; F = B - W, the assumption behind the README table
rows = []
for p in (2, 4, 8):
    for name, costs in (("1f1b", chunk.scaled(2)), ("zb-h1", chunk.scaled(2)), ("interleaved", chunk),
                        ("dualpipev", chunk)):
        sim = simulate(make_schedule(name, p, 2 * p), costs)
        rows.append({"p": p, "schedule": name, "simulated bubble": round(sim.bubble, 3),
                     "closed form": round(closed_form_bubble(name, p, costs), 3),
                     "peak activations (micro-batches)": round(max(sim.peak_mb), 3)})
for r in rows:
    print(r)

# %% [markdown]
# DualPipeV's bubble with the same F, B, W is the smallest, and it holds p + ½ micro-batches of
# activations (2p+1 chunks of half size) against p for 1F1B's first rank. One caveat found while
# testing: (PP/2−1)(F&B+B−3W) is exact only when a forward costs as much as an input backward
# (F = B − W) and W ≤ F. With F = 1, B = 2, W = 0.5 the simulated bubble at p = 4 is 9.5, not 10.5.

# %% [markdown]
# ## 3 · The run: four schedules for real, DualPipeV three ways, and torch's DualPipeV beside them
#
# `l03_dualpipev` builds the tiny GPT on every rank (`toolkit.pipeline.harness.PipelineSetup`: one model,
# one set of micro-batches, one single-process reference), cuts it into p stages (1F1B, ZB-H1) or 2p chunks
# (interleaved, DualPipeV), and runs each schedule with `PipelineExecutor`: real `isend`/`irecv` between
# ranks, every message tagged by (kind, stage, micro-batch), the receives of the next action posted
# before the current one computes. DualPipeV runs three ways (section 6): F&B overlapped, F&B halves back
# to back, and unpaired. One step of each is checked against the single-process model; then all are timed
# side by side (`bench.compare`) and record a timeline. The same stages then run under
# `torch.distributed.pipelining.ScheduleDualPipeV` (torch >= 2.9: on an older torch the run leaves it out
# and the cell below says why).

# %%
results = launch("l03_dualpipev", world_size, {"preset": preset, "m": m}, backend=backend, timeout_s=timeout_s,
                 cluster=cluster)
r0 = results[0]


def ours(name: str, fb_overlap: bool = True) -> list[dict]:
    """The run of schedule ``name`` by our executor: one record per rank."""
    return [find(r["runs"], schedule=name, impl="ours", fb_overlap=fb_overlap) for r in results]


no_torch_run = r0["torch_missing"]["runtime"]  # None, or why torch's DualPipeV did not run here
torch_dpv = [find(r["runs"], schedule="dualpipev", impl="torch") for r in results] if no_torch_run is None else None
if no_torch_run:
    print(f"torch's DualPipeV not run: {no_torch_run}")
print(f"{world_size} ranks, m = {r0['m']} micro-batches, model {r0['model']['n_layer']} layers × "
      f"d={r0['model']['d_model']}, T={r0['model']['seq_len']}; wall {results.wall_s:.1f} s")

# %% [markdown]
# **Checks.** Every schedule gives the single-process loss and gradients (largest absolute difference
# over all parameters ≤ 1e-5 in fp32; most are bitwise equal), and so does torch's DualPipeV.

# %%
for i, job in enumerate(r0["runs"]):  # every rank ran the same jobs, in the same order
    per_rank = [r["runs"][i] for r in results]
    loss = [x["loss"] for x in per_rank if x["loss"] is not None]
    assert len(loss) == 1 and abs(loss[0] - r0["ref_loss"]) <= 1e-5, (job["schedule"], loss, r0["ref_loss"])
    assert max(x["grad_diff"] for x in per_rank) <= 1e-5, job["schedule"]
assert r0["torch_order_identical"] or r0["torch_missing"]["order"]  # identical, or this torch has no order

# %%
# NBVAL_CHECK_OUTPUT
for i, job in enumerate(r0["runs"]):
    per_rank = [r["runs"][i] for r in results]
    loss = [x["loss"] for x in per_rank if x["loss"] is not None][0]
    key = f"{job['schedule']} ({job['impl']}" + (", F&B back to back)" if job["fb_overlap"] is False else ")")
    print(f"{key:34s} loss matches: {abs(loss - r0['ref_loss']) <= 1e-5}   max |grad - reference| <= 1e-5: "
          f"{max(x['grad_diff'] for x in per_rank) <= 1e-5}")

# %% [markdown]
# ## 4 · The real timelines
#
# The last timed step of each schedule, as recorded by the executor (compute only; gaps are waits). In
# DualPipeV the two halves of an F&B are drawn as their own F and B (or I) bars, one after the other.

# %%
for name in ("1f1b", "dualpipev"):
    spans = [s for x in ours(name) for s in x["spans"]]
    display(schedule_gantt(spans, title=f"{name}: measured step on {world_size} ranks"))

# %% [markdown]
# ## 5 · Simulated with the measured op times, against the real step
#
# Each schedule's own run measured the median time of every op on every stage. Feeding those into the
# simulator (communication latency 0) predicts the step; the real step is longer by what the simulator
# leaves out: p2p latency and the Python between actions.

# %%
p = world_size
table, measured = [], {}
for name in ("1f1b", "zb-h1", "interleaved", "dualpipev"):
    measured[name] = MeasuredCosts([o for x in ours(name) for o in x["op_seconds"]])  # [{op, stage, seconds}]
    sim = simulate(make_schedule(name, p, r0["m"]), measured[name])
    real = timeline_bubble([s for x in ours(name) for s in x["spans"]], p)
    table.append({"schedule": name, "simulated step (ms)": sim.makespan * 1e3, "real step (ms)": real["makespan"] * 1e3,
                  "simulated bubble %": 100 * sim.bubble_fraction, "real bubble %": 100 * real["bubble_fraction"],
                  "bench step (ms)": ours(name)[0]["bench"]["mean_s"] * 1e3})
if torch_dpv:
    table.append({"schedule": "torch DualPipeV", "bench step (ms)": torch_dpv[0]["bench"]["mean_s"] * 1e3})
display(viz.table(table, title="Step and bubble: simulated from measured op times vs real",
                  formats={k: ".2f" for k in table[0] if k != "schedule"}))
display(viz.bars([r for r in table], x="schedule", y="bench step (ms)",
                 title="Step time (trimmed mean over rounds), this machine", text_format=".1f"))
noise = {name: m.noisy() for name, m in measured.items() if m.noisy()}
if noise:  # wall-clock op times on a loaded machine: drawn as measured, said here
    display(Markdown("**Noisy measurement.** A weight-gradient half W took as long as its whole backward B: "
                     + "; ".join(f"{name}: {', '.join(x)}" for name, x in noise.items())
                     + f". The simulator takes such a W as {MeasuredCosts.W_CAP:.0%} of B; rerun on an idle "
                       "machine for figures that follow the model of a backward."))

# %% [markdown]
# ## 5b · On an emulated H100 node: the schedules where the ops are GPU-sized
#
# On this CPU the time between actions (Python, gloo's latency) weighs on every bubble. The launch also ran on
# an **emulated cluster** (the `cluster` parameter; `toolkit.runtime.emulator`, checked in lesson 00 against
# published measurements and against this simulator): each op timed at what the target GPU's kernels achieve,
# each activation or gradient as NCCL sends it on its link, on a virtual clock per rank. Our schedules ran once more there, **matched**
# to a real model (every op counted with the FLOPs, every tensor with the bytes, of its transformer layers at
# pp = world size), so that a stage's compute and its messages have the real ratio. For every schedule: the
# step, the bubble from the virtual timeline, the time a rank waited for its receives, and the part of those
# waits with the bytes still on the wire (*exposed p2p*; the rest is waiting for the producing stage).

# %%
E = r0["emulated"]
if E is None:
    display(Markdown("This run had no emulated cluster (`cluster = none`)."))
else:
    labels = {("dualpipev", True, True): "dualpipev (F&B overlapped)",
              ("dualpipev", False, True): "dualpipev (F&B back to back)",
              ("dualpipev-unpaired", True, False): "dualpipev, no pairing"}
    emu_rows = {}
    for j, job in enumerate(E["jobs"]):
        per_rank = [r["emulated"]["jobs"][j] for r in results]
        label = labels.get((job["schedule"], job["fb_overlap"], job["meta"].get("pair", True)), job["schedule"])
        virtual = [{**s, "start": s["vstart"], "end": s["vend"]} for x in per_rank for s in x["spans"]]
        tl = timeline_bubble(virtual, p)
        emu_rows[label] = {"schedule": label, "step (ms)": max(x["step_s"] for x in per_rank) * 1e3,
                           "bubble %": 100 * tl["bubble_fraction"],
                           "waited for receives (µs, summed over ranks)": sum(x["exposed_recv_s"] for x in per_rank) * 1e6,
                           "exposed p2p on the wire (µs, summed)": sum(x["exposed_wire_s"] for x in per_rank) * 1e6,
                           "link busy (µs, rank 0)": sum(per_rank[0]["link_busy_s"].values()) * 1e6,
                           "spans": virtual}
    shown = [{k: v for k, v in row.items() if k != "spans"} for row in emu_rows.values()]
    display(viz.table(shown, title=f"Emulated {E['gpu']} over {E['link']}, matched to {E['stands_for']} (virtual time)",
                      formats={k: ".2f" if k != "step (ms)" else ".3f" for k in shown[0] if k != "schedule"}))
    display(schedule_gantt(emu_rows["dualpipev (F&B overlapped)"]["spans"],
                           title=f"DualPipeV on the emulated {E['gpu']}, matched to {E['stands_for']} (virtual time)"))
    em = {k: v for k, v in emu_rows.items()}
    wire = {k: v["exposed p2p on the wire (µs, summed)"] for k, v in em.items()}
    display(Markdown(
        f"Matched to **{E['stands_for']}** ({E['scales']['flops']:,.0f}× the FLOPs, {E['scales']['bytes']:,.0f}× the "
        f"bytes), DualPipeV's step takes {em['dualpipev (F&B overlapped)']['step (ms)'] / em['1f1b']['step (ms)']:.3f}× "
        f"1F1B's, its bubble {em['dualpipev (F&B overlapped)']['bubble %']:.1f} % against "
        f"{em['1f1b']['bubble %']:.1f} %, and its exposed p2p "
        f"{wire['dualpipev (F&B overlapped)']:.0f} µs against 1F1B's {wire['1f1b']:.0f} µs. The pairing: overlapped "
        f"F&B pairs leave {wire['dualpipev (F&B overlapped)']:.0f} µs of p2p exposed, the same order unpaired "
        f"{wire['dualpipev, no pairing']:.0f} µs, the halves back to back (torch's way) "
        f"{wire['dualpipev (F&B back to back)']:.0f} µs. In this executor every p2p message is already asynchronous "
        "(sent as soon as it is made, received one action ahead), so pairing F with B has nothing left to hide "
        "in the pipeline's own messages; DualPipe's pairs are for the expert-parallel all-to-all inside a "
        "stage, which these dense stages do not have."))

# %%
# the toy's own shapes on the same cluster, beside the simulator fed their virtual op times
if E is not None:
    toy_rows = []
    for name in ("1f1b", "zb-h1", "interleaved", "dualpipev"):
        per = ours(name)
        sim = simulate(make_schedule(name, p, r0["m"]), MeasuredCosts([o for x in per for o in x["op_vseconds"]]))
        toy_rows.append({"schedule": name, "emulated step, toy shapes (µs)": per[0]["bench"]["virtual"]["mean_s"] * 1e6,
                         "simulated from its op times (µs)": sim.makespan * 1e6})
    display(viz.table(toy_rows, title="Simulated from the same op times (median per op, no latency) beside the "
                                      "emulated step at the toy shapes (virtual time)",
                      formats={k: ".1f" for k in toy_rows[0] if k != "schedule"}))

# %% [markdown]
# ## 5c · At a 7B model's true shapes, on the source's pipeline size
#
# The toy's ops are far from a real model's proportions. `toolkit.planner_check.unit_seconds` runs one layer of
# the course's GPT at Llama-2-7B's shapes (hidden 4096, 32 heads, its MLP's parameter count, one 4096-token
# sequence per micro-batch) on fake tensors — nothing is computed — and times every op on an H100 preset: the
# forward (F), the whole backward (B), and the backward with the weights frozen, whose difference to B is the
# weight-gradient part (W). Eight ranks hold the 32 layers: a DualPipeV chunk is 2 layers, a 1F1B stage 4. The
# simulator then runs each schedule with these costs (layers only: no embedding, head or transfers; a model).

# %%
from toolkit.models.catalog import get as get_model
from toolkit.planner_check import unit_seconds
from toolkit.runtime.bench import Claim, judge
from toolkit.runtime.cluster import cluster as make_cluster
from toolkit.runtime.emulator_report import over_band
from toolkit.report import SENSITIVITY, band

p7, m7, spec7, h100 = 8, 16, get_model("llama2-7b"), make_cluster("h100-ib400")
layers7 = spec7.layers // (2 * p7)  # layers per DualPipeV chunk


def schedules7(c) -> dict[str, dict]:
    """Each schedule simulated with one layer's F, B, W traced at 7B's shapes (once) and timed on cluster c."""
    u7 = unit_seconds(spec7, h100, 4096, 1, 1, on=c)
    chunk = Costs(F=layers7 * u7["layer_F"], B=layers7 * u7["layer_B"], W=layers7 * u7["layer_W"])
    out = {}
    for name, costs in (("1f1b", chunk.scaled(2)), ("interleaved", chunk), ("dualpipev", chunk)):
        sim = simulate(make_schedule(name, p7, m7), costs)
        out[name] = {"schedule": name, "idle per rank (ms)": sum(sim.idle) / p7 * 1e3,
                     "step (ms)": sim.makespan * 1e3, "closed-form bubble (ms)": closed_form_bubble(
                         name, p7, costs) * 1e3}
    return out


u7 = unit_seconds(spec7, h100, 4096, 1, 1)
chunk7 = Costs(F=layers7 * u7["layer_F"], B=layers7 * u7["layer_B"], W=layers7 * u7["layer_W"])
true7 = schedules7(h100)
display(viz.table(list(true7.values()), title=f"Simulated (a model) from traced costs: Llama-2-7B layers on {p7} H100s, "
                  f"m = {m7}, per-chunk F {chunk7.F * 1e3:.2f}, B {chunk7.B * 1e3:.2f}, W {chunk7.W * 1e3:.2f} ms",
                  formats={k: ".1f" for k in true7["1f1b"] if k != "schedule"}))
idle7 = {n: r["idle per rank (ms)"] for n, r in true7.items()}
formula7 = true7["dualpipev"]["closed-form bubble (ms)"] / true7["1f1b"]["closed-form bubble (ms)"]
true_claim = Claim.ratio("DualPipeV's idle time per rank / 1F1B's", formula7, tolerance=0.25,
                         source="deepseek-ai/DualPipe README (bubble table)",
                         setting=f"the table's formulas at Llama-2-7B's traced F, B, W, p = {p7}")
sens7 = band("DualPipeV's idle time per rank / 1F1B's", over_band(schedules7, h100),
             key=lambda t: t["dualpipev"]["idle per rank (ms)"] / t["1f1b"]["idle per rank (ms)"])
judged7 = judge(true_claim, sens7["value"], sens7["low"], sens7["high"], SENSITIVITY)
display(Markdown(
    f"At these shapes B − W = {(chunk7.B - chunk7.W) * 1e3:.2f} ms is not F = {chunk7.F * 1e3:.2f} ms, the "
    f"README table's assumption. Its formulas give DualPipeV {formula7:.2f}× 1F1B's bubble. The simulator gives "
    f"{idle7['dualpipev'] / idle7['1f1b']:.2f}× 1F1B's idle time and {idle7['dualpipev'] / idle7['interleaved']:.2f}× "
    f"interleaved 1F1B's, and a step {true7['dualpipev']['step (ms)'] / true7['1f1b']['step (ms)']:.2f}× 1F1B's. "
    f"Judged against the table: {judged7.text()}."))

# %% [markdown]
# ## 6 · F&B: the overlap, for real
#
# The two halves of an F&B are independent: different micro-batches, different stages. So while one half
# computes, the other half's communication can be in flight. `PipelineExecutor` runs a pair that way: each
# half waits for its own input only when it starts, and the first half's output leaves (`isend`) before the
# second half computes. torch's `ScheduleDualPipeV` runs `OVERLAP_F_B` as its forward, then its backward,
# after both inputs have arrived; our executor does the same with `fb_overlap=False`:
#
# ```
#  overlapped     wait(x_F) ─ F ─ isend(out_F) ─ wait(g_B) ─ B ─ isend(dx_B)
#                               └── g_B arriving ──┘└── out_F leaving ──┘
#  back to back   wait(x_F) wait(g_B) ─ F ─ isend(out_F) ─ B ─ isend(dx_B)
# ```
#
# On gloo, `isend`/`irecv` run on gloo's own threads, so the transfer really proceeds while this rank's
# Python computes the other half. The mechanism (and bitwise-equal gradients) is pinned by
# `tests/test_executor.py`; here we measure it. A third variant writes the same order with no pairs at all
# (`make_schedule("dualpipev", p, m, pair=False)`), to see what the pairing itself changes. For each, per
# rank and step: the time the rank *blocked* on receives (the executor records every wait: the exposed
# p2p time), and the ledger's count of p2p messages and bytes (the same traffic in all three).

# %%
variants = {"F&B overlapped": ours("dualpipev"), "F&B back to back": ours("dualpipev", fb_overlap=False),
            "no pairing": ours("dualpipev-unpaired")}
paired = make_schedule("dualpipev", world_size, r0["m"])
pair_inputs = [{(m.op, m.stage, m.mb) for a in acts if a.op == "FB" for half in a.sub for m in paired.recvs(half)}
               for acts in paired.ranks]  # per rank: the messages an F&B half waits for (same ops unpaired)


def blocked(x: dict, rank: int, pairs_only: bool) -> float:
    """ms per step this rank blocked on receives (median per message over the timed steps), summed."""
    return 1e3 * sum(w["seconds"] for w in x["recv_waits"]
                     if not pairs_only or (w["msg"], w["stage"], w["mb"]) in pair_inputs[rank])


fb_rows = [{"variant": label, "rank": f"rank {r}", "blocked, F&B inputs (ms/step)": blocked(x, r, True),
            "blocked, all receives (ms/step)": blocked(x, r, False),
            "receives open (ms/step)": x["p2p"]["recv_open_s"] * 1e3, "p2p messages/step": x["p2p"]["calls"],
            "p2p bytes sent/step": x["p2p"]["sent_bytes"], "step (ms)": x["bench"]["mean_s"] * 1e3}
           for label, per_rank in variants.items() for r, x in enumerate(per_rank)]
display(viz.table(fb_rows, title="DualPipeV's F&B three ways, measured on this machine",
                  formats={k: ".3f" for k in fb_rows[0] if k.startswith(("blocked", "receives"))}
                  | {"step (ms)": ".2f", "p2p bytes sent/step": ",.0f"}))
display(viz.bars(fb_rows, x="variant", y="blocked, F&B inputs (ms/step)", color="rank", text_format=".2f",
                 title="Time blocked on the inputs of the F&B halves, per step (medians over timed steps)"))
spans = [s for r, x in enumerate(variants["F&B overlapped"]) for s in x["spans"] + wait_spans(x["waits"], r)]
display(schedule_gantt(spans, title="DualPipeV, F&B overlapped: ops and the receive waits between them"))

# %% [markdown]
# **Checks.** The three variants move exactly the same messages (the ledger counts calls and bytes from
# tensor sizes), and their gradients equal the single-process model (section 3).

# %%
for per_rank in zip(*variants.values()):
    assert len({(x["p2p"]["calls"], x["p2p"]["sent_bytes"], x["p2p"]["recv_bytes"]) for x in per_rank}) == 1
for per_rank in variants.values():
    assert max(x["grad_diff"] for x in per_rank) <= 1e-5

# %%
# NBVAL_CHECK_OUTPUT
pairs = [sum(a.op == "FB" for a in acts) for acts in make_schedule("dualpipev", world_size, r0["m"]).ranks]
print(f"F&B pairs per rank: {pairs}")
for r, x in enumerate(variants["F&B overlapped"]):
    print(f"rank {r}: {x['p2p']['calls']:g} p2p messages and {x['p2p']['sent_bytes']:,.0f} bytes sent per step "
          f"in all three variants: {all(v[r]['p2p']['sent_bytes'] == x['p2p']['sent_bytes'] for v in variants.values())}")

# %%
exposed = {label: sum(blocked(x, r, True) for r, x in enumerate(per_rank)) for label, per_rank in variants.items()}
exposed_all = {label: sum(blocked(x, r, False) for r, x in enumerate(per_rank)) for label, per_rank in variants.items()}
steps_ms = {label: per_rank[0]["bench"]["mean_s"] * 1e3 for label, per_rank in variants.items()}
variant_names = ("F&B overlapped", "F&B back to back", "no pairing")
blocked_rows = [("blocked on the F&B halves' inputs", exposed, 2), ("blocked on all receives", exposed_all, 2),
                ("step time", steps_ms, 1)]
shortened = exposed["F&B overlapped"] < exposed["F&B back to back"]
display(Markdown(
    f"**Measured here** ({world_size} ranks, preset `{preset}`, summed over ranks, per step):\n\n"
    "| | F&B overlapped | F&B back to back (torch's way) | no pairing |\n|---|---|---|---|\n"
    + "".join(f"| {what} | " + " | ".join(f"{d[k]:.{n}f} ms" for k in variant_names) + " |\n"
              for what, d, n in blocked_rows)
    + f"\nOverlapping the pair {'shortened' if shortened else 'did not shorten'} the time blocked at the pairs "
    "against running their halves back to back.\n\n"
    "- With one core per rank the two halves' *compute* cannot overlap each other: what the pair can hide here is "
    "communication only.\n"
    "- The unpaired order runs with the same just-in-time waits (each op waits for its own input), so the pairing "
    "itself changes little here beyond posting the next pair's receives one op earlier: compare the first and "
    "last columns."))

# %% [markdown]
# **On GPUs, the same code.** With nccl, `isend`/`irecv` run on NCCL's own CUDA streams, and `wait()` does not
# block the host: it makes the compute stream wait for the transfer. So in an overlapped pair the F half's
# kernels are queued and run while B's gradient is still arriving, and B's kernels start when it has
# arrived; F's output leaves on NCCL's stream while B computes. The host-side waits recorded above are then
# close to zero, and the exposed time has to be read from CUDA events (not measured here: this machine has
# no GPU). What DeepSeek gains from F&B on GPUs is larger than p2p: inside a pair, one micro-batch's
# attention and MLP compute hides the other's expert-parallel all-to-all, which this tiny dense model does
# not have. The simulator shows what such an overlap would buy, as F&B costing less than F + B:

# %%
chunk_costs = measured["dualpipev"].mean()
sweep = {name: [] for name in ("1f1b", "zb-h1", "dualpipev")}
alphas = [1.0, 0.9, 0.8, 0.7, 0.6, 0.5]
for a in alphas:
    c = Costs(chunk_costs.F, chunk_costs.B, chunk_costs.W, FB=a * (chunk_costs.F + chunk_costs.B))
    for name in sweep:
        sweep[name].append(simulate(make_schedule(name, 4, 16), c.scaled(2) if name != "dualpipev" else c).makespan * 1e3)
display(viz.lines(sweep, x=alphas, title="Simulated step, p = 4, m = 16, measured chunk costs (simulator)",
                  xaxis_title="F&B / (F + B)   (1 = the halves' compute does not overlap, as on this CPU)",
                  yaxis_title="step (ms)"))

# %% [markdown]
# ## 7 · Memory: what each schedule holds
#
# Bytes are counted exactly: every tensor autograd saves during a forward (a `saved_tensors_hooks` pack
# hook), parameters excluded, each storage once, released when its backward (or its deferred W) is done.
# The simulator counts the same thing in chunks.

# %%
rows = []
for name in ("1f1b", "zb-h1", "interleaved", "dualpipev"):
    sim = simulate(make_schedule(name, p, r0["m"]), Costs())
    for r, x in enumerate(ours(name)):
        rows.append({"schedule": name, "rank": f"rank {r}", "peak saved activations (KiB)": x["peak_act_bytes"] / 1024,
                     "simulated peak (micro-batches)": sim.peak_mb[r]})
display(viz.bars(rows, x="schedule", y="peak saved activations (KiB)", color="rank",
                 title="Peak activation bytes per rank (measured)"))
display(viz.table(rows, formats={"peak saved activations (KiB)": ".1f"},
                  title="Peak activations: measured bytes, and the simulated peak in micro-batches"))
kib_per_mb = [x["peak saved activations (KiB)"] / x["simulated peak (micro-batches)"] for x in rows
              if x["schedule"] == "dualpipev"]
display(Markdown("DualPipeV, measured KiB per simulated micro-batch held: " + ", ".join(
    f"rank {r} {v:.1f}" for r, v in enumerate(kib_per_mb)) + (
    "; rank 0 holds the most per micro-batch." if kib_per_mb[0] == max(kib_per_mb) else ".")))

# %%
# NBVAL_CHECK_OUTPUT
for name in ("1f1b", "zb-h1", "interleaved", "dualpipev"):
    sim = simulate(make_schedule(name, p, r0["m"]), Costs())
    print(f"{name:12s} simulated peak per rank (micro-batches): {sim.peak_mb}")

# %% [markdown]
# The measured bytes depart from the simulator's chunk count where the model is not uniform: rank 0 of
# DualPipeV holds both the embedding *and* the head, and the head's logits (vocabulary × tokens) are the
# largest activation of this tiny model, which is what the bytes per micro-batch above show on rank 0.

# %% [markdown]
# ## 8 · Why split attention into qkv, core attention and output projection?
#
# The source article says DualPipeV "splits the attention computation (qkv, core attention, linear
# projection) into separate stages so that TP and EP communication stop competing for bandwidth". The
# model here is built that way (`toolkit.models.gpt.Attention`):

# %%
print(r0["attention_modules"])
print(GPT(GPTConfig(**r0["model"])).blocks[0].attn)  # the run's model

# %% [markdown]
# With tensor parallelism, qkv and the output projection each end in a TP collective (all-gather /
# reduce-scatter), while core attention needs none. In an MoE layer the expert-parallel all-to-all
# (dispatch, combine) of the *other* micro-batch of an F&B pair runs at the same time. Splitting the
# module lets the scheduler launch the all-to-all while *core attention* computes, i.e. when the TP
# links are quiet — MindSpeed-LLM hooks its async combine all-to-all inside attention with the comment
# "a2a should be launched after TP communication finished to avoid bandwidth compete". DeepSeek's own
# overlap pairs are attention ↔ combine and MLP ↔ dispatch. What we did **not** find in any public code
# is qkv / core / proj as separate *pipeline stages*: in DualPipe they are sub-steps inside one F&B, and
# the pipeline stages stay whole layers. We read the article's phrasing as that overlap, not as a
# different stage cut.

# %% [markdown]
# ## 9 · Explore
#
# Pick a schedule, p, m and op costs; the Gantt chart, memory and bubble redraw from the simulator.
# The live explorer needs a kernel and combines every setting; the precomputed one under it moves one
# setting at a time and works anywhere (the HTML book too). Then the same view as a static figure for
# p = 4, m = 8 with this run's measured chunk costs and F&B set to `0.8 × (F + B)`.

# %%
explorer("dualpipev", p=4, m=8, costs=Costs(1, 2, 1))

# %%
static = simulate(dualpipev(4, 8), Costs(chunk_costs.F * 1e3, chunk_costs.B * 1e3, chunk_costs.W * 1e3,
                                        FB=0.8 * (chunk_costs.F + chunk_costs.B) * 1e3))
display(schedule_gantt(static, title="DualPipeV p=4, m=8, simulated with the measured chunk costs, F&B = 0.8(F+B)",
                      unit="ms"))
display(memory_steps(static, title="Activation chunks held (simulated)", unit="ms"))

# %% [markdown]
# ## What we found, and where it disagrees with the sources
#
# The numbers behind the findings, from this run:

# %%
row = {r["schedule"]: r for r in table}
dpv = measured["dualpipev"]
split = [dpv.seconds("I", s) + dpv.seconds("W", s) - dpv.seconds("B", s) for s in range(2 * p)
         if dpv.has("I", s) and dpv.has("B", s)]
print("bubble, real timeline:  " + ", ".join(f"{n} {row[n]['real bubble %']:.1f}%" for n in measured))
print("bubble, simulated:      " + ", ".join(f"{n} {row[n]['simulated bubble %']:.1f}%" for n in measured))
print("step (trimmed mean):    " + ", ".join(f"{n} {row[n]['bench step (ms)']:.1f} ms" for n in row))
print("blocked on F&B inputs per step, summed over ranks: " + ", ".join(f"{k} {v:.2f} ms" for k, v in exposed.items()))
print(f"I + W - B per chunk = {sum(split) / max(len(split), 1) * 1e3:.3f} ms (the cost of splitting a backward)")
print(f"mean op per chunk:      F {chunk_costs.F * 1e3:.2f} ms, B {chunk_costs.B * 1e3:.2f} ms, "
      f"W {chunk_costs.W * 1e3:.2f} ms")
vs_1f1b = {n: (row[n]["real bubble %"] / row["1f1b"]["real bubble %"],
               row[n]["simulated bubble %"] / row["1f1b"]["simulated bubble %"]) for n in ("zb-h1", "dualpipev")}
display(Markdown(
    f"This run (preset `{preset}`): bubble fraction of ZB-H1 {vs_1f1b['zb-h1'][0]:.2f}× and of DualPipeV "
    f"{vs_1f1b['dualpipev'][0]:.2f}× 1F1B's on the real timeline, {vs_1f1b['zb-h1'][1]:.2f}× and "
    f"{vs_1f1b['dualpipev'][1]:.2f}× simulated from the measured op times; DualPipeV's step "
    f"{row['dualpipev']['bench step (ms)'] / row['1f1b']['bench step (ms)']:.2f}× 1F1B's."))

# %% [markdown]
#
# - The order is DeepSeek's: our generator and torch's `ScheduleDualPipeV` give identical per-rank lists
#   (torch >= 2.9; an older torch has none to compare, and the cells above say so).
# - Loss and gradients equal the single-process model for every schedule (DualPipeV, ZB-H1, interleaved,
#   1F1B), and torch's DualPipeV agrees too where this torch has it.
# - F&B: our executor overlaps each half's communication with the other half's compute (section 6, where
#   the exposed receive time of the three variants is measured and printed); torch's `ScheduleDualPipeV`
#   runs F&B as F then B after both inputs arrived. The two halves' *compute* cannot overlap on one core per
#   rank, so the larger part of DualPipe's F&B gain (compute hiding MoE all-to-all on GPU streams) does not
#   exist here. The zero-bubble half can: the ratios rendered above compare the bubbles of ZB-H1 and
#   DualPipeV with 1F1B's, real and simulated; they mean most when the ops are long against the time between
#   them (this run's op times are printed below). At p = 2 the bubble 1F1B loses is small, and DualPipeV pays for it with twice as many
#   (smaller) ops, extra messages and the split backward, so a shorter step is not to be expected there
#   (the step ratio above). The simulator shows the bubble's share growing with p (section 2): that is where the
#   schedule pays. With short ops (the smoke preset) the time *between* actions (Python, message latency)
#   dominates and the "real bubble" above is mostly that overhead.
# - The README's bubble formula holds only under F = B − W (and W ≤ F); otherwise the simulator's exact
#   timing differs (section 2).
# - The article's claim that DualPipeV beats interleaved 1F1B "noticeably" for MoE rests on overlapping the
#   expert all-to-all with compute, which these dense stages do not have; lesson 17 composes DualPipeV with that
#   overlap on the emulated cluster. The article gives no magnitude, so it is not judged here.

# %%
from toolkit.report import headline
from toolkit.runtime.bench import Claim, check, judge

real_tl = {n: timeline_bubble([s for x in ours(n) for s in x["spans"]], p) for n in ("1f1b", "dualpipev")}
idle = {n: sum(t["idle"]) / p for n, t in real_tl.items()}  # mean idle seconds per rank in the traced step
ok = r0["torch_order_identical"] is not False and all(x["grad_diff"] <= 1e-5 for x in ours("dualpipev"))
same_order = {True: "True", False: "False", None: "not compared (this torch has no ScheduleDualPipeV)"}
# the README's table at F = B - W and F&B = F + B (what these stages run): DualPipeV's bubble per rank against
# 1F1B's on the same model, (p - 1)(F&B + B - 3W) per chunk against (p - 1)(F + B) per stage of two chunks
readme = closed_form_bubble("dualpipev", p, chunk) / closed_form_bubble("1f1b", p, chunk.scaled(2))
table_claim = Claim.ratio("DualPipeV's idle time per rank / 1F1B's", readme, tolerance=0.25,
                          source="deepseek-ai/DualPipe README (bubble table)",
                          setting=f"p = {p}, F = B - W, F&B = F + B (no compute overlap inside a pair)")
emulated = (f"at Llama-2-7B's traced shapes on {p7} H100s (section 5c, m = {m7}, layers only): DualPipeV idles "
            f"{idle7['dualpipev'] / idle7['1f1b']:.2f}× 1F1B's time per rank ({sens7['low']:.2f}–"
            f"{sens7['high']:.2f}× over the band), the README table's formulas "
            f"{formula7:.2f}×; its step {true7['dualpipev']['step (ms)'] / true7['1f1b']['step (ms)']:.2f}× 1F1B's")
if E is not None:
    d_, o_ = em["dualpipev (F&B overlapped)"], em["1f1b"]
    # idle time per rank = bubble fraction x step (the replays of the sensitivity band time steps, not spans: the
    # bubble is judged at the calibrated figures)
    idle_ratio = d_["bubble %"] * d_["step (ms)"] / (o_["bubble %"] * o_["step (ms)"])
    toy_judged = judge(table_claim, idle_ratio, interval="the calibrated figures")
    emulated += (f". The toy on {E['gpu']} over {E['link']} (`{E['cluster']}`), timed as {E['stands_for']}'s "
                 f"layers at pp = {p}: DualPipeV's bubble {d_['bubble %']:.1f} % vs 1F1B's {o_['bubble %']:.1f} %, "
                 f"its step {d_['step (ms)'] / o_['step (ms)']:.3f}× 1F1B's (the toy's verdict: {toy_judged.word}); "
                 f"exposed p2p with F&B pairs {wire['dualpipev (F&B overlapped)']:.0f} µs vs "
                 f"{wire['dualpipev, no pairing']:.0f} µs unpaired")
headline("03", "DualPipeV (V-folded pipeline, zero-bubble W split, F&B pairs)",
         f"real bubble per rank {idle['dualpipev'] * 1e3:.2f} ms vs 1F1B's {idle['1f1b'] * 1e3:.2f} ms "
         f"({idle['dualpipev'] / idle['1f1b']:.2f}×, p = {p}, m = {r0['m']}, preset {preset}); simulated from the "
         f"measured op times {vs_1f1b['dualpipev'][1]:.2f}× 1F1B's bubble fraction; order identical to torch's "
         f"ScheduleDualPipeV: {same_order[r0['torch_order_identical']]}, gradients equal the single process: {ok}",
         value=idle["dualpipev"] / idle["1f1b"], unit="× 1F1B's bubble (real timeline)",
         claim="bubble (PP/2−1)(F&B+B−3W) against 1F1B's (PP−1)(F+B)", source="deepseek-ai/DualPipe README",
         reproduced=check("the same per-rank order as torch's ScheduleDualPipeV and gradients equal to the single "
                          "process (the bubble on shared CPU cores is measured, not judged)", bool(ok)),
         note=f"on CPU F&B = F + B (no stream overlap); with ops of {chunk_costs.F * 1e3:.2f} ms (F per chunk, "
              f"preset {preset}) the time between actions weighs on the real bubble",
         emulated=emulated, emulated_reproduced=judged7)

# %% [markdown]
# ## Try this
#
# - `m = 8` (the smoke preset runs 4) or `m = 16` (the default runs 8): in section 5's table the *simulated*
#   bubble % falls as 1/m; the real one, timed on cores the ranks share, need not follow.
# - In the explorer (section 9), set the `overlap` control, F&B/(F+B), to 0.5.
# - In the explorer, compare `schedule = "torch:zbv"` (ZB-V, also a V) with `schedule = "dualpipev"` at
#   equal costs.
#
# ## Sources
#
# DeepSeek-V3 technical report §3.2 (arXiv 2412.19437); `deepseek-ai/DualPipe`
# (`dualpipe/dualpipev.py`, README bubble table); Qi et al., *Zero Bubble Pipeline Parallelism*, ICLR 2024;
# `torch.distributed.pipelining.ScheduleDualPipeV` (pytorch#159591); MindSpeed-LLM `dualpipev` and MLA
# `a2a_hooked_on_attention`.
