# %% [markdown]
# # 14 · DeepEP-style dispatch and combine: what a better all-to-all for MoE does
#
# **The question.** Expert parallelism sends every token to the ranks that own its top-k experts (*dispatch*) and
# brings the expert outputs back (*combine*). Lesson 04 did it with one plain `all_to_all_single`. DeepSeek's
# DeepEP library replaces that collective with its own kernels. What does it do differently, and how much does each
# idea save — in bytes we can count exactly, and in time where this machine can say anything at all?
#
# The source article (`shared/seeds/000`, section 14) says: *"MoE all-to-all is on the critical path. DeepEP
# provides two kinds of kernels: high-throughput kernels (NVLink + RDMA forwarding) for training and prefill, and
# low-latency kernels (pure RDMA) for decoding; it supports FP8 and hook-based communication-computation overlap
# that occupies no SMs."* (高吞吐内核：NVLink+RDMA混合转发，适合训练和预填充阶段 · 低延迟内核：纯RDMA通信，适合实时解码场景 ·
# 同时支持FP8低精度计算和基于hook的通信计算重叠，不占用SM资源。)
#
# We take DeepEP's ideas apart and run each one for real on `torch.distributed` processes, on two *emulated* nodes
# of two ranks each:
#
# | | idea | what we measure |
# |---|---|---|
# | (a) | the dispatch layout from the top-k indices | checked against a brute-force loop |
# | (b) | deduplication: a token goes once to a rank, whatever its experts there | bytes, exactly |
# | (c) | two-hop: once per remote *node* on the slow link, then fan-out inside | inter-node bytes |
# | (d) | low-latency: fixed buffers, no size exchange first, a receive hook | padding, exposed time |
# | (e) | FP8 / INT8 dispatch with one scale per 128 channels, BF16 combine | bytes per token, SNR |
# | (f) | why only low-latency mode fits in a CUDA graph | host syncs; the count exchange, emulated |

# %% [markdown]
# ## The idea
#
# ```
#  plain all-to-all (lesson 04)   one row per (token, expert):   T·K rows
#  DeepEP dispatch (dedup)        one row per (token, rank):     Σ_t |ranks(t)| rows (+ weights, ids)
#
#        node A                              node B
#   ┌──────────────────┐               ┌──────────────────┐
#   │ a0 ─┐     a1     │   hop 1       │ b0 ──► b1        │   token on a0, experts on b0 and b1:
#   │     └────────────┼──"RDMA"──────►│ ▲  hop 2 "NVLink"│   crosses the node boundary ONCE, the
#   └──────────────────┘               └─┴────────────────┘   receiving rank forwards it inside node B
#   inter-node rows:  direct Σ_t |remote ranks(t)|   →   two-hop Σ_t |remote nodes(t)|
#   combine reverses it: b1 ─► b0 (adds node B's partial sums) ─► a0 (adds the nodes' sums)
#
#  low-latency mode: every local expert owns a buffer of max_tokens rows for every source rank,
#     recv_x [local experts, max_tokens · ranks, H]  + recv_count [local experts]
#  so the data can move before anyone knows how many tokens come (no size exchange: one latency less);
#  the hook: issue now ──── other work ──── hook() completes the receive
# ```
#
# Everything is the project's one dispatcher, `toolkit.moe` (lesson 04 trains through it); the DeepEP variants are in
# `toolkit/moe/deepep.py`. Nodes are emulated: all four ranks share this machine, so only the byte counts say what
# would cross a node boundary.

# %% tags=["parameters"]
import os
from typing import Optional

world_size: int = 4  # 2 emulated nodes x ranks_per_node ranks
preset: str = os.environ.get("TOOLKIT_PRESET", "default")  # smoke | default | full
backend: str = "auto"  # auto | gloo | nccl
cluster: str = "h100-ib400"  # emulated cluster under the run (timed in section f): h100-ib400 | a100-ib200 | pcie-100gbe | none
ranks_per_node: Optional[int] = None  # 0: world_size // 2 (two nodes); None: the preset's
max_nodes: Optional[int] = None  # node-limited routing (DeepSeek-V3): at most this many nodes per token (0: off; None: the preset's)
overlap_matmuls: Optional[int] = None  # other work beside the low-latency hook (0: as long as one blocking dispatch; None: the preset's)
timeout_s: int = 600

# %% [markdown]
# ## The code that matters
#
# (a) The layout: from top-k indices [T,K] to tokens per rank, per node, per expert and the token-in-rank mask —
# DeepEP's `get_dispatch_layout`, vectorized.

# %%
import inspect

from toolkit.moe import deepep, dispatcher

print(inspect.getsource(dispatcher.dispatch_layout))

