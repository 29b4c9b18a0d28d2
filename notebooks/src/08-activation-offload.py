# %% [markdown]
# # 08 · Pipeline-aware activation offload
#
# **The question.** In pipeline parallelism a stage keeps the activations of every micro-batch whose forward
# ran and whose backward has not: under 1F1B, rank r of p holds up to p − r of them. Those activations sit
# idle in device memory between their forward and their backward. Can we move them to host memory right
# after the forward, bring them back just before the backward, and know from the schedule exactly when
# "just before" is, so the backward never waits?
#
# The source article (`shared/seeds/000`, section 8) says: *"offload the activations to CPU memory as soon as
# the forward is done, reload them to the GPU before the backward starts; the offload policy can be set per
# module of attention and MLP. Measured: offloading the attention parts lowers peak memory by about 8%, at a
# very small cost (实测卸载attention部分后，显存峰值下降约8%，性能损耗很小)."* Megatron-Core ships this as
# fine-grained activation offloading; PipeOffload (ICML'25) studies it under pipeline schedules. We build it,
# run it under 1F1B on real processes, count the bytes exactly, and check the gradients bit for bit.

# %% [markdown]
# ## The idea
#
# One group per module per (stage, micro-batch): what `ln1`, `qkv`, `core`, `proj`, `ln2`, `fc1`, `act`, `fc2`
# of each block save (plus `embed`, `head`, and `other`: the loss). When a module's forward returns, its group
# goes to the host store and its device storage is freed; the backward walks the groups in reverse and each
# one, when first needed, starts the reload of the one before it.
#
# ```
#  1F1B, p = 2, m = 4               rank 0:  F0  F1  B0  F2  B1  F3  B2  B3
#                                   rank 1:  F0 B0  F1 B1  F2 B2  F3 B3
#
#  rank 0, F1:  ln1 ─► qkv ─► core ─► ... ─► fc2   every group leaves (D2H) as soon as its
#                │      │      │              │     module returns (B0, not B1, is the next
#                ▼      ▼      ▼              ▼     backward on this rank)
#              host   host   host           host
#
#  rank 0, B0:  other ◄─ fc2 ◄─ ... ◄─ core ◄─ qkv ◄─ ln1   unpacking group g reloads
#                                                          group g−1 (H2D)
#               ▲ kept: F0's last group stayed, B0 was the next backward after F0
#  end of B0:   reload F... B1's last group: B1 is the next backward (the schedule says so)
# ```
#
# Pipeline awareness is the two rules the schedule makes possible: **the last group of a micro-batch whose
# backward comes next is not offloaded** (it would come straight back), and **the next backward's last group
# is reloaded as soon as the previous backward ends**. Parameters are never offloaded (they are saved by every
# linear layer for dX); neither are the stage input (the executor holds it for its gradient) and integer
# tensors (token ids). On CUDA the copies run on two side streams into pinned host buffers, ordered by events;
# on this CPU machine they are synchronous `copy_` calls at the same points, and on the **emulated cluster**
# (the `cluster` parameter, section 4b) each group's copy is timed on the host link's copy engines while the
# compute goes on, as the side streams would run it.

# %% tags=["parameters"]
import os
from typing import Optional

world_size: int = 2
preset: str = os.environ.get("TOOLKIT_PRESET", "default")  # smoke | default | full
backend: str = "auto"  # auto | gloo | nccl
cluster: str = "h100-ib400"  # emulated cluster under the run: h100-ib400 | a100-ib200 | pcie-100gbe | none
prefetch: Optional[bool] = None  # reload each group one group ahead of its backward (None: the preset's, True)
policies: Optional[list] = None  # offload policies or module kinds to run (None: the preset's, every one)
stands_for: Optional[str] = None  # real model the emulated cluster times the toy as (None: the preset's)
timeout_s: int = 900

# %% [markdown]
# ## The code that matters
#
# `toolkit/memory/offload.py` (the offloader, and `Offload`: the pipeline executor's hook that calls the
# offloader around every forward and backward). The pack hook files each saved tensor under its group, one
# entry per storage (the q, k, v views of one qkv tensor are one storage, copied once):

# %%
import inspect

from toolkit.memory import offload

print(inspect.getsource(offload.ActivationOffloader._pack))

# %% [markdown]
# A group ends where a module starts or ends; it leaves at once, unless this micro-batch's backward is the next
# one, in which case each group waits for the next to exist, so the last one stays:

