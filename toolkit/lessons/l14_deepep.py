"""Lesson 14, per rank: DeepEP-style dispatch and combine against a plain all-to-all (``toolkit.moe``).

    routing      real text ─► byte embeddings x [T,H] (bf16 values) ─► gate ─► top-k slot ids, dyadic weights
    (a) layout   dispatch_layout (vectorized) == layout_brute_force (loops)
    (b) dedup    TokenDispatcher plain vs dedup, bf16 payload: ledger bytes == closed forms; round trip exact
    (c) two hops TwoHop on emulated nodes: hop-1 (inter-node) bytes == Σ_t |nodes(t) \\ own| · H · b
    (d) LL       LowLatency fixed buffers: padding waste vs tokens, round trip, receive hook vs blocking
    (e) codecs   fp8 / int8 dispatch (per-128-channel scales), bf16 combine: bytes per row and SNR
    (f) capture  normal and low-latency round trips under toolkit.graphs.audit: the host read of the exchanged
                 counts (a host sync) in normal mode, none in low-latency mode
    timing       bench.compare of the round trips; rank 0 also computes the layout at DeepEP's scale
    emulated     on an emulated cluster (launch(..., cluster=)): both modes after the layer's compute, in virtual
                 time: the count exchange, the host syncs, low latency as one CUDA graph replay; at the toy's
                 shapes and with token rows as STANDS_FOR's. Every other section runs with the emulator paused

Tokens are the MoE-layer input of an untrained model (byte embeddings of ``toolkit.data``'s corpus); rounded to
bf16 values, with gate weights rounded to multiples of 1/256, every sum along the way is exact in fp32, so
the round trips can be compared bit for bit.
"""
from __future__ import annotations

import statistics
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist

from toolkit.models import catalog
from toolkit.data import corpus
from toolkit.graphs import audit
from toolkit.graphs.cuda_graphs import COLLECTIVE_NAMESPACES, HOST_SYNC
from toolkit.moe import CODECS, Codec, TokenDispatcher, dispatch_layout, route, run_experts
from toolkit.moe.deepep import LowLatency, TwoHop, dyadic, layout_brute_force, node_limited_route
from toolkit.quant import qsnr_db
from toolkit.runtime.bench import compare, measure, summarize
from toolkit.runtime.config import Param, common, require_divisible, require_ranks, resolve

WORLD_SIZE = 4  # two emulated nodes of two ranks
PARAMS = {
    **common("warmup", "bench_steps", "rounds", "seed", "n_expert", "top_k"),
    "tokens": Param(int, "tokens per rank", ge=1),
    "hidden": Param(int, "hidden size H of a token", ge=2),
    "ranks_per_node": Param(int, "ranks per emulated node for two-hop forwarding (0: world_size // 2)", ge=0),
    "max_nodes": Param(int, "node-limited routing: at most this many nodes per token (0: unlimited)", ge=0),
    "max_tokens": Param(int, "low-latency buffers: tokens per rank they hold", ge=1),
    "ll_tokens": Param(list, "tokens per rank of the low-latency padding sweep (each <= max_tokens)", of=int, ge=1),
    "codecs": Param(list, "dispatch payloads compared in (e)", of=str, choices=CODECS),
    "block": Param(int, "channels per fp32 scale of the quantized payloads", ge=2),
    "overlap_matmuls": Param(int, "[T,H]x[H,H] matmuls between issuing the LL dispatch and calling its hook "
                                  "(0: measure how many last one blocking dispatch)", ge=0),
}
PRESETS = {
    "smoke": dict(tokens=64, hidden=256, n_expert=16, top_k=4, ranks_per_node=0, max_nodes=0, max_tokens=64,
                  ll_tokens=[8, 16, 32, 64], codecs=["bf16", "int8", "fp8"], block=128, overlap_matmuls=0,
                  warmup=1, bench_steps=2, rounds=3, seed=0),
    "default": dict(tokens=128, hidden=512, n_expert=32, top_k=8, ranks_per_node=0, max_nodes=0, max_tokens=64,
                    ll_tokens=[8, 16, 32, 64], codecs=["bf16", "int8", "fp8"], block=128, overlap_matmuls=0,
                    warmup=1, bench_steps=2, rounds=3, seed=0),
    "full": dict(tokens=4096, hidden=7168, n_expert=256, top_k=8, ranks_per_node=0, max_nodes=0, max_tokens=128,
                 ll_tokens=[16, 32, 64, 128], codecs=["bf16", "int8", "fp8"], block=128, overlap_matmuls=0,
                 warmup=2, bench_steps=5, rounds=5, seed=0),
}
# DeepEP V1 on H800 (docs/legacy.md of deepseek-ai/DeepEP): published, not measured here
STANDS_FOR = "deepseek-v3"  # the emulated section's matched run: token rows of this model's hidden size
DEEPEP_PUBLISHED = {
    "normal": {"setup": "4096 tokens, H=7168, top-8, FP8 dispatch, BF16 combine",
               "rows": [("intranode EP8", "NVLink", 153, 158), ("internode EP16", "RDMA", 43, 43),
                        ("internode EP32", "RDMA", 58, 57), ("internode EP64", "RDMA", 51, 50)]},
    "low_latency": {"setup": "128 tokens, H=7168, top-8, FP8 dispatch, BF16 combine",
                    "dispatch_us": {"EP8": 77, "EP256": 194}, "combine_us": {"EP8": 114, "EP256": 360}},
}