# %% [markdown]
# (b) Dedup: with `dedup=True` the dispatcher sends one row per (token, destination rank) and, beside it, the gate
# weights of the pairs that rank holds (`_meta`); the expert side multiplies and sums per row before the combine.
# (c) Two hops: each hop is one `all_to_all_single` — over the *rdma* group (same local index on every node),
# then over the *nvl* group (the ranks of one node). The proxy forwards the encoded bytes as they came (below, up to
# the second hop; what follows decodes the rows and lays out the expert input).

# %%
from toolkit.viz import listing

print(listing(dispatcher.TokenDispatcher._meta), end="\n\n")
print(listing(deepep.TwoHop.dispatch, end="meta2 = all_to_all"))

# %% [markdown]
# ## The run
#
# Tokens are the MoE-layer input of an untrained model: byte embeddings of real text (the corpus of `toolkit.data`),
# routed by a random gate. They are rounded to bf16 values and the gate weights to multiples of 1/256 (each row still
# summing to 1), so that every sum along the way is exact in fp32 and round trips can be compared bit for bit.

# %%
from IPython.display import Markdown, display

from toolkit import launch, viz
from toolkit.lessons import l14_deepep as lesson
from toolkit.report import band, headline
from toolkit.runtime.bench import check, not_decidable, verdict
from toolkit.runtime.cluster import cluster as make_cluster

cfg = {"preset": preset, "ranks_per_node": ranks_per_node, "max_nodes": max_nodes, "overlap_matmuls": overlap_matmuls}
nodes_of = lesson.validate(cfg, world_size)["ranks_per_node"]  # a bad combination stops here, before any process
target = None if cluster == "none" else make_cluster(cluster, ranks_per_node=nodes_of)  # the same emulated nodes
results = launch("l14_deepep", world_size, cfg, backend=backend, timeout_s=timeout_s, cluster=target)
r0 = results[0]
c = r0["config"]
R, rpn = r0["world_size"], c["ranks_per_node"]
print(f"{R} ranks = {R // rpn} emulated nodes x {rpn}; {c['tokens']} tokens per rank, H = {c['hidden']}, "
      f"top-{c['top_k']} of {c['n_expert']} experts ({c['n_expert'] // R} per rank); wall {results.wall_s:.1f} s")

# %% [markdown]
# ## (a) The layout
#
# Each rank computes from its own top-k indices how many tokens go to each rank and node, how many pairs to each
# expert, and the token-in-rank mask; the vectorized version equals a plain loop over tokens, field by field.

# %%
assert all(all(r["layout"]["equal"].values()) for r in results), [r["layout"]["equal"] for r in results]
display(viz.heatmap([r["layout"]["tokens_per_rank"] for r in results], x=[f"to rank {j}" for j in range(R)],
                    y=[f"rank {i}" for i in range(R)], title="Tokens each rank sends to each rank (a token counts once)",
                    colorbar_title="tokens", text_format="d"))
hist = [sum(r["layout"]["ranks_per_token_hist"][n] for r in results) for n in range(R + 1)]
display(viz.bars([{"ranks": str(n), "tokens": h} for n, h in enumerate(hist)], x="ranks", y="tokens",
                 title=f"How many ranks a token needs (top-{c['top_k']}, all ranks' tokens)", text_format="d"))

# %%
# NBVAL_CHECK_OUTPUT
for r, res in enumerate(results):
    lay = res["layout"]
    print(f"rank {r}: layout == brute force {all(lay['equal'].values())}; tokens per rank {lay['tokens_per_rank']}, "
          f"per node {lay['tokens_per_node']}")
print("tokens needing 1, 2, ... ranks:", hist[1:])

# %% [markdown]
# ## (b) Deduplication
#
# Payload = rows in the all-to-all's input buffer (including the rows a rank keeps); wire = rows to *other* ranks.
# Both come from the communication ledger (bf16 rows of 2·H bytes) and are compared with the closed forms
# T·K·H·b (plain) and Σ_t |ranks(t)|·H·b (dedup).

# %%
for res in results:
    d = res["dedup"]
    assert d["plain"]["ledger_payload"] == d["closed_form"]["plain_payload"]
    assert d["dedup"]["ledger_payload"] == d["closed_form"]["dedup_payload"]
    assert d["plain"]["ledger_wire"] == d["closed_form"]["plain_wire"]
    assert d["dedup"]["ledger_wire"] == d["closed_form"]["dedup_wire"]
    assert d["round_trip_exact"] == {"plain": True, "dedup": True}, "identity experts, weights summing to 1"
    assert d["recv_equals_tokens_per_expert"] == {"plain": True, "dedup": True}