# %%
print(inspect.getsource(offload.ActivationOffloader._boundary))
print(inspect.getsource(offload.ActivationOffloader.forward))

# %% [markdown]
# The unpack hook rebuilds each view from its (reloaded) storage, and the first unpack of a group starts the
# reload of the next group the backward will reach:

# %%
print(inspect.getsource(offload.ActivationOffloader._unpack))

# %% [markdown]
# ## The run
#
# `world_size` ranks run the tiny GPT as a pipeline, one stage per rank, with the 1F1B schedule through
# the pipeline executor with the `Offload` hook (real processes, activations and gradients sent point to point). Every variant
# runs the same step on the same micro-batches: `none` (the baseline, counted the same way), one run per
# policy, `all-long-lived` (section 5), and `torch.autograd.graph.save_on_cpu` (PyTorch's own offload: synchronous, no prefetch, not pipeline
# aware), plus `all-budget` (section 5). *Resident* bytes are the saved activations on the device, each storage
# once, from when autograd saves it until its memory is really freed; *total* is every tensor of the rank
# (parameters, gradients, activations, buffers in flight) from the `MemoryTracker`.

# %%
from IPython.display import Markdown, display

from toolkit import launch, viz
from toolkit.report import SENSITIVITY, band, headline
from toolkit.runtime.bench import Claim, check, judge, verdict

cfg = {"preset": preset, "policies": policies, "prefetch": prefetch, "stands_for": stands_for}  # None: the preset's
results = launch("l08_activation_offload", world_size, cfg, backend=backend, timeout_s=timeout_s, cluster=cluster)
r0 = results[0]
m = r0["model"]
print(f"preset {preset}: GPT d_model={m['d_model']}, {m['n_layer']} layers, seq {m['seq_len']}, micro-batch "
      f"{m['micro_batch']}, m={r0['m']} micro-batches on p={r0['p']} stages; copies: {r0['copies']}; "
      f"wall {results.wall_s:.1f} s")
for r in results:
    print(f"rank {r['rank']} (stage {r['stages'][0]}): {' '.join(r['order'])}")
prefetching = r0["prefetch"]  # False: every reload waits for its copy (late), nothing is fetched ahead

# %% [markdown]
# ## 1 · Resident activations over the step
#
# Saved-activation bytes on the device after each action of the schedule, without offload and with every
# module offloaded (the dotted line is what sits in the host store). The peaks in the table below are taken at
# every saved or freed storage, also inside an action.

# %%
for r in results:
    series = {"none": [s["act"] / 1024 for s in r["samples"]["none"]],
              "all": [s["act"] / 1024 for s in r["samples"]["all"]],
              "attention": [s["act"] / 1024 for s in r["samples"]["attention"]],
              "host store (all)": [s["host"] / 1024 for s in r["samples"]["all"]]}
    viz.lines(series, x=[s["action"] for s in r["samples"]["none"]], title=f"rank {r['rank']}: resident saved "
              "activations after each action", xaxis_title="action", yaxis_title="KiB",
              dash={"host store (all)": "dot"}).show()

# %% [markdown]
# ## 2 · Per-module policies and their effect

# %%
for r in results:
    rows = [row for row in r["rows"] if "resident_reduction" in row]
    viz.bars([{"policy": row["variant"], "what": what, "reduction %": 100 * row[key]} for row in rows
              for what, key in (("resident activations", "resident_reduction"), ("rank total", "tracker_reduction_total"))],
             x="policy", y="reduction %", color="what", title=f"rank {r['rank']}: peak reduction by policy",
             text_format=".0f").show()

# %%
# NBVAL_CHECK_OUTPUT
for r in results:
    print(f"rank {r['rank']}  {'policy':>14} {'resident peak':>14} {'-%':>6} {'rank total':>11} {'-%':>6} "
          f"{'offloaded':>10} {'wasted':>7} {'on demand':>9}  grads equal")
    for row in r["rows"]:
        if "resident_peak" not in row:
            continue
        print(f"        {row['variant']:>14} {row['resident_peak']:>14,} {100 * row['resident_reduction']:>6.1f} "
              f"{row['tracker_peak_total']:>11,} {100 * row['tracker_reduction_total']:>6.1f} "
              f"{row['offloaded_bytes']:>10,} {row['wasted_copy_bytes']:>7,} {row['on_demand_reloads']:>9}  "
              f"{row['grads_bitwise_equal']}")