def validate(cfg: dict, world_size: int) -> dict:
    cfg = resolve(cfg, PRESETS, PARAMS)
    require_ranks(world_size, 4, "two-hop forwarding over two emulated nodes of two ranks")
    rpn = cfg["ranks_per_node"] or world_size // 2
    if world_size % rpn or world_size // rpn < 2:
        raise ValueError(f"ranks_per_node={cfg['ranks_per_node']} must divide world_size={world_size} into at least "
                         "2 nodes (0 picks world_size // 2)")
    require_divisible("n_expert", cfg["n_expert"], world_size, "world_size", "each rank owns n_expert/world experts")
    if cfg["top_k"] > cfg["n_expert"]:
        raise ValueError(f"top_k={cfg['top_k']} must be in 1..n_expert={cfg['n_expert']}")
    nodes, per_node = world_size // rpn, cfg["n_expert"] // (world_size // rpn)
    if cfg["max_nodes"] and not (cfg["max_nodes"] <= nodes and cfg["max_nodes"] * per_node >= cfg["top_k"]):
        raise ValueError(f"max_nodes={cfg['max_nodes']} must be in 1..{nodes} (nodes) and hold top_k={cfg['top_k']} "
                         f"experts ({per_node} per node); 0 turns node-limited routing off")
    if cfg["hidden"] % cfg["block"] or cfg["block"] % 2:
        raise ValueError(f"block={cfg['block']} must be even and divide hidden={cfg['hidden']} (one fp32 scale per "
                         "token per block of channels)")
    if cfg["max_tokens"] < max(cfg["ll_tokens"]) or cfg["tokens"] < max(cfg["ll_tokens"]):
        raise ValueError(f"ll_tokens={cfg['ll_tokens']}: each must be <= max_tokens={cfg['max_tokens']} (the fixed "
                         f"buffers' size) and <= tokens={cfg['tokens']}")
    return {**cfg, "ranks_per_node": rpn}