wire = {m: sum(r["dedup"][m]["ledger_wire"] for r in results) for m in ("plain", "dedup")}
meta = sum(r["dedup"]["dedup"]["meta_wire"] for r in results)
display(viz.bars([{"rank": f"rank {i}", "dispatch": m, "bytes": r["dedup"][m]["ledger_wire"]}
                  for i, r in enumerate(results) for m in ("plain", "dedup")], x="rank", y="bytes", color="dispatch",
                 title="Dispatch bytes on the wire per rank (bf16 tokens, ledger)", text_format=","))

# %%
# NBVAL_CHECK_OUTPUT
for r, res in enumerate(results):
    d = res["dedup"]
    print(f"rank {r}: payload plain {d['plain']['ledger_payload']:,} dedup {d['dedup']['ledger_payload']:,} B; "
          f"wire plain {d['plain']['ledger_wire']:,} dedup {d['dedup']['ledger_wire']:,} B (= closed forms)")
print(f"all ranks: dedup / plain wire bytes = {wire['dedup'] / wire['plain']:.4f}; "
      f"weights + slot ids beside the rows: {meta:,} B")

# %%
display(Markdown(
    f"Sending a token once per rank instead of once per expert cuts the dispatch to **{wire['dedup'] / wire['plain']:.3f}×** "
    f"the plain all-to-all's bytes here (top-{c['top_k']} of {c['n_expert']} experts on {R} ranks); the gate weights and "
    f"local slot ids that travel beside the rows cost {meta / wire['dedup']:.1%} on top (fp32 here; DeepEP sends "
    f"`topk_idx` and `topk_weights` the same way). The combine mirrors it: one partial sum per (token, rank) comes back."))

# %% [markdown]
# ## (c) Two hops over (emulated) nodes
#
# Hop 1 goes over the *rdma* group: ranks with the same local index on every node. The ledger counts exactly what a
# rank sends there, and that is Σ_t |nodes(t) \ own node| rows — against Σ_t |ranks on other nodes(t)| rows if each
# token went straight to every remote rank.

# %%
for res in results:
    t = res["two_hop"]
    assert t["ledger"]["hop1"] == t["closed_form"]["inter_node_two_hop"], t
    assert t["round_trip_exact"] and t["recv_equals_tokens_per_expert"]
sum_of = lambda f: sum(f(r["two_hop"]) for r in results)
inter_direct = sum_of(lambda t: t["closed_form"]["inter_node_direct"])
inter_two = sum_of(lambda t: t["ledger"]["hop1"])
intra_two = sum_of(lambda t: t["ledger"]["hop2"])
direct_all = sum_of(lambda t: t["closed_form"]["direct_all_remote"])
assert sum_of(lambda t: t["ledger"]["combine_hop1"]) == inter_two, "the combine crosses the nodes as often"
display(viz.bars([{"path": p, "link": l, "bytes": b} for p, l, b in (
    ("direct (dedup)", "inter-node", inter_direct), ("direct (dedup)", "intra-node", direct_all - inter_direct),
    ("two-hop", "inter-node", inter_two), ("two-hop", "intra-node", intra_two))],
    x="path", y="bytes", color="link", barmode="stack", text_format=",",
    title="Dispatch bytes by link, all ranks (bf16 tokens)"))

# %%
# NBVAL_CHECK_OUTPUT
for r, res in enumerate(results):
    t = res["two_hop"]
    print(f"rank {r}: inter-node two-hop {t['ledger']['hop1']:,} B (= Σ|nodes(t)|·H·b: "
          f"{t['ledger']['hop1'] == t['closed_form']['inter_node_two_hop']}), direct {t['closed_form']['inter_node_direct']:,} B; "
          f"intra-node {t['ledger']['hop2']:,} B; round trip exact {t['round_trip_exact']}")
print(f"all ranks: inter-node two-hop / direct = {inter_two / inter_direct:.4f}")

# %%
display(Markdown(
    f"Forwarding through one rank per node sends **{inter_two / inter_direct:.3f}×** the inter-node bytes of going "
    f"straight to every remote rank; the price is {intra_two:,} bytes of intra-node fan-out (against "
    f"{direct_all - inter_direct:,} bytes of intra-node traffic for the direct path), which DeepEP puts on NVLink "
    f"(~{r0['published']['normal']['rows'][0][2]} GB/s published) instead of RDMA "
    f"(~{r0['published']['normal']['rows'][1][2]}–{r0['published']['normal']['rows'][2][2]} GB/s). With node-limited "
    f"routing (`max_nodes`, DeepSeek-V3 uses 4 of 8 nodes) the inter-node rows per token are capped as well."))

