# %% [markdown]
# # 12 · Dynamic context parallelism: a CP size for every sequence, chosen per micro-batch
#
# **The question.** Context parallelism (CP) splits a long sequence across ranks: each holds a slice of the
# tokens, and attention passes keys and values around a ring. Real training data is long-tailed — most documents
# are short, a few are very long — yet static CP cuts *every* sequence into as many pieces as the longest one
# needs, sends their K/V round the ring, and packs micro-batches by token count although attention's work grows
# with the *square* of a sequence's length. Megatron Core's Dynamic-CP picks a CP size per sequence, per
# micro-batch, and packs CP groups of equal work. Does it balance the ranks, what does it cost in ring traffic,
# and how much faster is a step? The source article reports 1.48× on a GitHub dataset and 1.25× on CommonCrawl.
#
# ```
#  static CP 2 on 4 ranks (2 DP replicas × CP 2), packs of ≤ 2 × 512 tokens:
#  every sequence is cut in two
#    ranks 0-1 │ 620 ─────────── │ 300 ───── │ 100 │         work Σ L²/2 = 242 k per rank
#    ranks 2-3 │ 440 ──────── │ 420 ──────── │ 80 │ 60 │     190 k per rank, then waits for ranks 0-1
#  dynamic CP on the same ranks, cap 512 tokens per rank (Megatron's rules)
#    ranks 0-1 │ 620 ─────────── │   cp 2 (620 > 512)         192 k per rank
#    rank 2    │ 440 ──────── │      cp 1, no ring            194 k
#    rank 3    │ 420 ──────── │      cp 1, no ring            176 k
#    (300, 100, 80, 60: the next micro-batch)
# ```

# %% tags=["parameters"]
import os
from typing import Optional

world_size: int = 4
preset: str = os.environ.get("TOOLKIT_PRESET", "default")  # smoke | default | full
backend: str = "auto"  # auto | gloo | nccl
cluster: str = "h100-ib400"  # emulated cluster under the run: h100-ib400 | a100-ib200 | pcie-100gbe | none
timeout_s: int = 600
sim_gbs: Optional[int] = None  # sequences per global batch in the simulation (None: 2048 as in the blog, 512 at smoke)
sim_cap: int = 8192  # tokens per rank per micro-batch in the simulation
lengths: Optional[list] = None  # the run's sequence lengths in tokens instead of the corpus's (None: the corpus's)

# %%
import inspect
import math
from dataclasses import replace

from IPython.display import Markdown, display

from toolkit import launch, viz
from toolkit.context import dcp_sim
from toolkit.context import ring_attention as ra
from toolkit.context.dynamic_cp import (Plan, advance, greedy_micro_batches, merge_buddies, modelled_step,
                                        schedule_dynamic)
from toolkit.data import doc_lengths
from toolkit.lessons import l12_dynamic_cp as lesson
from toolkit.report import SENSITIVITY, band, headline
from toolkit.runtime.bench import Claim, judge
from toolkit.runtime.bench import verdict
from toolkit.runtime.cluster import Cluster, Link
from toolkit.runtime.timeline import merge

# %% [markdown]
# ## 1 · Ring attention, the mechanism CP rests on
#
# A sequence of length L on a CP group of `cp` ranks is cut into 2·cp chunks; rank j keeps chunk j and chunk
# 2cp−1−j, one early and one late. Queries stay; K/V blocks travel one hop per step while the current block is
# computed (`isend`/`irecv` posted before the compute, waited after it). Each step merges a block of scores
# into a running max and sum (flash attention's online softmax), so the result equals one softmax over the row.
# With the causal mask, a block from an earlier rank meets all queries but only its first half of keys; a block
# from a later rank meets only the second half of the queries — half a block of work on every rank, every step.
# Cutting into `cp` contiguous pieces instead would leave the last rank with most of the work:

# %%
# NBVAL_CHECK_OUTPUT
for cp in (2, 4):
    print(f"cp={cp}, L=64: query-key pairs per rank, balanced {ra.causal_pairs(64, cp)}, "
          f"contiguous {ra.causal_pairs(64, cp, balanced=False)}")

# %% [markdown]
# The forward of the custom `autograd.Function` (the backward runs the ring again: dQ stays, dK/dV travel with
# their block and are home after `cp` hops). The block of each step is computed dense here, with a mask; on the
# emulated cluster (section 3b) `fused_kernel` times it as the one fused flash-attention kernel a GPU runs for
# packed sequences: the FLOPs of the pairs the mask lets through, its inputs and outputs once through memory.

# %%
print(inspect.getsource(ra._RingAttention.forward))

# %% [markdown]
# ## 2 · The lengths, and what the scheduler does with them
#
# The corpus is Python's standard library; its modules have the long tail of real code (GitHub-like). Work
# is what matters, and attention's work goes with L²: the few longest documents carry most of it.