# %% [markdown]
# How to read it:
#
# - **Which modules matter.** Per block the saved tensors are, in units of B·T·D floats: `ln1` 1 (+ stats),
#   `qkv` 1, `core` 3 (q, k, v as one storage) + 1 (its output) + the log-sum-exp, `proj` 0 of its own,
#   `ln2` 1, `fc1` 1, `act` 4, `fc2` 4. The MLP saves more than attention (by construction); `act` (GELU's input) and
#   `fc2` (GELU's output) are the big ones.
# - **`proj` alone moves nothing**: its only saved tensor is core's output (a view of the same storage), and a
#   storage leaves only if every module that saved it is in the policy. This is Megatron's "attn_proj needs
#   core_attn". The reverse, `core` without `proj`, copies that storage and then finds it still needed by
#   proj: the *wasted* column counts such copies, which cost bandwidth and free nothing.
# - **The last rank holds less to begin with** (1F1B's last stage runs each backward right after its forward),
#   and its last group is always kept (figures below); rank 0 holds p micro-batches.
# - **on demand** counts reloads issued only when the backward needed them, not ahead: zero with prefetch (with
#   `prefetch = False`, every reload is on demand). Whether a reload issued ahead is back *in time* is a question
#   of time, which this CPU cannot answer: section 4b counts the reloads that made the backward wait on the
#   emulated cluster.

# %%
by_rank = [{row["variant"]: row for row in r["rows"]} for r in results]
assert all(rows["mlp"]["resident_peak"] < rows["attention"]["resident_peak"] for rows in by_rank)  # MLP saves more
assert all(rows["proj"]["offloaded_bytes"] == 0 for rows in by_rank) and by_rank[0]["core"]["wasted_copy_bytes"] > 0
last = by_rank[-1]
display(Markdown(
    f"Measured: without offload the last rank's resident peak is {last['none']['resident_peak']:,} B against rank "
    f"0's {by_rank[0]['none']['resident_peak']:,} B; offloading every module lowers them by "
    + ", ".join(f"{100 * rows['all']['resident_reduction']:.1f}% (rank {i})" for i, rows in enumerate(by_rank))
    + f". The MLP policy lowers the peak more than the attention policy on every rank."))

# %% [markdown]
# ## 3 · Gradients, and `save_on_cpu`

# %%
# NBVAL_CHECK_OUTPUT
for r in results:
    print(f"rank {r['rank']}: gradients bitwise equal to no offload in all {len(r['rows'])} variants: "
          f"{all(row['grads_bitwise_equal'] for row in r['rows'])}")
    soc = next(row for row in r["rows"] if row["variant"] == "save_on_cpu")
    base = r["rows"][0]
    print(f"        save_on_cpu: rank total {soc['tracker_peak_total']:,} B vs {base['tracker_peak_total']:,} B "
          f"without offload")

# %% [markdown]
# `save_on_cpu` packs each saved tensor with `tensor.cpu()` and unpacks it with `.to(device)` when the backward
# reaches it. On CUDA that moves everything (parameters included: every linear layer saves its weight), each copy
# on the compute stream and no prefetch, so every kernel after a copy waits for it. On a CPU machine `.cpu()` of a
# CPU tensor returns the tensor itself: nothing moves and nothing is saved. Our offloader makes real copies on
# CPU too, so its bytes are counted here. The time of both needs a GPU's copy engines: on the emulated cluster
# (section 4b) `SaveOnCPU` times each of torch's copies as a GPU runs them, a D2H in pack and an H2D in unpack
# that the stream waits for, so the two offloads are compared on the same host link.

# %%
soc_change = [abs(rows["save_on_cpu"]["tracker_peak_total"] / rows["none"]["tracker_peak_total"] - 1) for rows in by_rank]
if r0["copies"].endswith("(CPU)"):
    assert max(soc_change) < 0.01
display(Markdown(f"Measured: `save_on_cpu` changes the rank's total peak by at most {100 * max(soc_change):.2f}% here "
                 f"({r0['copies']})."))

# %% [markdown]
# ## 4 · What it costs
#
# Step time of the variants timed side by side (`toolkit.runtime.bench.compare`: warm-up, then rounds with the
# order rotating; the trimmed mean of the round means), on this machine. On CPU the
# copies are synchronous memcpy in the same RAM, so this is the pure cost of the extra copies with no overlap;
# on a GPU they run on side streams while the next module computes.