# %% [markdown]
# ## (d) Low-latency mode: fixed buffers and a receive hook
#
# Every local expert owns `max_tokens` rows for every source rank, so nothing is agreed before the data moves. The
# cost is memory, and padding: the buffer is sized for the worst case. Our emulation sends the whole padded buffer
# (`all_to_all_single` needs the sizes in advance); DeepEP's RDMA writes only the real tokens into their slots and a
# count, so its wire bytes are the valid rows.
#
# How much of the buffer is used does not depend on the routing. Every (token, expert) pair lands in exactly one row,
# so summed over the R ranks the rows used are R·T·K, out of R·(E/R)·R·M = R·E·M buffer rows: the used share is
# `T·K / (E·M)` (formula). Routing only moves the padding from one rank to another, and even at T = M the padding is
# `1 − K/E` (formula). The check below asserts that the measured rows equal these counts.

# %%
ll = [r["low_latency"] for r in results]
for res_ll in ll:
    for row in res_ll["sweep"]:
        assert row["ledger_wire"] == row["padded_wire_closed_form"] and row["round_trip_exact"]
        assert row["recv_equals_tokens_per_expert"]
tokens = [row["tokens"] for row in ll[0]["sweep"]]
E, K, M = c["n_expert"], c["top_k"], c["max_tokens"]
for i, t in enumerate(tokens):  # used rows R·T·K of R·E·M, whatever the routing
    assert sum(x["sweep"][i]["used_rows"] for x in ll) == R * t * K
    assert sum(x["sweep"][i]["buffer_rows"] for x in ll) == R * E * M
waste = [sum(x["sweep"][i]["used_rows"] for x in ll) / sum(x["sweep"][i]["buffer_rows"] for x in ll) for i in range(len(tokens))]
display(viz.lines({"buffer rows used": waste}, x=tokens, title=f"Low-latency buffers {ll[0]['buffer_shape']} per rank: "
                  "share of rows holding a token", xaxis_title="tokens per rank", yaxis_title="used / buffer rows"))

# %%
# NBVAL_CHECK_OUTPUT
print(f"receive buffer per rank: {ll[0]['buffer_shape']} (local experts, max_tokens x ranks, H)")
for i, t in enumerate(tokens):
    print(f"{t:4d} tokens per rank: {1 - waste[i]:.4f} of the buffer rows padding; round trip exact "
          f"{all(x['sweep'][i]['round_trip_exact'] for x in ll)}")

# %% [markdown]
# **The hook.** `dispatch(..., return_recv_hook=True)` issues the transfer (an async all-to-all here) and returns at
# once; `hook()` completes it. In between the rank runs other work: `overlap_matmuls` matmuls stand for the attention
# of another micro-batch (the presets' `overlap_matmuls=0` calibrates how many last as long as one blocking
# dispatch). Exposed communication = time spent inside the dispatch calls, less the time to lay out and FP8-encode
# the padded send buffer, which is local work timed on its own ("encode"). The hook can hide at most
# `min(work, blocking exposed)` (formula) of the transfer. Timings are from a shared 2-core machine running four
# ranks: read them as this run's, not as a property of the method.

# %%
import statistics

spans = [s for r in results for s in r["spans"]]
for variant in ("blocking", "hook"):
    display(viz.gantt([s for s in spans if s["meta"].get("variant") == variant], label=None,
                      title=f"One traced step, {variant}: FP8 low-latency dispatch and other work"))
variants = ("blocking", "hook")
exposed = {v: statistics.median(r["low_latency"]["hook_exposed_comm_s"][v] for r in results) for v in variants}
encode = {v: statistics.median(r["low_latency"]["hook_encode_s"][v] for r in results) for v in variants}
step = {v: statistics.median(r["low_latency"]["hook_step_s"][v] for r in results) for v in ("blocking", "hook", "compute only")}
display(viz.table([{"variant": v, "encode (ms)": encode.get(v, 0) * 1e3, "exposed comm (ms)": exposed.get(v, 0) * 1e3,
                    "step (ms)": step[v] * 1e3} for v in step],
                  title="Low-latency dispatch: blocking vs receive hook (median over ranks)",
                  formats={"encode (ms)": ".2f", "exposed comm (ms)": ".2f", "step (ms)": ".2f"}))
per_rank = {v: [r["low_latency"]["hook_exposed_comm"][v] for r in results] for v in variants}
judged = verdict(per_rank["blocking"], per_rank["hook"])  # bench's one rule: paired rounds, each its slowest rank
most = min(step["compute only"], exposed["blocking"]) / exposed["blocking"]  # the share the work can cover
if 1 - judged.ratio > most:
    said = (f"The hook hid {1 - judged.ratio:.2f} of the blocking transfer, more than the other work could hide "
            f"(at most {most:.2f} = min(1, work / blocking)), so the difference is this shared machine's noise, "
            "not overlap")