# ---- the tokens and their routing --------------------------------------------------------------------------------
def routed_tokens(cfg: dict, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T,H] (bf16 values in fp32), slot ids [T,K], dyadic weights [T,K] of this rank."""
    T, H, E, K = cfg["tokens"], cfg["hidden"], cfg["n_expert"], cfg["top_k"]
    gen = torch.Generator().manual_seed(cfg["seed"])  # the same embedding and gate on every rank
    emb = torch.randn(256, H, generator=gen)
    gate = torch.randn(H, E, generator=gen) / H ** 0.5
    text = corpus()
    start = (rank * 7919 * T) % (text.numel() - T)
    x = emb[text[start:start + T]].bfloat16().float()
    logits = x.double() @ gate.double()  # float64: no near-tie in the top-k flips with the CPU's last bits
    if cfg["max_nodes"]:
        weights, ids = node_limited_route(logits, K, E // (world // cfg["ranks_per_node"]), cfg["max_nodes"])
    else:
        weights, ids = route(logits, K)
    return x, ids, dyadic(weights).float()


def _identity_round_trip(disp, x, ids, w) -> torch.Tensor:
    plan = disp.plan(ids, w, x)
    return disp.combine(run_experts([torch.nn.Identity()] * disp.local, disp.dispatch(x, plan), plan.recv_counts), plan)


# ---- (a) layout ------------------------------------------------------------------------------------------------
def layout_check(ids: torch.Tensor, cfg: dict, world: int) -> dict:
    fast = dispatch_layout(ids, cfg["n_expert"], world, cfg["ranks_per_node"])
    slow = layout_brute_force(ids.cpu(), cfg["n_expert"], world, cfg["ranks_per_node"])
    fields = ("tokens_per_rank", "tokens_per_node", "tokens_per_expert", "token_in_rank", "token_in_node")
    return {"equal": {f: torch.equal(getattr(fast, f).cpu(), getattr(slow, f)) for f in fields},
            "tokens_per_rank": fast.tokens_per_rank.tolist(), "tokens_per_node": fast.tokens_per_node.tolist(),
            "tokens_per_expert": fast.tokens_per_expert.tolist(),
            "ranks_per_token_hist": torch.bincount(fast.token_in_rank.sum(1), minlength=world + 1).tolist()}


# ---- (b) dedup ---------------------------------------------------------------------------------------------------
def dedup_bytes(ctx, cfg: dict, x, ids, w) -> dict:
    R, rank, (T, K), H = ctx.world_size, ctx.rank, ids.shape, cfg["hidden"]
    E, local = cfg["n_expert"], cfg["n_expert"] // R
    lay = dispatch_layout(ids, E, R)
    row = Codec("bf16").row_bytes(H)
    out = {"closed_form": {"plain_payload": T * K * row, "dedup_payload": int(lay.tokens_per_rank.sum()) * row,
                           "plain_wire": int((ids // local != rank).sum()) * row,
                           "dedup_wire": int(lay.tokens_per_rank.sum() - lay.tokens_per_rank[rank]) * row},
           "row_bytes": row, "round_trip_exact": {}, "recv_equals_tokens_per_expert": {}}
    for name, dedup in (("plain", False), ("dedup", True)):
        disp = TokenDispatcher(E, K, codec="bf16", combine_codec="bf16", dedup=dedup)
        disp.phase = lambda n, name=name: ctx.ledger.tag(f"b/{name}/{n}")
        plan = disp.plan(ids, w, x)
        disp.combine(run_experts([torch.nn.Identity()] * local, disp.dispatch(x, plan), plan.recv_counts), plan)
        tag = f"b/{name}/dispatch"
        out[name] = {"ledger_wire": ctx.ledger.total("sent_bytes", tag=tag),
                     "ledger_payload": ctx.ledger.total("payload_bytes", tag=tag),
                     "ledger_combine_wire": ctx.ledger.total("sent_bytes", tag=f"b/{name}/combine"),
                     "meta_wire": ctx.ledger.total("sent_bytes", tag=f"b/{name}/dispatch_meta")}
        exact = TokenDispatcher(E, K, dedup=dedup)  # codec "none": the round trip is exact
        out["round_trip_exact"][name] = torch.equal(_identity_round_trip(exact, x, ids, w), x)
        recv = torch.tensor(sum(plan.recv_counts), device=x.device)
        dist.all_reduce(recv)
        out["recv_equals_tokens_per_expert"][name] = int(recv) == int(plan.tokens_per_expert.sum())
    return out


# ---- (c) two hops ----------------------------------------------------------------------------------------------
def two_hop(ctx, cfg: dict, x, ids, w, hop: TwoHop) -> dict:
    R, rpn, rank, H = ctx.world_size, cfg["ranks_per_node"], ctx.rank, cfg["hidden"]
    lay = dispatch_layout(ids, cfg["n_expert"], R, rpn)
    node = rank // rpn
    row = Codec("bf16").row_bytes(H)
    others = [r for r in range(R) if r // rpn != node]
    hop.codec, hop.combine_codec = Codec("bf16"), Codec("bf16")
    hop.phase = lambda n: ctx.ledger.tag(f"c/{n}")
    expert_in, handle = hop.dispatch(x, ids, w)
    hop.combine(expert_in, handle)
    total = lambda n: ctx.ledger.total("sent_bytes", tag=f"c/{n}")
    hop.codec = hop.combine_codec = Codec("none")
    hop.phase = lambda n: ctx.ledger.tag("c/exact")
    exin, h2 = hop.dispatch(x, ids, w)
    back = hop.combine(exin, h2)
    recv = torch.tensor(sum(h2.recv_counts), device=x.device)
    dist.all_reduce(recv)
    per_expert = lay.tokens_per_expert.clone()
    dist.all_reduce(per_expert)
    return {"row_bytes": row,
            "closed_form": {"inter_node_two_hop": int(lay.token_in_node.sum() - lay.token_in_node[:, node].sum()) * row,
                            "inter_node_direct": int(lay.token_in_rank[:, others].sum()) * row,
                            "direct_all_remote": int(lay.tokens_per_rank.sum() - lay.tokens_per_rank[rank]) * row},
            "ledger": {"hop1": total("hop1"), "hop2": total("hop2"), "meta": total("meta"), "counts": total("counts"),
                       "combine_hop1": total("combine_hop1"), "combine_hop2": total("combine_hop2")},
            "round_trip_exact": torch.equal(back, x),
            "recv_equals_tokens_per_expert": int(recv) == int(per_expert.sum())}


# ---- (d) low-latency mode --------------------------------------------------------------------------------------
def low_latency(ctx, cfg: dict, x, ids, w) -> dict:
    R, rank, H, M = ctx.world_size, ctx.rank, cfg["hidden"], cfg["max_tokens"]
    E, local = cfg["n_expert"], cfg["n_expert"] // R
    exact = LowLatency(E, M)
    sweep = []
    for T in cfg["ll_tokens"]:
        xs, ids_s, ws = x[:T], ids[:T], w[:T]
        exact.phase = lambda n, T=T: ctx.ledger.tag(f"d/{T}/{n}")
        recv_x, count, handle, _ = exact.dispatch(xs, ids_s, ws)
        back = exact.combine(recv_x, handle)
        per_expert = torch.bincount(ids_s.reshape(-1), minlength=E)
        dist.all_reduce(per_expert)
        sweep.append({"tokens": T, "used_rows": int(count.sum()), "buffer_rows": exact.buffer_rows(),
                      "waste": 1 - int(count.sum()) / exact.buffer_rows(),
                      "ledger_wire": ctx.ledger.total("sent_bytes", tag=f"d/{T}/dispatch"),
                      "padded_wire_closed_form": (R - 1) * local * M * Codec("none").row_bytes(H),
                      "valid_remote_rows": int((ids_s // local != rank).sum()),
                      "round_trip_exact": torch.equal(back, xs),
                      "recv_equals_tokens_per_expert": torch.equal(count, per_expert[rank * local:(rank + 1) * local])})
    return {"sweep": sweep, "buffer_shape": [local, R * M, H], **hook_overlap(ctx, cfg, x[:M], ids[:M], w[:M])}


def hook_overlap(ctx, cfg: dict, x, ids, w) -> dict:
    """FP8 low-latency dispatch, other work, then the data: blocking vs issue-now-complete-later (the hook).

    Exposed communication = time this rank spends in communication calls (blocking: the whole dispatch;
    hook: issuing plus completing) less the time to lay out and encode the padded send buffer, which is
    reported on its own ("encode": local work, no transfer); measured on every timed step. The other work is
    ``overlap_matmuls`` matmuls (0: calibrated to last as long as one blocking dispatch)."""
    ll = LowLatency(cfg["n_expert"], cfg["max_tokens"], codec=Codec("fp8", cfg["block"]), combine_codec="bf16")
    a = torch.randn(x.shape[0], x.shape[1], device=x.device)
    b = torch.randn(x.shape[1], x.shape[1], device=x.device) / x.shape[1] ** 0.5
    exposed, encode = {"blocking": [], "hook": []}, {"blocking": [], "hook": []}
    with ctx.ledger.tag("timing"):
        n_matmuls = cfg["overlap_matmuls"] or calibrate(ctx, lambda: ll.dispatch(x, ids, w), lambda: a @ b)
    now, marks = ctx.timeline.now, {}

    @contextmanager
    def mark(name: str):  # start and end of each phase of the last dispatch
        t0 = now()
        yield
        marks[name] = (t0, now())
    ll.phase = mark

    def work():
        y = a
        for _ in range(n_matmuls):
            y = y @ b
        return y

    def blocking(trace: bool = False):
        t0 = now()
        ll.dispatch(x, ids, w)
        t1 = now()
        (e0, e1), t2 = marks["encode"], now()
        work()
        t3 = now()
        encode["blocking"].append(e1 - e0)
        exposed["blocking"].append(t1 - t0 - (e1 - e0))
        if trace:
            for kind, start, end in (("encode", t0, e1), ("dispatch", e1, t1), ("compute", t2, t3)):
                ctx.timeline.add(kind, start, end, variant="blocking")

    def hooked(trace: bool = False):
        t0 = now()
        _, _, _, hook = ll.dispatch(x, ids, w, return_recv_hook=True)
        t1 = now()
        work()
        t2 = now()
        hook()
        t3 = now()
        e0, e1 = marks["encode"]
        encode["hook"].append(e1 - e0)
        exposed["hook"].append(t1 - t0 - (e1 - e0) + t3 - t2)
        if trace:
            for kind, start, end in (("encode", t0, e1), ("issue", e1, t1), ("compute", t1, t2), ("hook", t2, t3)):
                ctx.timeline.add(kind, start, end, variant="hook")

    with ctx.ledger.tag("timing"):
        times = compare({"blocking": blocking, "hook": hooked, "compute only": work}, warmup=cfg["warmup"],
                        steps=cfg["bench_steps"], rounds=cfg["rounds"], sync=ctx.barrier)
        last = lambda v: v[-cfg["bench_steps"] * cfg["rounds"]:]  # the timed steps, in compare's rounds
        timed = {k: summarize(last(v), cfg["bench_steps"]) for k, v in exposed.items()}  # verdict pairs the rounds
        timed_encode = {k: statistics.median(last(v)) for k, v in encode.items()}
        for fn in (blocking, hooked):  # one traced step each, for the timeline
            ctx.barrier()
            fn(trace=True)
    return {"overlap_matmuls": n_matmuls, "hook_step_s": {k: v.median_s for k, v in times.items()},
            "hook_exposed_comm_s": {k: v.median_s for k, v in timed.items()},
            "hook_exposed_comm": {k: v.to_dict() for k, v in timed.items()}, "hook_encode_s": timed_encode}


def calibrate(ctx, comm, unit, reps: int = 3, cap_s: float = 0.03) -> int:
    """How many ``unit()`` calls last as long as one ``comm()``: the median of ``reps`` calls of each
    (``bench.measure``, no warm-up), the largest count over the ranks, at most ``cap_s`` seconds of them (a loaded
    machine stretches the communication most)."""
    def median_time(fn) -> float:
        return measure(fn, warmup=0, steps=reps, rounds=1, trim=0).median_s
    t_unit = max(median_time(lambda: [unit() for _ in range(10)]) / 10, 1e-6)
    n = torch.tensor(max(1, min(round(median_time(comm) / t_unit), int(cap_s / t_unit))), device=ctx.device)
    dist.all_reduce(n, op=dist.ReduceOp.MAX)
    return int(n)


# ---- (e) quantized dispatch ------------------------------------------------------------------------------------
def codec_sweep(ctx, cfg: dict, x, ids, w) -> dict:
    E, K, local, H, rank = cfg["n_expert"], cfg["top_k"], cfg["n_expert"] // ctx.world_size, cfg["hidden"], ctx.rank
    reference = TokenDispatcher(E, K, dedup=True)
    plan = reference.plan(ids, w, x)
    exact_in = reference.dispatch(x, plan)
    lay = dispatch_layout(ids, E, ctx.world_size)
    remote_rows = int(lay.tokens_per_rank.sum() - lay.tokens_per_rank[rank])
    rows = []
    for c in cfg["codecs"]:
        codec = Codec(c, cfg["block"])
        disp = TokenDispatcher(E, K, codec=codec, combine_codec="bf16", dedup=True)
        disp.phase = lambda n, c=c: ctx.ledger.tag(f"e/{c}/{n}")
        plan = disp.plan(ids, w, x)
        got = disp.dispatch(x, plan)
        back = disp.combine(run_experts([torch.nn.Identity()] * local, got, plan.recv_counts), plan)
        rows.append({"codec": c, "row_bytes": codec.row_bytes(H), "remote_rows": remote_rows,
                     "ledger_dispatch": ctx.ledger.total("sent_bytes", tag=f"e/{c}/dispatch"),
                     "ledger_combine": ctx.ledger.total("sent_bytes", tag=f"e/{c}/combine"),
                     "dispatch_snr_db": qsnr_db(exact_in, got), "round_trip_snr_db": qsnr_db(x, back)})
    return {"rows": rows, "bf16_row_bytes": Codec("bf16").row_bytes(H)}


# ---- (f) capture: which mode a CUDA graph can hold ---------------------------------------------------------------
def ll_round_trip(ll: LowLatency, x, ids, w) -> torch.Tensor:
    """Low-latency dispatch (issued, then completed by its hook), identity experts, combine."""
    recv, _, handle, hook = ll.dispatch(x, ids, w, return_recv_hook=True)
    recv, _ = hook()
    return ll.combine(recv, handle)


def capture_audit(ctx, cfg: dict, x, ids, w) -> dict:
    """Each mode's round trip (fp8 dispatch, bf16 combine, identity experts) under ``toolkit.graphs.audit``: what
    would break a CUDA-graph capture (a host sync, a data-dependent shape), and the collectives apart (NCCL can
    capture those; DeepEP's own kernels replace them)."""
    E, K, M = cfg["n_expert"], cfg["top_k"], cfg["max_tokens"]
    fp8 = Codec("fp8", cfg["block"])
    normal = TokenDispatcher(E, K, codec=fp8, combine_codec="bf16", dedup=True)
    ll = LowLatency(E, M, codec=fp8, combine_codec="bf16")
    out = {}
    with ctx.ledger.tag("capture"):
        for mode, fn in (("normal", lambda: _identity_round_trip(normal, x, ids, w)),
                         ("low_latency", lambda: ll_round_trip(ll, x[:M], ids[:M], w[:M]))):
            found = audit(fn)
            out[mode] = {"breaks_capture": {op: why for op, why in found.items()
                                            if not op.startswith(COLLECTIVE_NAMESPACES)},
                         "collectives": sorted(op for op in found if op.startswith(COLLECTIVE_NAMESPACES))}
    return out


# ---- timing ----------------------------------------------------------------------------------------------------
def timing(ctx, cfg: dict, x, ids, w, hop: TwoHop) -> dict:
    E, K = cfg["n_expert"], cfg["top_k"]
    fp8 = Codec("fp8", cfg["block"])
    plain = TokenDispatcher(E, K, codec="bf16", combine_codec="bf16")
    dedup = TokenDispatcher(E, K, codec="bf16", combine_codec="bf16", dedup=True)
    dedup8 = TokenDispatcher(E, K, codec=fp8, combine_codec="bf16", dedup=True)
    ll = LowLatency(E, cfg["max_tokens"], codec=fp8, combine_codec="bf16")
    M = cfg["max_tokens"]

    def two():
        hop.codec, hop.combine_codec, hop.phase = fp8, Codec("bf16"), lambda n: nullcontext()
        y, h = hop.dispatch(x, ids, w)
        hop.combine(y, h)

    def low_latency():
        recv, _, handle, _ = ll.dispatch(x[:M], ids[:M], w[:M])
        ll.combine(recv, handle)
    candidates = {"plain bf16": lambda: _identity_round_trip(plain, x, ids, w),
                  "dedup bf16": lambda: _identity_round_trip(dedup, x, ids, w),
                  "dedup fp8": lambda: _identity_round_trip(dedup8, x, ids, w),
                  "two-hop fp8": two, f"low-latency fp8 ({M} tokens)": low_latency}
    sent = {}
    with ctx.ledger.tag("timing"):
        for name, fn in candidates.items():  # one untimed call each to count its bytes
            mark = len(ctx.ledger.records)
            fn()
            sent[name] = sum(r.sent_bytes for r in ctx.ledger.records[mark:])
        times = compare(candidates, warmup=cfg["warmup"], steps=cfg["bench_steps"], rounds=cfg["rounds"],
                        sync=ctx.barrier, on_round=ctx.progress)
    return {name: {"mean_s": times[name].mean_s, "sent_bytes": sent[name]} for name in candidates}


# ---- at DeepEP's scale, from the routing alone -------------------------------------------------------------------
def deepep_scale(seed: int = 0, T: int = 4096, E: int = 256, K: int = 8, R: int = 64, rpn: int = 8,
                 max_nodes: int = 4, H: int = 7168) -> dict:
    """Rows a source rank on node 0 sends, by layout only (no transfer): DeepSeek-V3's routing shape with
    random logits (node-limited to ``max_nodes`` of R/rpn nodes)."""
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    _, ids = node_limited_route(logits, K, E // (R // rpn), max_nodes)
    lay = dispatch_layout(ids, E, R, rpn)
    return {"T": T, "E": E, "K": K, "R": R, "ranks_per_node": rpn, "max_nodes": max_nodes, "H": H,
            "pairs": T * K, "rank_rows": int(lay.token_in_rank.sum()),
            "remote_node_rank_rows": int(lay.token_in_rank[:, rpn:].sum()),
            "remote_node_rows": int(lay.token_in_node[:, 1:].sum()),
            "fp8_row_bytes": Codec("fp8").row_bytes(H), "bf16_row_bytes": Codec("bf16").row_bytes(H),
            "ll_buffer_bytes_ep8_fp8": (E // 8) * 128 * 8 * Codec("fp8").row_bytes(H),
            "ll_used_rows_ep8": 128 * K, "ll_buffer_rows_ep8": (E // 8) * 128 * 8}


# ---- on the emulated cluster: the count exchange in virtual time ----------------------------------------------------
def emulated(ctx, cfg: dict, x, ids, w) -> dict | None:
    """Both modes' round trips (fp8 dispatch, bf16 combine, identity experts) on the emulated cluster's clock
    (virtual time, deterministic: one each), each after the same compute, the layer's GEMMs before its dispatch
    (``[max_tokens, H] @ [H, H]`` four times: the host has launched them and runs ahead of the stream). Per run:
    the round trip after that compute; in normal mode the plan within it (counts gathered, then read by the host:
    from the compute's end to the plan's end), the host syncs (ops after which the host waits for its stream), and
    the host's launches. Low latency runs once more as one CUDA graph replay (one launch for all its kernels);
    normal mode cannot (``capture_audit``). Both modes route the same ``max_tokens`` tokens per rank; the padded
    low-latency buffers are timed at the rows DeepEP's puts would write (this rank's pairs, ``ll_written`` of the
    buffer), not at the whole buffer this emulation sends. At the toy's shapes, and with every token row timed as
    ``STANDS_FOR``'s hidden size (the counts as they are)."""
    emu = ctx.emulator
    if emu is None:
        return None
    ctx.reserve_for_replay()  # the bar's last quarter: the run replayed on other figures
    E, K, M, H = cfg["n_expert"], cfg["top_k"], cfg["max_tokens"], cfg["hidden"]
    x, ids, w = x[:M], ids[:M], w[:M]
    fp8 = Codec("fp8", cfg["block"])
    normal = TokenDispatcher(E, K, codec=fp8, combine_codec="bf16", dedup=True)
    ll = LowLatency(E, M, codec=fp8, combine_codec="bf16")
    a, b = torch.randn(M, H, device=x.device), torch.randn(H, H, device=x.device) / H ** 0.5
    marks: dict[str, float] = {}

    def before_dispatch():
        y = a
        for _ in range(4):
            y = y @ b

    ctx.barrier()
    t0 = emu.now()
    with emu.window("compute"):
        before_dispatch()
    compute_s = emu.now() - t0  # the compute alone

    def plain_round_trip():
        marks["plan_start"] = emu.now()
        plan = normal.plan(ids, w, x)
        marks["plan_end"] = emu.now()
        normal.combine(run_experts([torch.nn.Identity()] * normal.local, normal.dispatch(x, plan), plan.recv_counts),
                       plan)

    def host_syncs() -> int:
        return sum(row["calls"] for name, row in emu.ops.items() if name in HOST_SYNC)

    def timed(fn, rows: float, name: str, graph: bool = False) -> dict:
        normal.phase = lambda name: emu.scaled(bytes=1.0 if name == "routing" else rows)
        ll.phase = lambda name: emu.scaled(bytes={"counts": 1.0, "dispatch": rows * written,
                                                  "combine": rows * written}.get(name, rows))
        ctx.barrier()  # clocks aligned, hosts synchronized
        t0 = emu.now()
        with emu.window(name):
            before_dispatch()  # launched: the host runs ahead of the stream
            syncs, launches = host_syncs(), emu.totals()["launch_s"]
            marks.clear()
            with emu.scaled(bytes=rows), emu.graph_replay() if graph else nullcontext():
                fn()
        return {"round_trip_s": emu.now() - t0 - compute_s, "host_syncs": host_syncs() - syncs,
                "launch_s": emu.totals()["launch_s"] - launches,
                "plan_s": marks["plan_end"] - marks["plan_start"] if marks else None}

    written = ids.numel() / ll.buffer_rows()  # DeepEP's puts write this rank's pairs, not the padded buffer
    real = catalog.get(STANDS_FOR)
    out = {"cluster": emu.cluster.name, "ll_written": written, "gpu": emu.cluster.gpu.name, "compute_s": compute_s, "stands_for": STANDS_FOR,
           "link": emu.cluster.link_between(list(range(ctx.world_size)), ctx.world_size).name, "runs": {}}
    for shapes, rows in (("toy", 1.0), (STANDS_FOR, real.hidden / H)):
        out["runs"][shapes] = {"rows_scale": rows,
                               "normal": timed(plain_round_trip, rows, f"{shapes}/normal"),
                               "low latency": timed(lambda: ll_round_trip(ll, x, ids, w), rows,
                                                    f"{shapes}/low latency"),
                               "low latency, one graph replay": timed(lambda: ll_round_trip(ll, x, ids, w), rows,
                                                                      f"{shapes}/graph", graph=True)}

    def round_trips(clocks) -> dict[str, float]:  # the real rows' round trips (slowest rank), from a replay
        compute = max(c.window("compute")["s"] for c in clocks)
        return {m: max(c.window(f"{STANDS_FOR}/{m}")["s"] for c in clocks) - compute
                for m in ("normal", "low latency", "graph")}
    out["sensitivity"] = ctx.replay(round_trips)
    return out


def run(ctx, cfg: dict) -> dict:
    R = ctx.world_size
    x, ids, w = (t.to(ctx.device) for t in routed_tokens(cfg, ctx.rank, R))
    hop = TwoHop(cfg["n_expert"], cfg["ranks_per_node"])  # collective: creates the rdma and nvl groups
    ctx.ledger.name_group(hop.rdma, "rdma")
    ctx.ledger.name_group(hop.nvl, "nvl")
    out = {"world_size": R, "rank": ctx.rank, "config": cfg}
    with ctx.paused():  # the real run, no bookkeeping
        out["layout"] = layout_check(ids, cfg, R)
        ctx.progress(1, 7, "layout")
        out["dedup"] = dedup_bytes(ctx, cfg, x, ids, w)
        ctx.progress(2, 7, "dedup")
        out["two_hop"] = two_hop(ctx, cfg, x, ids, w, hop)
        ctx.progress(3, 7, "two-hop")
        out["codecs"] = codec_sweep(ctx, cfg, x, ids, w)
        ctx.progress(4, 7, "codecs")
        out["low_latency"] = low_latency(ctx, cfg, x, ids, w)
        out["capture"] = capture_audit(ctx, cfg, x, ids, w)
        ctx.progress(5, 7, "low latency")
        with ctx.part(5, 7, "timing"):
            out["timing"] = timing(ctx, cfg, x, ids, w, hop)
    out["emulated"] = emulated(ctx, cfg, x, ids, w)
    ctx.progress(7, 7, "emulated")
    out["deepep_scale"] = deepep_scale() if ctx.rank == 0 else None
    out["spans"] = ctx.timeline.to_json()
    out["published"] = DEEPEP_PUBLISHED
    return out