# %%
timed = [row for row in r0["rows"] if "step_s" in row]
viz.bars([{"variant": row["variant"], "rank": f"rank {r['rank']}", "ms": 1e3 * row["step_s"]} for r in results
          for row in r["rows"] if "step_s" in row], x="variant", y="ms", color="rank",
         title="Pipeline step time by variant", yaxis_title="ms per step", text_format=".1f").show()
print(", ".join(f"{row['variant']} x{row['step_ratio']:.2f}" for row in timed), "(step time / no offload, rank 0)")


def cost(variant: str) -> str:
    """``variant``'s step time against no offload on this machine, judged by ``bench.verdict`` over the paired
    rounds of every rank (each round's slowest rank): slower, faster or within noise, with its interval."""
    bench_of = lambda v: [next(x["bench"] for x in r["rows"] if x["variant"] == v) for r in results]
    v = verdict(bench_of("none"), bench_of(variant))
    return (f"{v.ratio:.2f}× the time of no offload (95 % interval [{v.low:.2f}, {v.high:.2f}], {v.rounds} paired "
            f"rounds): {v.word}")


display(Markdown("Measured on this machine, all ranks, against no offload: " + "; ".join(
    f"`{v}` {cost(v)}" for v in ("all", "all-long-lived", "all-budget", "attention", "save_on_cpu") if any(
        x["variant"] == v for x in timed)) + "."))

# %% [markdown]
# ## 4b · On an emulated cluster: the copies on the host link
#
# On this CPU a copy is a memcpy on the cores that compute, so section 4 measures what copying costs a CPU, not
# whether a GPU's copy engines hide it. The launch also ran on an **emulated cluster** (the `cluster` parameter,
# `toolkit.runtime.emulator`): every op timed at what the target GPU's kernels achieve, and each group's D2H and
# H2D by `α + bytes/β` of the host link (PCIe) on a copy engine per direction, which works while the stream computes,
# issued exactly where the offloader issues them. A reload is **late** when the backward's wait for it moved the
# stream's clock: it was issued ahead (one group ahead, or when the previous backward ended) but was not back in
# time; the wait column adds up by how much. `save_on_cpu`'s copies run on the compute stream, as torch runs them
# on a GPU. Every timed variant ran one more step on that clock (virtual time is deterministic: one step is the
# time), at the toy's own shapes and **matched** to a real model: every op counted with the FLOPs, every tensor
# and every copy with the bytes, of its transformer layers, so compute and copies have the real model's ratio.

# %%
E = r0["emulated"]
if E is None:
    display(Markdown("This run had no emulated cluster (`cluster = none`): sections 4b and the emulated verdict "
                     "need one."))