elif judged.faster:
    said = (f"The hook hid {1 - judged.ratio:.2f} of the blocking transfer, against at most {most:.2f} = "
            "min(1, work / blocking) that the work could cover")
elif judged.slower:
    said = "The hook cost more than blocking"
else:
    said = "This run cannot tell whether the hook hid anything"
said += f" (exposed communication: {judged.text('blocking', 'hook')})"
display(Markdown(
    f"With the hook, the rank spent {exposed['hook'] * 1e3:.2f} ms per step waiting in communication calls against "
    f"{exposed['blocking'] * 1e3:.2f} ms blocking ({exposed['hook'] / exposed['blocking']:.2f}×), on top of "
    f"{encode['blocking'] * 1e3:.2f} ms (blocking) and {encode['hook'] * 1e3:.2f} ms (hook) to lay out and encode the "
    f"padded buffer. The other work alone ({r0['low_latency']['overlap_matmuls']} matmuls) took "
    f"{step['compute only'] * 1e3:.2f} ms; the steps {step['hook'] * 1e3:.2f} (hook) vs "
    f"{step['blocking'] * 1e3:.2f} ms (blocking). {said}.\n\n"
    "On gloo the transfer runs on a CPU thread that competes with the computation for the same two cores; DeepEP's "
    "point is that on GPUs the RDMA transfer needs no SM at all, which a CPU cannot show."))

# %% [markdown]
# ## (e) FP8 and INT8 dispatch, BF16 combine
#
# One fp32 scale per token per 128 channels travels with the codes (`toolkit.comm.quant_a2a`'s row format; FP8 codes
# go over gloo as their uint8 bits). Dedup dispatch, bf16 combine.

# %%
rows = results[0]["codecs"]["rows"]
for res in results:
    for row in res["codecs"]["rows"]:
        assert row["ledger_dispatch"] == row["remote_rows"] * row["row_bytes"]
snr = {row["codec"]: row for row in rows}
assert snr["bf16"]["dispatch_snr_db"] == float("inf") and snr["int8"]["dispatch_snr_db"] > 40
assert snr["fp8"]["dispatch_snr_db"] > 29
display(viz.bars([{"codec": row["codec"], "dB": row[k], "what": name} for row in rows if row["codec"] != "bf16"
                  for k, name in (("dispatch_snr_db", "expert input"), ("round_trip_snr_db", "after bf16 combine"))],
                 x="codec", y="dB", color="what", text_format=".1f", title="SNR of quantized dispatch (rank 0)"))

# %%
# NBVAL_CHECK_OUTPUT
for row in rows:
    print(f"{row['codec']:>5}: {row['row_bytes']} B per token row ({row['row_bytes'] / snr['bf16']['row_bytes']:.4f}× bf16); "
          f"rank 0 dispatch {row['ledger_dispatch']:,} B = {row['remote_rows']} remote rows x {row['row_bytes']}")

# %%
display(Markdown(
    f"FP8 and INT8 rows both cost H + 4·H/128 bytes, {snr['fp8']['row_bytes'] / snr['bf16']['row_bytes']:.3f}× bf16; what "
    f"differs is the signal kept: {snr['int8']['dispatch_snr_db']:.1f} dB for INT8 against {snr['fp8']['dispatch_snr_db']:.1f} dB "
    "for FP8 E4M3 on these tokens (lesson 09 explains why: FP8 spends bits on exponent that a per-128 scale makes "
    f"unnecessary). After the bf16 combine, the round trip keeps {snr['fp8']['round_trip_snr_db']:.1f} dB (FP8)."))

# %% [markdown]
# ## (f) Why only low-latency mode can be captured in a CUDA graph
#
# DeepEP's README marks its normal dispatch *"not compatible with CUDA graph"* (the CPU waits for the GPU's
# received-count signal) and its low-latency kernels as graph-compatible. The reason is the count exchange:
#
# ```
#  normal       counts ─► all_gather ─► the host reads them ─► recv [Σ counts, H] ─► all_to_all
#                                       └ a host sync; a buffer whose size changes every step
#  low latency  recv [local experts, max_tokens · ranks, H], once ─► all_to_all (data and counts)
#                                       └ nothing for the host to read: the same kernels and shapes
# ```
#
# A graph replays fixed kernels on fixed buffers, and nothing may wait for the device while it is captured. Each
# mode's round trip (FP8 dispatch, BF16 combine) ran under `toolkit.graphs.audit`, which flags the ops that
# make the host wait for the device and those whose output shape depends on the data; the collectives are listed
# apart (NCCL can capture them; DeepEP's own kernels replace them). In normal mode the dispatcher reads the
# exchanged counts through `host_read` — the `.tolist()` that sizes the receive buffer, as one op
# (`toolkit.to_host`) that the audit and the emulated clock can see.