# %%
lengths_all = sorted(x for x in doc_lengths() if x > 0)
edges = [2 ** k for k in range(4, 21)]
hist = [{"length (tokens)": f"≤{e // 1024}k" if e >= 1024 else f"≤{e}",
         "share": sum(1 for x in lengths_all if e // 2 < x <= e) / len(lengths_all), "of": "documents"}
        for e in edges]
hist += [{"length (tokens)": h["length (tokens)"], "of": "attention work (Σ L²)",
          "share": sum(x * x for x in lengths_all if e // 2 < x <= e) / sum(x * x for x in lengths_all)}
         for h, e in zip(hist, edges)]
display(viz.bars(hist, x="length (tokens)", y="share", color="of",
                 title=f"The corpus's {len(lengths_all)} documents: how many, and how much attention work"))

# %%
# NBVAL_CHECK_OUTPUT
n = len(lengths_all)
top = lengths_all[int(0.95 * n):]
print(f"{n} documents, median {lengths_all[n // 2]} tokens, longest {lengths_all[-1]}; the longest 5 % "
      f"({len(top)}) carry {100 * sum(x * x for x in top) // sum(x * x for x in lengths_all)} % of Σ L²")

# %% [markdown]
# **The scheduler** (`toolkit.context.dynamic_cp`, Megatron's `DefaultDynamicCPScheduler` algorithm). Each
# sequence needs cp(L) = 2^⌈log₂(L / cap)⌉ ranks so that no rank holds more than `cap` tokens (by construction).
# Per micro-batch: sort what is left, longest first, into k buckets of about equal work (k = distinct CP sizes);
# place the head of the first placeable bucket on a new group while free ranks remain, else into the least
# loaded group of its size with room; once a smaller CP size has appeared, close the micro-batch as soon as
# every rank is within `delta` of the busiest (source: Megatron's threshold, 5 %); double groups to fill empty
# ranks. Groups are aligned power-of-two blocks, so their process groups are built once.
#
# Work L²/cp is what Megatron's rules balance, but it is not time: a sequence spread over more ranks also sends
# its K/V round a longer ring. The toolkit adds two steps, taken only where a **cost model** says they pay
# (`schedule_dynamic(..., cost=)`; without one, Megatron's rules as they are). The cost of a group is its
# modelled forward and backward time, ring hops included (`dcp_sim.CostModel`: the GEMMs and attention at the
# GPU's calibrated rates, each hop as NCCL sends it on the link, exposed where it outlasts the attention it hides
# behind);
# the scheduler keeps a clock per rank, and a group starts once all its ranks are free. **Refill** keeps
# placing the longest sequence that fits where Megatron closes the micro-batch, into a group that still ends no
# later than the micro-batch's last; **merge** joins the group that ends last with its neighbouring block
# (twice the CP size) while that makes the micro-batch end sooner. Both are greedy, one micro-batch at a time,
# and a micro-batch that ends sooner can still leave a later one worse off: so the plan they build is kept only
# if its modelled step is shorter than Megatron's plan's, else Megatron's plan is the toolkit's too. Neither
# step looks at the balance of work: a merge the ring would make slower is not made. A small example, 4 ranks, cap 64 tokens, under the cost model
# the run's scheduler uses (the toy's lengths and widths scaled to Llama-13B's, see section 3b) and under the
# same model with a ring of 1 GB/s and 1 ms per hop:

# %%
# NBVAL_CHECK_OUTPUT
example = [128, 96, 64, 64, 48, 32, 24, 16, 16, 8, 8, 8]
run_cost = lesson.cost_model(lesson.model_config(lesson.validate({"preset": preset}, world_size)),
                             lesson.scheduler_cluster(cluster))
slow_ring = replace(run_cost, hw=replace(run_cost.hw, intra=Link("a slow ring", 1e9, 1e-3)))
example_plans = {"Megatron's rules": schedule_dynamic(example, 4, 64),
                 "toolkit, the run's cost model": schedule_dynamic(example, 4, 64, cost=run_cost),
                 "toolkit, a slow ring": schedule_dynamic(example, 4, 64, cost=slow_ring)}
for title, plan in example_plans.items():
    print(title)
    for i, mb in enumerate(plan.micro_batches):
        print(f"  micro-batch {i}: " + "  ".join(f"ranks {g.ranks}: cp {g.size} {[example[s] for s in g.samples]}"
                                                  for g in mb.groups)
              + f"   work/rank {[int(w) for w in plan.work(i)]}")

# %%
megatron_ex, toolkit_ex, slow_ex = example_plans.values()
ms_ex = {name: {ring: modelled_step(plan, cost) * 1e3 for ring, cost in (("fast", run_cost), ("slow", slow_ring))}
         for name, plan in (("megatron", megatron_ex), ("toolkit", toolkit_ex), ("slow", slow_ex))}
same = toolkit_ex.to_json()["micro_batches"] == slow_ex.to_json()["micro_batches"]
display(Markdown(
    f"Modelled steps (cost model). On the run's cluster: Megatron's rules {ms_ex['megatron']['fast']:.1f} ms, the "
    f"toolkit's plan {ms_ex['toolkit']['fast']:.1f} ms. With the slow ring: Megatron's rules "
    f"{ms_ex['megatron']['slow']:.1f} ms, the toolkit's plan for that ring {ms_ex['slow']['slow']:.1f} ms"
    + (". The two toolkit plans are the same here: at these sizes no merge pays on either ring, only refill does."
       if same else f", and the plan made for the fast ring would take {ms_ex['toolkit']['slow']:.1f} ms there: "
       f"how far the merges go depends on the ring they pay for.")))

# %% [markdown]
# ## 3 · The run: static vs dynamic CP on `world_size` ranks
#
# `l12_dynamic_cp`: every rank loads `batch` sequences whose lengths are real corpus document lengths divided by
# `length_scale` (so that a CPU can train on them; the tail stays) and truncated to `static_cp · cap`, padded to
# a multiple of 2·world_size. The ranks all-gather the lengths, build three plans (the same on every rank):
# static CP, dynamic CP with Megatron's rules as they are, and the toolkit's dynamic CP (refill and merge under
# the cost model, planned for the run's emulated cluster, or for `h100-ib400` without one). They reroute the
# shards with one `all_to_all_single` per plan, and run a training step of the tiny GPT through each plan's
# micro-batches — ring attention inside every CP group, the rest of the model token by token. The reference
# runs every sequence alone, unpacked, through the same model. Then the three steps are timed side by side.
# The lesson's knobs (`cap`, `min_cp`, `static_cp`, `lengths`, ...) go into `cfg` below; everything after the
# launch reads the configuration the run resolved, `r0["cfg"]`.

# %%
cfg = {"preset": preset, "lengths": lengths}  # add knobs here, e.g. "cap": 128; launch validates them first
results = launch("l12_dynamic_cp", world_size, cfg, backend=backend, timeout_s=timeout_s, cluster=cluster)
r0 = results[0]
cfg = r0["cfg"]  # the configuration the run resolved: every plan below was built from it
plans = lesson.plans_of(r0)
label = {"static": "static", "dynamic-megatron": "dynamic (Megatron's rules)", "dynamic": "dynamic (toolkit)"}
plans_all = {label[k]: plans[k] for k in label}
M, T = label["dynamic-megatron"], label["dynamic"]
said_as = {"static": "static CP", M: "Megatron's rules", T: "the toolkit's plan"}
cost = lesson.cost_model(lesson.model_config(cfg), Cluster.from_dict(r0["scheduler"]["cluster"]))
print(f"{world_size} ranks, {len(r0['lengths'])} sequences, {r0['n_tokens']} tokens, cap {cfg['cap']} tokens per rank, "
      f"static CP {cfg['static_cp']} x DP {world_size // cfg['static_cp']}; model {r0['model']['n_layer']} layers × "
      f"d={r0['model']['d_model']}; the toolkit's scheduler planned for {cost.hw.name}; wall {results.wall_s:.1f} s")

# %% [markdown]
# **Checks.** Every sample is scheduled exactly once, groups are aligned power-of-two blocks, no rank holds more
# than `cap` tokens (by construction, verified by `Plan.check`); each rank received exactly its shards. The per-token
# loss of every plan equals
# the unpacked reference within a relative 1e-5, and the gradients summed over the ranks within 1e-5 (float32:
# packing, sharding and the ring only reorder additions). Ring attention on random packed sequences over the
# whole world equals one-process attention within 1e-5. The ring bytes the ledger counted equal the closed form
# per layer — forward (cp−1)·2·T·d·4 B, backward (cp−1)·2·T·d·4 B for K/V plus cp·2·T·d·4 B for dK/dV — on
# every rank. And the toolkit's merges went as far as they pay: no merge is left in its greedy plan that would
# end a micro-batch sooner under its cost model (its balance of work is no target, and is not checked); its plan
# is that greedy plan where its modelled step is shorter than Megatron's plan's, else Megatron's.

# %%
for name, plan in plans.items():
    plan.check()
    for r in results:
        assert r["plans"][name] == r0["plans"][name]
        assert r["tokens_per_mb"][name] == [plan.tokens(i)[r["rank"]] for i in range(len(plan.micro_batches))]
        ref = r["checked"]["reference"]["loss_per_token"]
        assert abs(r["checked"][name]["loss_per_token"] - ref) <= lesson.LOSS_RTOL * ref
        assert r["checked"][name]["max_grad_diff"] <= lesson.GRAD_ATOL
        for b in r["ring_bytes"][name].values():
            assert b["ledger"] == b["closed_form"], b
for r in results:
    assert max(r["selfcheck"]["max_abs_diff"].values()) <= 1e-5 and r["selfcheck"]["sent_bytes"] == r["selfcheck"]["closed_form"]
greedy = Plan("dynamic", r0["padded"], world_size, cfg["cap"],
              greedy_micro_batches(r0["padded"], world_size, cfg["cap"], cfg["min_cp"], cost=cost))
clock = [0.0] * world_size
for mb in greedy.micro_batches:
    assert merge_buddies(mb, greedy.lengths, world_size, cost, clock).groups == mb.groups
    advance(clock, mb, greedy.lengths, cost)
greedy_kept = modelled_step(greedy, cost) < modelled_step(plans["dynamic-megatron"], cost)
chosen = greedy if greedy_kept else plans["dynamic-megatron"]  # the toolkit's plan: the shorter modelled step
assert plans["dynamic"].to_json()["micro_batches"] == chosen.to_json()["micro_batches"]
balance = {name: plan.balance() for name, plan in plans_all.items()}


def worst(plan) -> str:
    """The worst micro-batch's work max/mean over ranks; none for static CP over all the ranks (dp = 1), whose
    micro-batches are one group each (max/mean 1 by definition: its imbalance lies across micro-batches)."""
    one_group = plan.kind.startswith("static") and plan.micro_batches[0].groups[0].size == plan.n_ranks
    return "n/a (one group per micro-batch)" if one_group else f"{max(plan.balance()):.2f}"


def above_need(plan, need_one: bool) -> int:
    """Sequences that run on more ranks than they need (cp(L)): among those that need one rank (a ring they could
    do without), or among the others (a longer ring)."""
    return sum(size > r0["need"][s] and (r0["need"][s] == 1) == need_one for s, size in plan.cp_sizes().items())

# %%
# NBVAL_CHECK_OUTPUT
need = {c: r0["need"].count(c) for c in sorted(set(r0["need"]))}
print(f"CP size each sequence needs (sequences per size): {need}")
for name, plan in plans_all.items():
    sizes = plan.cp_sizes()
    ring = sum(sum(x.values()) for x in plan.ring_bytes(r0["model"]["d_model"], 4, r0["model"]["n_layer"]))
    print(f"{name:27s} micro-batches {len(plan.micro_batches):2d}  worst max/mean {worst(plan)}  "
          f"CP sizes used {dict(sorted({c: list(sizes.values()).count(c) for c in set(sizes.values())}.items()))}  "
          f"above their need {above_need(plan, True) + above_need(plan, False)}  ring bytes (all ranks, fwd+bwd) {ring}")
print("ledger == closed form on every rank:", all(b["ledger"] == b["closed_form"] for r in results
                                                 for v in r["ring_bytes"].values() for b in v.values()))
print("loss and grads equal the unpacked reference:", all(
    abs(r["checked"][k]["loss_per_token"] - r["checked"]["reference"]["loss_per_token"])
    <= lesson.LOSS_RTOL * r["checked"]["reference"]["loss_per_token"] for r in results for k in plans))

# %% [markdown]
# **Which groups were chosen.** Each column is a micro-batch, each row a rank; the number is the CP size of the
# group the rank is in (static: always `static_cp`).

# %%
for name in ("static", T):
    plan = plans_all[name]
    z = [[mb.group_of(rank).size for mb in plan.micro_batches] for rank in range(world_size)]
    display(viz.heatmap(z, x=[f"mb {i}" for i in range(len(plan.micro_batches))],
                        y=[f"rank {r}" for r in range(world_size)], title=f"{name}: CP size per rank and micro-batch",
                        colorbar_title="CP size", text_format=".0f"))

# %%
display(viz.lines({name: b for name, b in balance.items()},
                  title="Work max/mean per micro-batch (work Σ L²/cp only, no ring; 1 = balanced)",
                  xaxis_title="micro-batch", yaxis_title="max / mean of Σ L²/cp over ranks"))
pred = {label[k]: v for k, v in lesson.predicted(r0).items()}
ring_mib = {name: sum(sum(x.values()) for x in plan.ring_bytes(r0["model"]["d_model"], 4, r0["model"]["n_layer"]))
            / 2**20 for name, plan in plans_all.items()}
work_rows = [{"plan": name, "micro-batches": len(plan.micro_batches), "step (ms)": pred[name]["step_s"] * 1e3,
              "exposed ring (ms)": pred[name]["exposed_comm_s"] * 1e3, "ring MiB (closed form)": ring_mib[name],
              "sequences above their CP need": above_need(plan, True) + above_need(plan, False)}
             for name, plan in plans_all.items()]
display(viz.table(work_rows, title=f"This batch under the cost model (ring included; the toy timed as "
                                   f"{r0['scheduler']['stands_for']}'s layers on {cost.hw.gpu.name}): step and ring",
                  formats={"step (ms)": ".1f", "exposed ring (ms)": ".1f", "ring MiB (closed form)": ".3f"}))

# %%
pm = {name: pred[name]["step_s"] * 1e3 for name in plans_all}
ones = r0["need"].count(1)


def modelled(a: str, b: str = "static") -> str:
    """Plan ``a``'s modelled step against plan ``b``'s, in words."""
    ratio = pm[b] / pm[a]
    return (f"{ratio:.3f}× faster than" if ratio > 1 else f"{1 / ratio:.3f}× slower than" if ratio < 1
            else "as fast as") + {"static": " static CP", M: " Megatron's rules"}[b]


display(Markdown(
    f"Under the cost model (ring included):\n\n- a step takes {pm['static']:.0f} ms with static CP, {pm[M]:.0f} ms with "
    f"Megatron's rules and {pm[T]:.0f} ms with the toolkit's plan: Megatron's rules are {modelled(M)}, the "
    f"toolkit's plan {modelled(T)} and {modelled(T, M)};\n- ring traffic: {ring_mib[T]:.3f} MiB for the toolkit's "
    f"plan, {ring_mib[M]:.3f} MiB for Megatron's rules, {ring_mib['static']:.3f} MiB for static CP;\n- of the {ones} "
    f"sequences that need no ring, the toolkit's plan puts {above_need(plans_all[T], True)} on a ring anyway "
    f"(Megatron's rules {above_need(plans_all[M], True)}, where a group is doubled for idle ranks; static CP all of "
    f"them), and "
    f"of the {len(r0['need']) - ones} others {above_need(plans_all[T], False)} on a longer ring than they need "
    f"(Megatron's rules {above_need(plans_all[M], False)}).\n\n"
    + ("Every merge it made ended its micro-batch sooner under the cost model, and every merge it declined would "
       "not have; added up, its plan's modelled step is the shorter." if greedy_kept else
       f"Its refill and merge steps, each of which ended its own micro-batch no later, added up to a modelled step "
       f"of {modelled_step(greedy, cost) * 1e3:.0f} ms, no shorter than Megatron's rules': so the toolkit kept "
       f"Megatron's plan, and the two are the same here.")))

# %% [markdown]
# **Measured on this machine** (trimmed mean of the rounds, `toolkit.runtime.bench.compare`, the three steps
# round-robin). With `world_size` ranks sharing two CPU cores, a rank that waits can give its core to another, so
# imbalance need not cost wall time here, while every ring hop is a synchronisation between processes that share
# cores: this timing says little about GPUs — section 3b times the same steps on an emulated cluster.

# %%
bench = {label[k]: [r["bench"][k] for r in results] for k in r0["bench"]}  # per plan, every rank's rounds
ms = {k: v[0]["mean_s"] * 1e3 for k, v in bench.items()}
display(viz.bars([{"plan": k, "ms": v} for k, v in ms.items()], x="plan", y="ms",
                 title="Training step (forward + backward over the micro-batches), measured", text_format=".1f"))


def versus(a: str, b: str) -> str:
    """Plan ``a``'s measured step against plan ``b``'s, judged by ``bench.verdict`` over the paired rounds of every
    rank: faster, slower or within noise, with the interval it used."""
    v = verdict(bench[b], bench[a])
    other = {"static": "static CP", M: "Megatron's rules"}.get(b, b)
    relation = {"faster": "faster than", "slower": "slower than", "within noise": "within noise of"}.get(
        v.word, "not decidable against")
    return (f"{relation} {other} ({v.ratio:.2f}× its time, 95 % interval [{v.low:.2f}, {v.high:.2f}] over "
            f"{v.rounds} paired rounds)")


follows = verdict(bench["static"], bench[T]).word  # does the measured step follow the modelled one?
display(Markdown(
    f"Measured step: static CP {ms['static']:.1f} ms, Megatron's rules {ms[M]:.1f} ms, the toolkit's plan "
    f"{ms[T]:.1f} ms (rank 0's trimmed means). The toolkit's dynamic plan is "
    f"{versus(T, 'static')}; Megatron's rules are {versus(M, 'static')}; the toolkit's plan is "
    f"{versus(T, M)}.\n\n"
    + {"faster": "This agrees in direction with the cost model above, "
                 f"{modelled(T)}. ",
       "slower": f"So on this machine the step does not follow the cost model above ({modelled(T)}): with the "
                 f"ranks sharing cores, waiting costs little, while the {ring_mib[T]:.1f} MiB of ring traffic "
                 f"(static {ring_mib['static']:.1f}, Megatron's rules {ring_mib[M]:.1f}) are hops between "
                 f"processes that must all be scheduled. "}.get(
        follows, f"So this run cannot tell whether the step follows the cost model above ({modelled(T)}). ")
    + "A CPU timing is not evidence about GPU step times either way."))

# %% [markdown]
# ## 3b · The same steps on an emulated H100 node
#
# The launch above also ran on an **emulated cluster** (the `cluster` parameter, `toolkit.runtime.emulator`):
# the same processes, ops and bytes, and beside the wall clock a virtual clock per rank that times every ATen op
# at what the target GPU's kernels achieve (the host pays its time per eager op) and every ring send as NCCL
# times it on the link the CP group spans; a receive completes when the sender's bytes arrive, so a rank waits for its ring
# as it would on GPUs. The checked and timed steps ran **workload-matched** (`dcp_sim.stretch_scales`): every
# length and width of the toy times r = 5120 / d_model, so each op is timed as the same op of Llama-13B's layers
# on sequences r times as long — attention and linear work, compute and ring bytes in the real model's
# proportions. Ring attention's blocks are timed as fused flash-attention kernels (section 1). Beside the
# virtual step, the cost model's prediction for the same plans (`lesson.predicted`: rank clocks, the GEMMs and
# attention at the GPU's peak, the ring's exposed hops): it leaves out the per-element ops (LayerNorms,
# activations, the loss), which the emulator times at the GPU's memory bandwidth.

# %%
E = r0["emulated"]
if E is None:
    display(Markdown("This run had no emulated cluster (`cluster = none`, or the `nccl` backend, which sets it "
                     "aside): there is no time on GPUs to show, only the cost model above."))
else:
    virtual = {label[k]: [r["bench"][k]["virtual"] for r in results] for k in r0["bench"]}
    judged = {(a, b): verdict(virtual[a], virtual[b]) for a, b in (("static", M), ("static", T), (M, T))}
    v_ms = {k: verdict(v, v).a_s * 1e3 for k, v in virtual.items()}  # each round's slowest rank
    ring_ms = {label[k]: max(sum(sum(d.values()) for d in r["emulated"]["ring_link_s"][k].values()) for r in results)
               * 1e3 for k in r0["bench"]}
    display(viz.table([{"plan": k, "emulated step (ms)": v_ms[k], "cost model (ms)": pm[k],
                        "emulated / cost model": v_ms[k] / pm[k], "ring on the link (ms, busiest rank)": ring_ms[k]}
                       for k in v_ms],
                      title=f"One step on the emulated {E['gpu']} (virtual time, matched to Llama-13B at r = "
                            f"{E['scales']['scale']:g}) beside the cost model's prediction",
                      formats={"emulated step (ms)": ".1f", "cost model (ms)": ".1f", "emulated / cost model": ".3f",
                               "ring on the link (ms, busiest rank)": ".1f"}))
    display(viz.gantt(merge([r["spans"] for r in results], clock="virtual"), color_by="kind", label="cp",
                      title=f"The checked steps on the emulated {E['gpu']} (virtual time), one after the other: "
                            f"each bar a micro-batch of a rank, labelled with its CP size"))

# %%
def said(a: str, b: str) -> str:
    """Plan ``b``'s emulated step against plan ``a``'s, as a ratio (virtual time is deterministic, but the model
    behind it is not exact: the headline judges the ratio over the model's sensitivity band)."""
    if plans_all[a].to_json()["micro_batches"] == plans_all[b].to_json()["micro_batches"]:
        return f"{said_as[b]} is {said_as[a]}' plan here ({v_ms[b]:.1f} and {v_ms[a]:.1f} ms)"
    return f"{said_as[b]} takes {judged[(a, b)].ratio:.3f}× {said_as[a]}' step"


if E is not None:
    factors = [v_ms[k] / pm[k] for k in v_ms]
    cm_ratio = pm["static"] / pm[M]
    display(Markdown(
        f"**On the emulated {E['gpu']}** ({E['link']}, preset `{E['cluster']}`; virtual time, a model), one step "
        f"takes {v_ms['static']:.0f} ms with static CP, {v_ms[M]:.0f} ms with Megatron's rules and "
        f"{v_ms[T]:.0f} ms with the toolkit's plan: {said('static', M)}, {said('static', T)}, "
        f"{said(M, T)}. The cost model predicted "
        f"{cm_ratio:.3f}× for Megatron's rules over static CP against {v_ms['static'] / v_ms[M]:.3f}× emulated; its "
        f"steps are the emulated ones divided by {min(factors):.3f} to {max(factors):.3f}: the per-element ops it "
        f"leaves out add a like share to every plan, so it ranks the plans as the emulated run does"
        + ("" if (pm["static"] > pm[T]) == (v_ms["static"] > v_ms[T]) and (pm[M] > pm[T]) == (v_ms[M] > v_ms[T])
           else " — except where two plans are within that spread of each other") + "."))

# %% [markdown]
# ## 4 · Simulated: the seed's scale (Llama-13B, PP8 × 8 DP·CP ranks, 2048 sequences, full recompute)
#
# **Simulation, not measurement.** `toolkit.context.dcp_sim` times a step from a cost model: linear layers and
# attention at the `h100-ib400` preset's achieved rates (its GPU's efficiency model, calibrated on published
# GEMM and FlashAttention throughput: `toolkit.runtime.efficiency`), each ring hop
# at an assumed link bandwidth and latency (`dcp_sim.RING_HOP`, in place of the preset's NVLink), overlapped with
# 1/cp of the attention it feeds; a micro-batch's stage time is its slowest group's; 1F1B over 8 stages with these
# unequal micro-batches is timed by `toolkit.pipeline.simulate`. Up to `sim_cap` tokens per rank, sequences up to
# 8·`sim_cap` (static CP is the size the longest needs). Two length distributions: **GitHub-like** = this
# corpus's document lengths (code; one byte = one token), **CommonCrawl-like** = a log-normal (median 800 tokens,
# σ = 1.2) — *an assumption*, not CommonCrawl data. Four plans: static CP packed in data order (the blog's
# baseline), static CP packed **longest first** — the ablation: the same CP size for every sequence, but
# micro-batches of alike work that change gradually, the packing half of what dynamic CP does — Megatron's rules,
# and the toolkit's scheduler (its cost model this simulation's, section 3b's at the run's scale).

# %%
setup = dcp_sim.Setup(cap=sim_cap, gbs=sim_gbs if sim_gbs is not None else (512 if preset == "smoke" else 2048))
hw = dcp_sim.CLUSTER
max_len = setup.dcp * setup.cap
dists = {"GitHub-like (corpus)": dcp_sim.corpus_lengths(setup.gbs, max_len),
         "CommonCrawl-like (assumed log-normal)": dcp_sim.lognormal_lengths(setup.gbs, max_len)}
sim_plans = {d: dcp_sim.plans_for(lengths, setup, hw=hw) for d, lengths in dists.items()}
sims = {d: dcp_sim.compare(dists[d], setup, hw=hw, plans=sim_plans[d]) for d in dists}
print(f"{setup.gbs} sequences per step, cap {setup.cap} tokens per rank, PP {setup.pp} × {setup.dcp} DP·CP ranks; "
      f"hardware: {hw.name} ({hw.gpu.name}, ring hop {hw.intra.bytes_per_s / 1e9:.0f} GB/s, α "
      f"{hw.intra.latency_s * 1e6:.0f} µs: {hw.intra.source}); GEMMs up to {hw.gpu.efficiency.gemm:.0%} and "
      f"causal attention {hw.gpu.efficiency.attention_causal:.0%} of the bf16 peak")

# %%
for d, sim in sims.items():
    for name, run in sim["runs"].items():
        assert run["pipelines"] >= 1 and run["step_s"] >= run["busy_s"] * (1 - 1e-9)  # a step is never shorter
        parts_sum = run["compute_s"] + run["exposed_comm_s"] + run["bubble_s"]
        assert abs(parts_sum - run["step_s"]) <= 1e-9 * run["step_s"]  # step = compute + exposed ring + bubble
    ab = sim["ablation"]
    assert abs(ab["packing"] * ab["cp_size_per_sequence"] - ab["whole"]) <= 1e-9 * ab["whole"]  # the split is whole

# %%
# NBVAL_CHECK_OUTPUT
for d, sim in sims.items():
    print(d, f"static CP {sim['static_cp']}:",
          {name: {"micro-batches": run["micro_batches"], "CP sizes": run["cp_sizes"]} for name, run in sim["runs"].items()})

# %%
table_rows = []
for d, sim in sims.items():
    for name, run in sim["runs"].items():
        table_rows.append({"lengths": d.split(" ")[0], "plan": name, "step (s)": run["step_s"],
                           "speed-up": run["speedup_vs_static"], "TFLOPS/GPU": run["tflops_per_gpu"],
                           "compute (s)": run["compute_s"], "exposed ring (s)": run["exposed_comm_s"],
                           "pipeline bubble (s)": run["bubble_s"], "micro-batches": run["micro_batches"],
                           "worst max/mean": (None if name.startswith("static") and sim["static_cp"] == setup.dcp
                                              else run["balance_max"])})
if any(sim["static_cp"] == setup.dcp for sim in sims.values()):
    display(Markdown(f"Worst max/mean: the worst micro-batch's work max/mean over the ranks. Static CP{setup.dcp} on "
                     f"{setup.dcp} ranks is one group per micro-batch, so its value is 1 by definition and left blank: "
                     "static CP's imbalance lies across micro-batches, and shows as the pipeline bubble."))
display(viz.table(table_rows, title="Simulated step (cost model, assumed hardware)",
                  formats={k: ".2f" for k in ("step (s)", "speed-up", "compute (s)", "exposed ring (s)",
                                               "pipeline bubble (s)", "worst max/mean")} | {"TFLOPS/GPU": ".0f"}))
parts = [{"run": f"{r['lengths']} · {r['plan']}", "seconds": r[k], "part": k}
         for r in table_rows for k in ("compute (s)", "exposed ring (s)", "pipeline bubble (s)")]
display(viz.bars(parts, x="run", y="seconds", color="part", barmode="stack",
                 title="Where the simulated step goes"))

# %%
bandwidths = [25, 100, 400]
sweeps = {d: dcp_sim.bandwidth_sweep({k: v for k, v in sim_plans[d].items() if k in ("static", "dynamic")},
                                     bandwidths, setup, hw=hw) for d in dists}
display(viz.lines({d.split(" ")[0]: s["dynamic"] for d, s in sweeps.items()}, x=bandwidths,
                  title="Simulated speed-up of dynamic CP over static CP vs ring link bandwidth (rescheduled for "
                        "each link)", xaxis_title="GB/s per ring hop", yaxis_title="speed-up (×)", log_x=True))

# %%
gh, cc = (sims[d]["runs"] for d in dists)
ab_gh, ab_cc = (sims[d]["ablation"] for d in dists)
gh_s, cc_s = gh["static"], cc["static"]
sw_gh, sw_cc = (sweeps[d]["dynamic"] for d in dists)


def split(runs: dict) -> str:
    """Where the simulated step time dynamic CP saves comes from: step = compute + exposed ring + bubble, so the
    three shares sum to 100 %; a negative share is time dynamic CP spends more."""
    saved = runs["static"]["step_s"] - runs["dynamic"]["step_s"]
    if saved <= 0:
        return f"dynamic CP saves no time here ({saved:+.2f} s)"
    sh = {p: round(100 * (runs["static"][k] - runs["dynamic"][k]) / saved)  # whole percent: no "-0 %"
          for p, k in (("bubble", "bubble_s"), ("exposed ring", "exposed_comm_s"), ("compute", "compute_s"))}
    text = "of the time saved, " + ", ".join(f"{p} {v} %" for p, v in sh.items())
    if sh["compute"] < 0:
        text += (f"; compute is negative because dynamic CP's critical path computes more, {runs['static']['compute_s']:.2f} → "
                 f"{runs['dynamic']['compute_s']:.2f} s, so the other two exceed 100 %")
    return text


def sweep_text(speedups: list[float]) -> str:
    return ", ".join(f"{x:.2f}× at {bw} GB/s" for x, bw in zip(speedups, bandwidths))


def ablation_text(ab: dict) -> str:
    """The speed-up over static CP in data order, split into packing longest first and a CP size per sequence."""
    share = 100 * math.log(ab["packing"]) / math.log(ab["whole"]) if ab["whole"] > 1 else float("nan")
    return (f"packing longest first gives static CP {ab['packing']:.2f}× its speed, a CP size per sequence "
            f"{ab['cp_size_per_sequence']:.2f}× on top ({ab['whole']:.2f}× in all"
            + (f"; packing's share of the gain, in log time: {share:.0f} %" if ab["whole"] > 1 else "") + ")")


order = "more" if gh["dynamic"]["speedup_vs_static"] > cc["dynamic"]["speedup_vs_static"] else "less"
display(Markdown(
    f"**What the simulation gives.** GitHub-like: **{gh['dynamic']['speedup_vs_static']:.2f}×** "
    f"({gh['dynamic-megatron']['speedup_vs_static']:.2f}× with Megatron's rules as they are); the blog reports "
    f"1.48×. CommonCrawl-like: **{cc['dynamic']['speedup_vs_static']:.2f}×** "
    f"({cc['dynamic-megatron']['speedup_vs_static']:.2f}×); the blog reports 1.25×. Modelled TFLOPS/GPU, static → "
    f"dynamic: {gh_s['tflops_per_gpu']:.0f} → {gh['dynamic']['tflops_per_gpu']:.0f} (GitHub-like; blog 195.88 → "
    f"289.32) and {cc_s['tflops_per_gpu']:.0f} → {cc['dynamic']['tflops_per_gpu']:.0f} (blog 139.17 → 174.39); the "
    f"absolute values follow from the assumed FLOP/s, only the ratios are worth comparing.\n\n"
    f"**The ablation.** GitHub-like: {ablation_text(ab_gh)}. CommonCrawl-like: {ablation_text(ab_cc)}.\n\n"
    f"**Why.**\n\n- GitHub-like: static CP{sims[list(dists)[0]]['static_cp']} packs sequences in data order, so the "
    f"pipeline's micro-batches carry very different attention work (one holds a long document, the next short "
    f"ones), and 1F1B stalls on the heavy ones: a pipeline bubble of {gh_s['bubble_s']:.1f} s in a "
    f"{gh_s['step_s']:.1f} s step, against {gh['static-sorted']['bubble_s']:.1f} s packed longest first and "
    f"{gh['dynamic']['bubble_s']:.1f} s for dynamic CP, whose micro-batches also come longest first; exposed ring "
    f"time {gh_s['exposed_comm_s']:.1f} s against {gh['dynamic']['exposed_comm_s']:.1f} s ({split(gh)}).\n"
    f"- CommonCrawl-like: most sequences fit one rank; static CP{sims[list(dists)[1]]['static_cp']} still cuts them "
    f"up and sends their K/V round the ring: {cc_s['exposed_comm_s']:.2f} s exposed in a {cc_s['step_s']:.2f} s "
    f"step, against {cc['dynamic']['exposed_comm_s']:.2f} s ({split(cc)}).\n- So that gain depends on the link: "
    f"{sweep_text(sw_cc)}, while the GitHub-like one is {sweep_text(sw_gh)}.\n\nWith the assumed constants the model "
    f"gives {order} gain on the long-tailed code lengths than on the short web-like ones, "
    f"{'as the blog found' if order == 'more' else 'the opposite of the blog'}; how close the values come to the "
    f"blog's depends on those constants."))

# %% [markdown]
# ## 4b · The source's setting at true shapes (a model)
#
# **Simulated, from traces.** Section 4's cost model is written by hand; here the lesson's own layer
# (`ra.shard_layer`: the block the run above executes, ring attention inside) is traced at Llama-13B's widths in
# bf16 on fake tensors (`toolkit.runtime.shapes.estimate`, the `h100-ib400` preset: the blog names no hardware),
# each CP size on torch's fake process group of that many ranks, its ring sends at their true bytes on NVLink.
# Section 4's GitHub-like lengths and plans' rules (static CP in data order, Megatron's, the toolkit's) decide
# the groups; each group's layer is its sequences' traced ops added op by op; 1F1B over 8 stages, full recompute
# (`toolkit.lessons.l12_true_shapes`).

# %%
from toolkit.lessons.l12_true_shapes import SOURCE

true = lesson.true_shapes(dists["GitHub-like (corpus)"], setup)
true_claim = Claim.ratio("static CP's step / dynamic CP's (Megatron's rules)", 1.48, tolerance=0.25,
                         source="NVIDIA blog, Dynamic CP in Megatron Core (2026)",
                         setting=f"the blog's: Llama-13B, GBS 2048, PP8 x 8, GitHub; the model's: the same shapes "
                                 f"traced on {true['cluster']}, {true['sequences']} corpus documents (code)")
true_sens = band("static / dynamic (Megatron's rules) step, traced at true shapes", true["sensitivity"],
                 key="dynamic-megatron")
true_verdict = judge(true_claim, true_sens["value"], true_sens["low"], true_sens["high"], SENSITIVITY)
flat = lesson.true_shapes([4096] * 256, replace(setup, gbs=256))  # every sequence fits one rank
flat_verdict = judge(true_claim, *(band("uniform", flat["sensitivity"], key="dynamic-megatron")[k]
                                   for k in ("value", "low", "high")), SENSITIVITY)
tr = true["runs"]
assert tr["static"]["step_s"] >= tr["static"]["busy_s"] and true["static_cp"] == setup.dcp
rows = [{"plan": name, "TFLOPS/GPU": r["tflops_per_gpu"], "source": "model (traced)"} for name, r in tr.items()]
rows += [{"plan": "static", "TFLOPS/GPU": SOURCE["static"], "source": "the blog (measured)"},
         {"plan": "dynamic-megatron", "TFLOPS/GPU": SOURCE["dynamic"], "source": "the blog (measured)"}]
viz.bars(rows, x="plan", y="TFLOPS/GPU", color="source", text_format=".0f",
         title=f"Model TFLOPS/GPU, simulated from traces at true shapes ({true['gpu']}) beside the blog's").show()

# %%
ts_m, ts_s = tr["dynamic-megatron"], tr["static"]
sp = true["speedup"]
true_ab = {"packing": sp["static-sorted"], "cp_size_per_sequence": sp["dynamic-megatron"] / sp["static-sorted"],
           "whole": sp["dynamic-megatron"]}
saved = ts_s["step_s"] - ts_m["step_s"]
bubble_share = (ts_s["bubble_s"] - ts_m["bubble_s"]) / saved if saved > 0 else float("nan")
lower = ts_s["tflops_per_gpu"] < SOURCE["static"] and ts_m["tflops_per_gpu"] < SOURCE["dynamic"]
display(Markdown(
    f"**What the traced model gives.** {true['sequences']} documents ({true['tokens'] / 1e6:.1f} M tokens, the "
    f"longest {true['longest']}) on {true['gpus']} GPUs: static CP{true['static_cp']} takes {ts_s['step_s']:.0f} s "
    f"a step, Megatron's rules {ts_m['step_s']:.0f} s, the toolkit's plan {tr['dynamic']['step_s']:.0f} s (model). "
    f"Speed-up **{sp['dynamic-megatron']:.2f}×** ({true_sens['low']:.2f}–{true_sens['high']:.2f}× over the band) "
    f"against the blog's 1.48×: **{true_verdict.word}**. Of the time Megatron's rules save, the pipeline bubble "
    f"is {bubble_share:.0%} (static CP's {ts_s['bubble_s']:.0f} s against {ts_m['bubble_s']:.0f} s); compute "
    f"{ts_s['compute_s']:.0f} s against {ts_m['compute_s']:.0f} s; static CP's exposed ring "
    f"{ts_s['exposed_comm_s']:.2f} s in its {ts_s['step_s']:.0f} s step, on {true['cluster']}'s NVLink.\n\n"
    f"Model TFLOPS/GPU {ts_s['tflops_per_gpu']:.0f} → {ts_m['tflops_per_gpu']:.0f}, the blog's 195.88 → 289.32"
    + (": the preset's achieved rates are below the blog's GPUs', so the ratio is what is judged. " if lower else
       "; the ratio is what is judged. ")
    + f"The ablation: {ablation_text(true_ab)}. With every sequence 4096 tokens static CP is CP{flat['static_cp']} "
    f"and the model gives {flat['speedup']['dynamic-megatron']:.2f}× ({flat_verdict.word}): the verdict can flip."))

# %% [markdown]
# ## What we found, and where it disagrees with the source

# %%
tk_faster = [sims[d]["runs"]["dynamic"]["step_s"] < sims[d]["runs"]["dynamic-megatron"]["step_s"] for d in dists]
sim_vs = ", ".join(f"{d.split(' ')[0]} {sims[d]['runs']['dynamic']['speedup_vs_static']:.3f}× against "
                   f"{sims[d]['runs']['dynamic-megatron']['speedup_vs_static']:.3f}×" for d in dists)
if E is not None:
    emulated_line = (f"On the emulated {E['gpu']} (virtual time, matched to Llama-13B), "
                     f"{said('static', M)} and {said('static', T)}, at {world_size} ranks without a pipeline (the "
                     f"headline judges it against the blog's magnitude). The cost model, whose steps are the "
                     f"emulated ones divided by {min(factors):.3f} to {max(factors):.3f} at this scale, gives "
                     f"{gh['dynamic-megatron']['speedup_vs_static']:.2f}× for Megatron's rules at the blog's (GitHub-"
                     f"like, simulated), where packing longest first alone gives {ab_gh['packing']:.2f}×")
else:
    emulated_line = "This run had no emulated cluster, so no GPU step time was measured"
display(Markdown(
    "- Ring attention with the balanced layout, its backward included, equals one-process attention, and a training "
    "step through every plan gives the unpacked sequences' per-token loss and gradients: the scheduler only decides "
    "*where* each sequence runs, never what is computed.\n"
    f"- The toolkit's refill and merge steps are taken only where the cost model, ring included, says they pay, and "
    f"its plan is kept only where its modelled step beats Megatron's rules'"
    + (f". On this batch the modelled step: the toolkit's plan {modelled(T, M)}; it runs "
       f"{above_need(plans_all[T], True) + above_need(plans_all[T], False)} sequences on more ranks than they need "
       f"(Megatron's rules {above_need(plans_all[M], True) + above_need(plans_all[M], False)}, static CP "
       f"{above_need(plans_all['static'], True) + above_need(plans_all['static'], False)}), for time, not for the "
       f"balance of work (worst max/mean {worst(plans_all[T])}, Megatron's rules {worst(plans_all[M])}; 1 where a "
       f"single group spans every rank). " if greedy_kept else
       f": on this batch it did not ({modelled_step(greedy, cost) * 1e3:.0f} against {pm[M]:.0f} ms), so the "
       f"toolkit ran Megatron's plan. ")
    + f"Simulated at the blog's scale: {sim_vs}, the toolkit's against Megatron's rules"
    + (" — ahead on both length distributions." if all(tk_faster) else
       " — not ahead everywhere: its scheduler judges a plan by rank clocks, without the pipeline.") + "\n"
    f"- {emulated_line}.\n"
    f"- The blog's setting traced at true shapes (section 4b, simulated): "
    f"{true['speedup']['dynamic-megatron']:.2f}× for Megatron's rules ({true_sens['low']:.2f}–"
    f"{true_sens['high']:.2f}×), {true_verdict.word} against 1.48×; the pipeline bubble of static CP's unequal "
    f"micro-batches is {bubble_share:.0%} of the time saved, its exposed ring {ts_s['exposed_comm_s']:.2f} s of "
    f"{ts_s['step_s']:.0f} s. It takes the corpus's code lengths for the blog's "
    f"GitHub set, the longest sequence 8 × {setup.cap} tokens and the {true['cluster']} preset: assumptions.\n"
    f"- The article's 1.48× and 1.25× are at 64 GPUs with PP8. The simulation gives "
    f"{gh['dynamic']['speedup_vs_static']:.2f}× and {cc['dynamic']['speedup_vs_static']:.2f}× for the reasons above; "
    f"on the GitHub-like lengths most of it is packing (the ablation), which a static scheduler that sorts could "
    f"have too, and the values move with the assumed bandwidth and FLOP/s. It models no kernel-efficiency loss on "
    f"small CP chunks (which would favour dynamic CP further) and no scheduler time (Megatron hides it with an "
    f"asynchronous solver)."))

# %% [markdown]
# The headline for the course results page: the cost model's step time of the run's plans (ring included, every
# loss equal to the reference); its emulated verdict judges the blog's magnitude in the blog's setting traced at
# true shapes (section 4b), with the toy's emulated step, a setting of its own, beside it.

# %%
# the claim judged at the blog's setting traced at true shapes (section 4b: true_verdict); the toy's emulated gain,
# Megatron's plan against static CP replayed across the band, in the setting the run has (no pipeline: the
# bubble part of the gain cannot appear), judged on its own and labelled as the toy's
blog = Claim.ratio("static CP's step / dynamic CP's (Megatron's rules)", 1.48, tolerance=0.25,
                   source="NVIDIA blog, Dynamic CP in Megatron Core (2026)",
                   setting=f"the blog's: Llama-13B, 64 GPUs, PP8, GitHub lengths; the run's: {world_size} ranks, no "
                           "pipeline, so the pipeline-bubble part of the gain cannot appear")
sens = None if E is None else band("static / dynamic (Megatron's rules) step", r0["sensitivity"],
                                   key=lambda v: v["static"] / v["dynamic-megatron"])
headline("12", "dynamic context parallelism",
         f"modelled step (cost model, ring included, the run's plans timed as {r0['scheduler']['stands_for']}'s layers "
         f"on {cost.hw.gpu.name}): the toolkit's dynamic plan {modelled(T)}, Megatron's rules {modelled(M)}, ring "
         f"traffic {ring_mib[T]:.3f} / {ring_mib[M]:.3f} / {ring_mib['static']:.3f} MiB; loss and grads equal the "
         f"unpacked reference; measured step on this CPU: the toolkit's plan {versus(T, 'static')}",
         value=pm["static"] / pm[T], unit="× static CP's modelled step (ring included)",
         claim="1.48× (GitHub) and 1.25× (CommonCrawl) TFLOPS/GPU over static CP with packing, Llama-13B",
         source="NVIDIA blog, Dynamic CP in Megatron Core (2026)",
         reproduced=judge(blog, None, undecidable="a GPU step-time claim at 64 GPUs with PP8: this CPU times the "
                                                  "plans with the cost model, the emulated cluster below"),
         note=f"a GPU step-time claim at 64 GPUs with PP8, not testable on a CPU; simulated at that scale: "
              f"{gh['dynamic']['speedup_vs_static']:.2f}× and {cc['dynamic']['speedup_vs_static']:.2f}× (packing "
              f"longest first alone {ab_gh['packing']:.2f}× and {ab_cc['packing']:.2f}×)",
         emulated=(
             f"the blog's setting traced at true shapes (section 4b: the lesson's layer at Llama-13B's widths on "
             f"{true['gpu']}, {true['sequences']} corpus documents, PP8 × 8, full recompute, simulated): Megatron's "
             f"rules {true['speedup']['dynamic-megatron']:.2f}× static CP's throughput ({true_sens['low']:.2f}–"
             f"{true_sens['high']:.2f}× over the band), the toolkit's plan {true['speedup']['dynamic']:.2f}×"
             + ("" if E is None else
                f". The toy, its own setting: {E['gpu']} over {E['link']} (`{E['cluster']}`), timed as Llama-13B's "
                f"layers at {E['scales']['scale']:g}× its lengths and widths, {world_size} ranks, no pipeline: step "
                f"static CP {v_ms['static']:.0f} ms, Megatron's rules {v_ms[M]:.0f} ms, the toolkit's plan "
                f"{v_ms[T]:.0f} ms (virtual); {said('static', M)} (the toy's verdict: "
                f"{judge(blog, sens['value'], sens['low'], sens['high'], SENSITIVITY).word})")),
         emulated_reproduced=true_verdict)

# %% [markdown]
# ## Try this
#
# - `sim_cap = 4096`: in section 4 each rank holds half the tokens, so a sequence needs twice the ranks.
# - A code edit in section 4's first cell: `hw = dcp_sim.CLUSTER.perturbed(compute=0.7)` (slower kernels, the
#   same links) or `dcp_sim.Setup(pp=4, dcp=16)`.
# - `cluster = "pcie-100gbe"`: a slower ring under the run, so fewer merges pay; compare the ring bytes and the
#   emulated steps.
# - `lengths = [240, 8, 8, 8, 8, 8, 8, 8]`: one long sequence among short ones (a multiple of `world_size` of
#   them, each at most static CP × cap tokens).
#
# ## Sources
#
# NVIDIA technical blog, *Speeding Up Variable-Length Training with Dynamic Context Parallelism and
# NVIDIA Megatron Core* (2026-01-28); Megatron-LM `megatron/core/datasets/data_schedule.py`
# (`DefaultDynamicCPScheduler`) and `data_schedule_utils.py` (`next_hdp_group`, `dcp_make_buckets_equal`,
# `reroute_samples_to_dcp_ranks`), PRs #2000, #2054, #2282, #5154; Liu et al., *Ring Attention with Blockwise
# Transformers* (2023); Dao, *FlashAttention-2* (2023) for the online softmax and its backward; Transformer
# Engine's THD context parallelism for the 2·cp-chunk load balancing.