else:
    def emulated_view(view: str) -> dict:
        """Per variant: the step (slowest rank), its verdict against no offload, late reloads and their wait
        (all ranks), and the busiest rank's copy-engine seconds each way."""
        out = {}
        for v in E[view]:
            per = [r["emulated"][view][v] for r in results]
            out[v] = {"step_s": max(x["step_s"] for x in per),
                      "verdict": verdict([r["emulated"][view]["none"]["bench"] for r in results],
                                         [x["bench"] for x in per]),
                      "late": sum(x.get("late_reloads", 0) for x in per),
                      "wait_s": sum(x.get("reload_wait_s", 0.0) for x in per),
                      "d2h_s": max(x["link_s"]["d2h"] for x in per), "h2d_s": max(x["link_s"]["h2d"] for x in per)}
        return out

    em = {view: emulated_view(view) for view in ("toy", "matched")}
    display(viz.table([{"variant": v, "toy shapes: step (µs)": 1e6 * em["toy"][v]["step_s"],
                        "× no offload": em["toy"][v]["verdict"].ratio,
                        "matched: step (ms)": 1e3 * x["step_s"], "× no offload ": x["verdict"].ratio,
                        "late reloads": x["late"], "their wait (ms)": 1e3 * x["wait_s"],
                        "D2H busy (ms)": 1e3 * x["d2h_s"], "H2D busy (ms)": 1e3 * x["h2d_s"]}
                       for v, x in em["matched"].items()],
                      title=f"Emulated {E['gpu']}, copies on {E['host_link']}, matched to {E['stands_for']} "
                            "(virtual time; late reloads all ranks, copy engines the busiest rank)",
                      formats={"toy shapes: step (µs)": ".1f", "× no offload": ".3f", "matched: step (ms)": ".2f",
                               "× no offload ": ".3f", "their wait (ms)": ".2f", "D2H busy (ms)": ".2f",
                               "H2D busy (ms)": ".2f"}))
    M, T = em["matched"], em["toy"]
    hides = M["all"]["d2h_s"] <= M["none"]["step_s"]
    display(Markdown(
        f"Matched to **{E['stands_for']}** ({E['scales']['flops']:,.0f}× the FLOPs, {E['scales']['bytes']:,.0f}× the "
        f"bytes of the toy), on {E['gpu']} with {E['host_link']}:\n\n- no offload takes {1e3 * M['none']['step_s']:.2f} ms "
        f"per step; `all` takes {M['all']['verdict'].ratio:.3f}× that ({M['all']['verdict'].word}, virtual clock), "
        f"with {M['all']['late']} late reloads that held the backward {1e3 * M['all']['wait_s']:.2f} ms (summed over "
        f"the ranks).\n- The copy engine is the reason: each step "
        f"the busiest rank's D2H engine carries {1e3 * M['all']['d2h_s']:.2f} ms of copies, "
        + ("less than the whole step without offload: they fit in it, which is needed to hide them, not enough "
           "(a copy also has to find compute beside it when it runs: the late reloads above say whether it did). "
           if hides else "more than the whole step without offload: no schedule can hide them. ")
        + f"\n- `all-budget` copies for {1e3 * M['all-budget']['d2h_s']:.2f} ms and takes "
        f"{M['all-budget']['verdict'].ratio:.3f}×, `attention` {1e3 * M['attention']['d2h_s']:.2f} ms and "
        f"{M['attention']['verdict'].ratio:.3f}×, `all-long-lived` {M['all-long-lived']['verdict'].ratio:.3f}×. "
        f"\n- torch's `save_on_cpu` copies every saved tensor, weights included, on the compute stream: "
        f"{M['save_on_cpu']['verdict'].ratio:.2f}× the step.\n- At the toy's own shapes every op is as short as its "
        f"launch and each copy pays the link's latency: `all` takes {T['all']['verdict'].ratio:.3f}× with "
        f"{T['all']['late']} late reloads (every reload waits when a group's backward is shorter than one copy), "
        f"`save_on_cpu` {T['save_on_cpu']['verdict'].ratio:.2f}×.\n\nAll times here are the emulated cluster's (a "
        "model), not measurements of a GPU."))

# %% [markdown]
# ## 5 · Which micro-batches: offload by lifetime, per rank
#
# Offloading every micro-batch treats all ranks alike. But under 1F1B the last rank runs each backward right
# after its forward: whatever it sends to the host comes straight back, two copies that free memory for a
# moment and that no compute can hide. Production systems offload by lifetime instead: PipeOffload by how long
# activations live; Megatron by a per-rank budget, rank r keeping `r · delta` more bytes on the device. Two rules
# here:
#
# - `long_lived(order, skip_within)` keeps whole micro-batches whose backward comes within `skip_within` actions
#   of their forward: later ranks offload fewer micro-batches, the last rank none.
# - `budget_bytes` (Megatron's per-rank budget, built): each forward sends at most that many bytes, its groups in
#   forward order (the longest-lived first) while they fit. `per_rank_budget` derives rank r's budget from the
#   schedule rather than from a knob: at its peak the rank holds k forwards (`in_flight(order)`; 1F1B: `p − r`), so
#   each sheds `1 − 1/k` of what one forward saves and the k of them hold what one holds, the last rank's share.
#   The lesson measures what one forward saves in the run without offload, then runs `all-budget`.

# %%
print(inspect.getsource(offload.long_lived))
print(inspect.getsource(offload.per_rank_budget))
for r in results:
    print(f"rank {r['rank']}: long-lived micro-batches (skip within {r['skip_within']} actions): {r['long_lived']}")

# %%
# NBVAL_CHECK_OUTPUT
for r in results:
    print(f"rank {r['rank']}: forwards held at its peak {r['in_flight']}, one saves {r['chunk_bytes']:,} B that could "
          f"leave, budget {r['budget_bytes']:,} B per forward")