# %%
cap = r0["capture"]
for r in results:
    assert "toolkit.to_host" in r["capture"]["normal"]["breaks_capture"], r["rank"]
    assert r["capture"]["low_latency"]["breaks_capture"] == {}, r["capture"]["low_latency"]

# %%
# NBVAL_CHECK_OUTPUT
for mode, found in cap.items():
    print(f"{mode}: {'nothing breaks a capture' if not found['breaks_capture'] else 'breaks a capture:'}")
    for op, why in found["breaks_capture"].items():
        print(f"    {op:28s} {why}")
    print(f"    collectives: {', '.join(found['collectives'])}")

# %% [markdown]
# Besides the count read, the normal path shows the dispatcher's own input checks (each a read of a device
# value: every rank raises the same error for a bad id, a NaN weight or token) and the layout's data-dependent ops
# (`nonzero`, `bincount`). The low-latency path has none: its counts are computed into a fixed-size vector on the
# device, and it leaves its FP8 encoder's NaN check out (a host read too; DeepEP's kernels check nothing either).
#
# **In time, on the emulated cluster.** The launch also ran on an emulated cluster (the `cluster` parameter,
# `toolkit.runtime.emulator`; the same two nodes). Each mode's round trip ran once more there after the same
# compute, the layer's GEMMs before its dispatch, which the host has launched and runs ahead of: normal mode's
# host must stop at the count read and wait for the GPU to finish them, then launch every kernel after it from
# behind. Low latency ran eager and as one CUDA graph replay (one launch for all its kernels); normal mode cannot.
# Both route the same `max_tokens` tokens per rank; the low-latency transfers are timed at the rows DeepEP's
# puts write, not at the padded buffer this emulation sends. Virtual time, a model: at the toy's shapes, and with
# every token row timed as DeepSeek-V3's hidden size.

# %%
E_ = r0["emulated"]
if E_ is None:
    display(Markdown("This run had no emulated cluster (`cluster = none`)."))
else:
    erows = []
    for shapes, runs in E_["runs"].items():
        for mode, x in runs.items():
            if mode == "rows_scale":
                continue
            slowest = max(r["emulated"]["runs"][shapes][mode]["round_trip_s"] for r in results)
            erows.append({"token rows": "toy" if shapes == "toy" else f"as {shapes} (×{runs['rows_scale']:.0f})",
                          "mode": mode, "round trip (µs, slowest rank)": slowest * 1e6,
                          "count exchange (µs, rank 0)": x["plan_s"] * 1e6 if x["plan_s"] is not None else None,
                          "host syncs (rank 0)": x["host_syncs"], "host launches (µs, rank 0)": x["launch_s"] * 1e6})
    display(viz.table(erows, title=f"Dispatch + combine after the layer's compute on the emulated {E_['gpu']} "
                                   f"({E_['link']} between the nodes; virtual time, a model)",
                      formats={k: ".1f" for k in erows[0] if "µs" in k}))
    em14 = {(row["token rows"], row["mode"]): row for row in erows}
    real_rows = next(k for k, _ in em14 if k != "toy")
    n, ll_eager, ll_graph = (em14[(real_rows, m)] for m in ("normal", "low latency", "low latency, one graph replay"))
    toy_n = em14[("toy", "normal")]
    display(Markdown(
        f"Normal mode's count exchange, from the end of the layer's compute to the plan's end (the counts' "
        f"all-gather across the nodes, the host's read of them, and the kernels the host could only launch after "
        f"it):\n\n- took {toy_n['count exchange (µs, rank 0)']:.1f} µs of its {toy_n['round trip (µs, slowest rank)']:.1f} µs "
        f"round trip at the toy's rows ({toy_n['host syncs (rank 0)']} host syncs, one of them the count read);\n"
        f"- took {n['count exchange (µs, rank 0)']:.1f} of {n['round trip (µs, slowest rank)']:.1f} µs with DeepSeek-V3's "
        f"rows: the exchange does not grow with the rows, the data does.\n\nLow latency, which has no exchange and no "
        f"host sync, took {ll_eager['round trip (µs, slowest rank)']:.1f} µs eager and "
        f"{ll_graph['round trip (µs, slowest rank)']:.1f} µs as one graph replay (the host pays "
        f"{ll_graph['host launches (µs, rank 0)']:.0f} µs of launches instead of "
        f"{ll_eager['host launches (µs, rank 0)']:.0f} µs) with DeepSeek-V3's rows, against "
        f"{n['round trip (µs, slowest rank)']:.1f} µs for normal mode.\n\nThese {c['max_tokens']} tokens per rank are "
        "a decoding batch: a prefill or training batch carries far more rows, where normal mode's exchange is a small "
        "share and its bandwidth matters more (section c), which is why DeepEP keeps both modes."))

# %% [markdown]
# ## What this machine can and cannot say about DeepEP's numbers
#
# Published (DeepEP V1, H800, not measured here) next to what the same round trips take here on gloo. The "GB/s" of
# this run is the bytes the rank sent divided by the dispatch + combine time: CPU memory copies and thread hand-offs,
# not NVLink or RDMA.

# %%
pub = r0["published"]
table = [{"what": f"DeepEP {name} ({link}, published)", "dispatch GB/s": d, "combine GB/s": cb,
          "round trip GB/s": None} for name, link, d, cb in pub["normal"]["rows"]]
for name in r0["timing"]:
    t = statistics.median(r["timing"][name]["mean_s"] for r in results)
    sent = statistics.median(r["timing"][name]["sent_bytes"] for r in results)
    table.append({"what": f"this run: {name} (gloo, {t * 1e3:.1f} ms)", "dispatch GB/s": None, "combine GB/s": None,
                  "round trip GB/s": sent / t / 1e9})
display(viz.table(table, title=f"Bandwidth: DeepEP ({pub['normal']['setup']}) vs this run (bytes a rank sent / time)",
                  formats={"dispatch GB/s": ".3g", "combine GB/s": ".3g", "round trip GB/s": ".3g"}))
s = r0["deepep_scale"]
display(Markdown(
    f"**At DeepEP's scale, from the routing alone** (computed, no transfer): {s['T']} tokens, top-{s['K']} of "
    f"{s['E']} experts on {s['R']} ranks ({s['R'] // s['ranks_per_node']} nodes of {s['ranks_per_node']}), node-limited to "
    f"{s['max_nodes']} nodes, random logits. A source rank sends {s['rank_rows']:,} deduplicated rows instead of "
    f"{s['pairs']:,} ({s['rank_rows'] / s['pairs']:.3f}×); its inter-node rows fall from {s['remote_node_rank_rows']:,} "
    f"(direct) to {s['remote_node_rows']:,} with two hops ({s['remote_node_rows'] / s['remote_node_rank_rows']:.3f}×). "
    f"An FP8 row of H = {s['H']} is {s['fp8_row_bytes']:,} B against {s['bf16_row_bytes']:,} B in bf16. A low-latency "
    f"receive buffer at EP8 with 128 tokens per rank holds {s['ll_buffer_rows_ep8']:,} rows "
    f"({s['ll_buffer_bytes_ep8_fp8'] / 2**20:.0f} MiB in FP8), of which a full batch fills "
    f"{s['ll_used_rows_ep8']:,} per rank on average ({s['ll_used_rows_ep8'] / s['ll_buffer_rows_ep8']:.1%} = K/E, "
    "formula, whatever the routing)."))

# %% [markdown]
# ## What the measurement says about the article

# %%
fp8_row = snr["fp8"]["row_bytes"] / snr["bf16"]["row_bytes"]
nvl = [row for row in pub["normal"]["rows"] if row[1] == "NVLink"][0]
rdma = [row[2] for row in pub["normal"]["rows"] if row[1] == "RDMA"]
display(Markdown(
    "- *\"High-throughput kernels: NVLink + RDMA forwarding\"*: the forwarding idea is measured exactly — the "
    f"inter-node bytes equal Σ_t |nodes(t)|·H·b (ledger == closed form on every rank), {inter_two:,} B against "
    f"the direct path's {inter_direct:,} B ({inter_two / inter_direct:.3f}×, section c). The speeds ({nvl[2]} GB/s "
    f"NVLink, {min(rdma)}–{max(rdma)} GB/s RDMA, published) need the hardware; the gloo figures above are no "
    "substitute.\n"
    f"- Deduplication, which the article does not mention, sends {wire['dedup'] / wire['plain']:.3f}× the plain "
    f"all-to-all's dispatch bytes at these routing shapes (section b).\n"
    "- *\"Low-latency kernels: pure RDMA, for decoding\"*: the fixed-buffer format is reproduced, with its cost — at "
    f"{tokens[-1]} tokens per rank {1 - waste[-1]:.1%} of the buffer rows are padding. That is 1 − T·K/(E·M) "
    f"(formula) whatever the routing, which only moves padding between ranks: even a full batch of M = {M} tokens "
    f"leaves 1 − K/E = {1 - K / E:.1%} of the rows empty (section d).\n"
    f"- *\"FP8, and hook-based overlap that takes no SMs\"*: an FP8 row with its per-128 scales is {fp8_row:.3f}× a "
    f"bf16 row, at {snr['fp8']['dispatch_snr_db']:.1f} dB (section e). The hook is reproduced as an API (issue now, "
    "complete later); whether it overlaps depends on who moves the bytes — here a CPU thread sharing the cores "
    "with the computation, on a GPU the NIC, which is what \"no SMs\" means."))