print(f"{'rank':>4} {'policy':>15} {'groups':>6} {'resident peak':>14} {'offloaded':>10} {'reloaded':>10}  grads equal")
for r, rows in zip(results, by_rank):
    for variant in ("none", "all", "all-long-lived", "all-budget"):
        row = rows[variant]
        print(f"{r['rank']:>4} {variant:>15} {row['offloaded_groups']:>6} {row['resident_peak']:>14,} "
              f"{row['offloaded_bytes']:>10,} {row['reloaded_bytes']:>10,}  {row['grads_bitwise_equal']}")

# %%
viz.bars([{"rank": f"rank {r['rank']}", "variant": v, "KiB": rows[v][what] / 1024, "what": label}
          for r, rows in zip(results, by_rank) for v in ("none", "all", "all-long-lived", "all-budget")
          for what, label in (("resident_peak", "resident peak"), ("offloaded_bytes", "copied to the host"))
          if not (v == "none" and what == "offloaded_bytes")],
         x="rank", y="KiB", color="variant", title="Per rank: resident peak and bytes copied out, by rule",
         text_format=".0f").show()

# %%
for rows in by_rank:
    for v in ("all-long-lived", "all-budget"):
        assert rows[v]["grads_bitwise_equal"] and (rows[v]["on_demand_reloads"] == 0 or not prefetching)
        assert rows[v]["offloaded_bytes"] <= rows["all"]["offloaded_bytes"]
for r, rows in zip(results, by_rank):  # each forward sends at most its budget
    assert rows["all-budget"]["offloaded_bytes"] <= r["budget_bytes"] * r["m"]
    assert r["budget_bytes"] == r["chunk_bytes"] - r["chunk_bytes"] // r["in_flight"]
budget_out = [rows["all-budget"]["offloaded_bytes"] for rows in by_rank]
assert budget_out == sorted(budget_out, reverse=True) and budget_out[-1] == 0  # later ranks offload less, the last none
assert by_rank[-1]["all-long-lived"]["offloaded_bytes"] == 0 < by_rank[-1]["all"]["offloaded_bytes"]
assert by_rank[0]["all-long-lived"]["offloaded_bytes"] > 0
assert all(rows["all-budget"]["resident_peak"] < rows["none"]["resident_peak"] for rows in by_rank[:-1])
last, first = by_rank[-1], by_rank[0]
rules = ("none", "all", "all-long-lived", "all-budget")
peak_max = {v: max(rows[v]["resident_peak"] for rows in by_rank) for v in rules}
copied = {v: sum(rows[v]["offloaded_bytes"] for rows in by_rank) for v in rules}
display(Markdown(
    f"Measured, per rank (`all` vs `all-long-lived`):\n\n- rank 0 copies {first['all']['offloaded_bytes']:,} vs "
    f"{first['all-long-lived']['offloaded_bytes']:,} B to the host, resident peak "
    f"{first['all']['resident_peak']:,} vs {first['all-long-lived']['resident_peak']:,} B.\n- The last rank copies "
    f"{last['all']['offloaded_bytes']:,} B out (and back) under `all` to lower its resident peak from "
    f"{last['none']['resident_peak']:,} to {last['all']['resident_peak']:,} B within each forward-backward; "
    f"`all-long-lived` copies nothing there and keeps {last['all-long-lived']['resident_peak']:,} B.\n- The largest "
    f"resident peak over the ranks, the one that sets the memory a GPU needs: "
    + ", ".join(f"`{v}` {peak_max[v]:,} B" for v in rules)
    + ".\n- Bytes copied to the host by all ranks: " + ", ".join(f"`{v}` {copied[v]:,} B" for v in rules[1:]) + ".\n"
    f"- `all-budget` brings rank 0's peak from {first['none']['resident_peak']:,} to "
    f"{first['all-budget']['resident_peak']:,} B against the last rank's {last['none']['resident_peak']:,} B, "
    + ("so its largest peak is the last rank's, as with `all-long-lived`, "
       if peak_max["all-budget"] == last["none"]["resident_peak"] else
       f"so its largest peak is {peak_max['all-budget']:,} B (rank "
       f"{max(range(len(by_rank)), key=lambda i: by_rank[i]['all-budget']['resident_peak'])}), ")
    + f"for {copied['all-budget'] / copied['all-long-lived']:.2f}× the copies of `all-long-lived` and "
    f"{copied['all-budget'] / copied['all']:.2f}× those of `all`.\n\nOffloading less than `all` leaves every peak above "
    "`all`'s: the budget buys back copies (and, section 4b, step time) with the memory the last rank needs anyway."))

# %% [markdown]
# ## Checks

# %%
for r in results:
    rows = {row["variant"]: row for row in r["rows"]}
    assert all(row["grads_bitwise_equal"] for row in r["rows"]), "gradients bitwise equal to the run without offload"
    assert rows["all"]["resident_reduction"] >= 0.5, "target: resident activation peak at least 50% lower"
    if prefetching:
        assert rows["all"]["on_demand_reloads"] == 0, "prefetch issued every reload ahead of its backward"
    else:
        assert rows["all"]["late_reloads"] > 0 or rows["all"]["reloaded_bytes"] == 0, "unfetched reloads wait"
    assert rows["proj"]["offloaded_bytes"] == 0, "proj alone shares its only tensor with core"
    assert all(row.get("offloaded_bytes", 0) == row.get("reloaded_bytes", 0) + row.get("wasted_copy_bytes", 0)
               for row in r["rows"]), "every copy came back (or was dropped as wasted)"

# %% [markdown]
# ## What the measurement says about the article

# %%
att = [next(row for row in r["rows"] if row["variant"] == "attention") for r in results]
full = [next(row for row in r["rows"] if row["variant"] == "all") for r in results]
worst_att = min(range(len(att)), key=lambda i: att[i]["tracker_reduction_total"])  # the rank attention helps least
base = [r["rows"][0] for r in results]
# the same saving over a total that also holds AdamW's two fp32 moments (2 x the parameter bytes measured above;
# this run allocates no optimizer)
with_adam = [(b["tracker_peak_total"] - a["tracker_peak_total"]) / (b["tracker_peak_total"] + 2 * b["param_bytes"])
             for a, b in zip(att, base)]
display(Markdown(
    f"- *\"Offloading the attention parts lowers peak memory by about 8%\"*: here attention offload lowers the "
    f"rank's total tensor peak by " + ", ".join(f"{100 * a['tracker_reduction_total']:.1f}% (rank {i})"
                                               for i, a in enumerate(att))
    + " and the resident activation peak by " + ", ".join(f"{100 * a['resident_reduction']:.1f}%" for a in att)
    + ". With AdamW's moments added to the total (not allocated here) it would be "
    + ", ".join(f"{100 * w:.1f}%" for w in with_adam) + ". The percentage is the attention share of the "
    f"activations times the activation share of the rank's memory: with a tiny model "
    f"({r0['n_params_stage']:,} parameters per stage) activations dominate; with billions of parameters per stage, "
    f"and recomputation already trimming the activations, a figure like the article's 8% is plausible. None of "
    f"the sources read reports the 8% figure.\n"
    f"- Offloading every module lowers the resident peak by " + ", ".join(
        f"{100 * f['resident_reduction']:.1f}% (rank {i})" for i, f in enumerate(full)) + ", with gradients "
    f"bitwise equal (target ≥ 50%).\n"
    f"- *\"Very small cost\"*: on this CPU, where the copies are synchronous, every-module offload: {cost('all')}; "
    f"attention only: {cost('attention')}. Whether it is small on a GPU depends on the copies hiding behind "
    f"compute (PCIe/C2C bandwidth vs the module's FLOPs): "
    + ("no emulated cluster ran (`cluster = none`)." if E is None else
       f"on the emulated {E['gpu']} matched to {E['stands_for']} (section 4b) attention only takes "
       f"{M['attention']['verdict'].ratio:.3f}× the step without offload, every module "
       f"{M['all']['verdict'].ratio:.3f}×, with the per-rank budget {M['all-budget']['verdict'].ratio:.3f}×.")
    + " The CUDA path itself is checked by `benchmarks/gpu/offload.py`."))