# %% [markdown]
# The headline for the course results page: the forwarding idea in bytes the ledger counted (nodes emulated);
# the published bandwidths need NVLink and RDMA.

# %%
# the graphed low-latency round trip against normal mode's, replayed across the calibration's band
sens = None if E_ is None else band("normal / graphed low-latency round trip", E_["sensitivity"],
                                    key=lambda v: v["normal"] / v["graph"])
headline("14", "DeepEP-style dispatch (dedup, two-hop forwarding, FP8)",
         f"two-hop forwarding sends {inter_two / inter_direct:.3f}× the inter-node bytes of direct sends "
         f"({inter_two:,} vs {inter_direct:,} B, {R // rpn} emulated nodes × {rpn}); dedup "
         f"{wire['dedup'] / wire['plain']:.3f}× the plain all-to-all's bytes; FP8 rows {fp8_row:.3f}× bf16 at "
         f"{snr['fp8']['dispatch_snr_db']:.1f} dB; every round trip exact",
         value=inter_two / inter_direct, unit="× direct inter-node bytes",
         claim="a token crosses to each remote node once (RDMA), then fans out over NVLink: fewer inter-node "
               "bytes than sending to every remote rank", source="DeepSeek-V3 report §3.2.2; DeepEP",
         reproduced=(check("two-hop forwarding sends fewer inter-node bytes than direct sends (the ledger equals the "
                           "closed form Σ_t |nodes(t)|·H·b: a property of the routing, no magnitude claimed)",
                           bool(inter_two < inter_direct)) if rpn > 1 else
                     not_decidable("two-hop forwarding", "one rank per node: there is nothing to forward")),
         note=f"published speeds ({nvl[2]} GB/s NVLink, {min(rdma)}–{max(rdma)} GB/s RDMA on H800) are not "
              "testable on a CPU; bytes are counted by the ledger and equal the closed forms",
         emulated="" if E_ is None else (
             f"the low-latency kernels' decoding case on {E_['gpu']} (`{E_['cluster']}`), {c['max_tokens']} tokens per "
             f"rank, token rows as "
             f"DeepSeek-V3's: dispatch + combine after the layer's compute {n['round trip (µs, slowest rank)']:.1f} µs "
             f"in normal mode (its count exchange {n['count exchange (µs, rank 0)']:.1f} µs, then a host sync), "
             f"{ll_eager['round trip (µs, slowest rank)']:.1f} µs low latency, "
             f"{ll_graph['round trip (µs, slowest rank)']:.1f} µs low latency as one CUDA graph replay (normal mode "
             "cannot be captured: the audit finds its host read of the counts)"),
         emulated_reproduced=None if E_ is None else check(
             "the graphed low-latency round trip is shorter than normal mode's at every point of the model's "
             "sensitivity band (the model's comparison: DeepEP states no ratio)", bool(sens["low"] > 1),
             why=f"normal / graphed {sens['value']:.2f}× [{sens['low']:.2f}, {sens['high']:.2f}]"))

# %% [markdown]
# ## Try this
#
# - `max_nodes = 1`: every token's experts on one node; how many bytes cross nodes now?
# - `preset = "full"` with `backend = "nccl"` on a cluster, `world_size = 64`, `ranks_per_node = 8` and
#   `max_nodes = 4`: DeepSeek-V3's shape.
# - A code edit: `TokenDispatcher(..., capacity=..., overflow="drop")` (`toolkit.moe.TokenDispatcher`) in
#   `toolkit/lessons/l14_deepep.py`: what a capacity does to the same routing.
#
# ## Sources
#
# - `deepseek-ai/DeepEP` (README and `docs/legacy.md`): `get_dispatch_layout`, `dispatch`/`combine`, the
#   low-latency mode with `return_recv_hook`, the published H800 numbers quoted above.
# - DeepSeek-AI, *DeepSeek-V3 Technical Report*, arXiv 2412.19437: node-limited routing (§2.1.2), FP8 dispatch and
#   BF16 combine, two-hop IB→NVLink forwarding (§3.2.2).
# - PyTorch `torch.distributed.all_to_all_single` (gloo on CPU, nccl on GPUs).