# %%
red = [f["resident_reduction"] for f in full]
ok = all(row["grads_bitwise_equal"] for r in results for row in r["rows"])
on_demand = sum(f["on_demand_reloads"] for f in full)
emulated, emulated_ok, sens = "", None, None
if E is not None:
    emulated = (f"{E['gpu']}, copies on {E['host_link']} (`{E['cluster']}`), the toy timed as {E['stands_for']}'s "
                f"layers: every module offloaded takes {M['all']['verdict'].ratio:.3f}× the step without offload "
                f"({M['all']['verdict'].word}; {M['all']['late']} late reloads, {1e3 * M['all']['wait_s']:.1f} ms "
                f"waited; the D2H engine busy {1e3 * M['all']['d2h_s']:.1f} ms against a "
                f"{1e3 * M['none']['step_s']:.1f} ms step without offload); "
                f"per-rank budget {M['all-budget']['verdict'].ratio:.3f}×, attention only "
                f"{M['attention']['verdict'].ratio:.3f}×, torch's save_on_cpu {M['save_on_cpu']['verdict'].ratio:.2f}×")
    # "negligible" read as at most 5 % slower than no offload, judged on the policy the claim is about (the
    # per-rank budget: PipeOffload offloads what each stage's lifetime allows), over the sensitivity band
    sens = band("offload with the per-rank budget / no offload step", E["sensitivity"],
                key=lambda v: v["all-budget"] / v["none"])
    emulated_ok = judge(Claim.at_most("offloaded step (per-rank budget) / no offload", 1.05,
                                      "'negligible': at most 5 % slower", source="Wan et al., PipeOffload"),
                        sens["value"], sens["low"], sens["high"], SENSITIVITY)
headline("08", "pipeline-aware activation offload (1F1B, per-module groups, prefetch)",
         f"offloading every module lowers the resident activation peak by "
         + ", ".join(f"{x:.0%} (rank {i})" for i, x in enumerate(red))
         + f", gradients {'bitwise equal' if ok else 'NOT bitwise equal'} to no offload, {on_demand} reloads not "
           f"issued ahead; attention only lowers the total tensor peak of the rank it helps least (rank "
           f"{worst_att}) by {att[worst_att]['tracker_reduction_total']:.1%}",
         value=min(red), unit="resident activation peak reduction (worst rank)",
         claim="at least half of the activations can be offloaded (at negligible cost on GPUs)",
         source="Wan et al., PipeOffload, ICML 2025",
         reproduced=check("offloading every module lowers every rank's resident activation peak by at least half, "
                          "gradients bitwise equal, every reload issued ahead",
                          bool(min(red) >= 0.5 and ok and on_demand == 0)),
         note="memory judged on the resident peak of every rank, exact gradients and every reload issued ahead; "
              "the cost is judged on the emulated cluster (\"negligible\" read as at most 5 % slower), since CPU "
              "copies are synchronous. The “16 optimizations” article's ~8% peak cut from attention offload is a large-model "
              "share: see the section above",
         emulated=emulated, emulated_reproduced=emulated_ok)

# %% [markdown]
# ## Try this
#
# - `prefetch = False`: every reload becomes a late one: the backward waits for each copy (section 4b counts the
#   waits on the emulated cluster's clock).
# - `world_size = 4` (every preset's layer count is a multiple of 4): rank 0 holds 4 micro-batches without
#   offload; how much of that does offload remove, and what about the last rank? The per-rank budget then sheds
#   3/4, 2/3, 1/2 and nothing of each forward on ranks 0 to 3 (formula).
# - `cluster = "a100-ib200"` (PCIe Gen4: half the host link of Gen5), or `stands_for = "llama2-70b"`: it has
#   more FLOPs per activation byte (a layer's GEMMs grow as the hidden size squared, its activations linearly:
#   formula), so its copies hide more easily.
# - A code edit: in `toolkit/lessons/l08_activation_offload.py`, `ActivationOffloader(..., groups=[(stage, mb, 0),
#   ...])` offloads only some micro-batches (Megatron's `--activation-offload-fraction`); its `min_bytes` skips
#   small tensors (Megatron skips those under 1M elements).
# - A code edit: offload and recompute together (`toolkit/memory/offload.py` beside
#   `toolkit/memory/checkpointing.py`): recompute the cheap `ln1`/`ln2`/`act` and offload the rest.
#
# ## Sources
#
# - Megatron-Core fine-grained activation offloading (NVIDIA and RedNote),
#   `megatron/core/pipeline_parallel/fine_grained_activation_offload.py`: offload groups, pipeline-aware handler queue.
# - Wan et al., *PipeOffload: Improving Scalability of Pipeline Parallelism with Memory Optimization*, ICML 2025
#   (code: `sail-sg/zero-bubble-pipeline-parallelism`).
# - Kuaishou, *Pipeline-Parallelism-Aware Offloading*, USENIX ATC 2024 (credited by Megatron).
# - PyTorch, `torch.autograd.graph.save_on_cpu` and `saved_tensors_hooks` (autograd docs, "Hooks for saved tensors").
