"""The bytes of the composed tiny run (``toolkit.compose``, lesson 17) per rank, in memory and on the wire, tensor
by tensor: a model, checked by measurement.

For a large model ``toolkit.planner``'s formulas are the usual approximations. For the toolkit's own tiny MoE
GPT the same categories can be written down exactly and checked against ``MemoryTracker`` (memory) and the
``CommLedger`` (bytes) on every rank of ``toolkit.compose``'s run. N = micro_batch x seq_len tokens,
D = d_model, F = d_ff, H heads, E experts, k = top_k, V = vocabulary, e = bytes of the compute dtype (4 fp32,
2 bf16); S = N·k (token, expert) pairs this rank sends, R = rows its experts receive (N·k on average when
ep = dp: the router decides; the run reports it)::

    parameters     embed V·D + T·D;  block 2·2D (norms) + 3D²+3D (qkv) + D²+D (proj) + D·E (router)
                   + E/ep experts x (2·D·F + F + D);  head 2D + V·D           (x e bytes; grads the same)
    optimizer      AdamW m, v: 8 B/param (+4 B step counter per tensor); MasterAdamW + 4 B fp32 master;
                   ReuseAdamW + 2 B int16 residual instead
    saved per MoE layer and micro-batch (what autograd keeps, listed with saved_tensors_hooks on the model):
                   8·N·D·e   ln1 in, qkv in, qkv out (3), attention out, ln2 in, router in
                 + 4·N·e + 4·N·H     LayerNorm mean/rstd (x2), attention logsumexp (fp32)
                 + N·(E + 1 + 2k)·e + 8·N·k          router: probabilities, sum, top-k values and weights, ids
                 + 16·(S + R) + S·e + 2·S·D·e        dispatcher: int64 indices, pair weights, combine rows
                 + R·(D + 2F)·e                      experts: input, fc1 output, GELU output
    saved by the head: 2·N·D·e + 2·N·e (ln_f) + 4·N·V (log-softmax output, fp32)
    working set    the forward of the head also holds its logits (N·V·e, and their fp32 copy when e = 2);
                   its backward two fp32 [N, V] gradients and one [N, D]; other stages one layer's
                   dispatch buffers (2·S·D·e); p2p buffers in flight: one activation each way (2·N·D·e);
                   a quantized dispatch its fp32 staging (2·max(S, R)·D·4: a float32 copy of the rows it
                   encodes or decodes and its scaled copy); under offload two groups on the
                   device at once, plus (backward) the gradient of the largest
    bytes on the wire per step (ledger convention: what this rank sends)
                   p2p       one [micro_batch, T, D] activation or gradient per stage boundary crossed
                   all-to-all per MoE layer and micro-batch: dispatch (codec rows), combine, and their
                             two gradients (combine codec), each for the pairs that leave the rank
                   all-reduce 2(dp-1)/dp x the replicated gradients (EDGC: its low-rank factors)

The peak of a rank walks its action order (the schedule): held micro-batches x saved bytes, the stage
gradients from the first backward of that stage on, plus the working set of the op running then.
"""
from __future__ import annotations


def tiny_param_counts(cfg, ep: int = 1) -> dict[str, int]:
    """Parameters of the toolkit GPT's parts (``embed``, ``block`` with ``n_expert/ep`` local experts, ``head``),
    each split into ``linear`` (weights whose gradient a zero-bubble W computes) and ``other``, and the number of
    parameter tensors (the optimizer keeps a 4-byte step counter per tensor)."""
    D, F, V, T, E = cfg.d_model, cfg.d_ff, cfg.vocab_size, cfg.seq_len, cfg.n_expert
    if E:
        local = E // ep
        mlp, mlp_tensors = D * E + local * (2 * D * F + F + D), 1 + 4 * local
    else:
        mlp, mlp_tensors = 2 * D * F + F + D, 4
    block_linear = 3 * D * D + 3 * D + D * D + D + mlp
    return {"embed": {"linear": 0, "other": V * D + T * D, "tensors": 2},
            "block": {"linear": block_linear, "other": 4 * D, "tensors": 8 + mlp_tensors},
            "head": {"linear": V * D, "other": 2 * D, "tensors": 3}}


def tiny_groups(cfg, tokens: int, elem: int, rows: list | None, first: bool, last: bool) -> list[tuple[float, float]]:
    """Saved bytes of one stage's forward for one micro-batch, as the activation offloader's groups in forward
    order: ``[(offloadable, kept), ...]`` (``kept``: integer tensors and the stage's received input, which
    ``ActivationOffloader`` never moves). ``rows``: rows received per MoE layer (default N·k each)."""
    N, D, F, H, E, k, V = tokens, cfg.d_model, cfg.d_ff, cfg.n_head, cfg.n_expert, cfg.top_k, cfg.vocab_size
    S = N * k
    groups = []
    for i, R in enumerate(rows):
        R = S if R is None else R
        leaf = not first and i == 0  # the input this stage received: a leaf the executor holds for its gradient
        groups += [(0 if leaf else N * D * elem, 2 * N * elem + (N * D * elem if leaf else 0)),  # ln1: in, stats
                   (N * D * elem, 0),                                    # qkv: its input
                   (3 * N * D * elem + 4 * N * H, 0),                    # core: q, k, v (one storage), logsumexp
                   (N * D * elem, 0),                                    # proj: attention output
                   (N * D * elem + 2 * N * elem, 0)]                     # ln2: in, stats
        if E:  # router, dispatcher and experts (no named module around them: group "other")
            groups.append((N * D * elem + N * (E + 1 + 2 * k) * elem + S * elem + 2 * S * D * elem
                           + R * (D + 2 * F) * elem, 8 * N * k + 16 * (S + R)))
        else:  # fc1 in, act in, fc2 in
            groups += [(N * D * elem, 0), (N * F * elem, 0), (N * F * elem, 0)]
    if last:
        groups += [(2 * N * D * elem + 2 * N * elem, 0), (4 * N * V, 0)]  # head: ln_f, out; the loss: log-softmax
    return groups


def tiny_deferred_bytes(cfg, tokens: int, elem: int, rows: list, last: bool) -> float:
    """What an I (input-gradient backward) leaves for its W: every Linear's input and output gradient."""
    N, D, F, E, k = tokens, cfg.d_model, cfg.d_ff, cfg.n_expert, cfg.top_k
    out = 0.0
    for R in rows:
        R = N * k if R is None else R
        out += (3 * N * D + 3 * N * D + N * D) * elem  # qkv in, out-grad [N,3D]; proj in ... out-grad: N·D + N·D
        out += (N * D + N * E + R * D + R * F + R * F + R * D) * elem if E else (N * D + N * F + N * F + N * D) * elem
    if last:
        out += (N * D + N * cfg.vocab_size) * elem
    return out


def composed_memory(c, pp_rank: int, rows: dict | None = None, trace: list | None = None) -> dict:
    """Predicted tensor peak of pipeline rank ``pp_rank`` in one training step of the composed run described by
    ``c`` (a ``toolkit.compose.ComposeConfig``), by category: a model, which lesson 17 checks against the
    ``MemoryTracker`` of every rank.

    ``rows``: ``{(stage, mb): [rows received per MoE layer]}``, the run's router decisions (balanced if missing).
    Walks the rank's action order (the schedule): a forward adds its micro-batch's saved bytes (offloaded: only
    what the offloader keeps, plus the last group when this chunk's backward comes next); a B frees them; an I
    frees all but what its W needs (``tiny_deferred_bytes``), which the W frees. A stage's gradients exist from
    its first B (an I brings the norms' and embeddings', its W the Linears'). The op running adds its working
    set (module docstring). Returns ``{"param", "grad", "optim", "act", "total", "at", "static"}`` at the
    predicted peak (``at``: the action running then).
    """
    from toolkit.pipeline.schedule import make_schedule
    cfg = c.model_config()
    elem = 4 if c.precision == "fp32" else 2
    counts = tiny_param_counts(cfg, c.ep if cfg.n_expert else 1)
    sched = make_schedule(c.schedule, c.pp, c.m)
    stages = sched.stages_of(pp_rank)
    last, per = sched.n_stages - 1, c.n_layer // sched.n_stages
    N, D, V = c.micro_batch * cfg.seq_len, cfg.d_model, cfg.vocab_size
    offload = c.offload != "none"

    def parts(s: int) -> list[dict]:
        return [counts["block"]] * per + ([counts["embed"]] if s == 0 else []) + ([counts["head"]] if s == last else [])

    n_params = sum(p["linear"] + p["other"] for s in stages for p in parts(s))
    n_tensors = sum(p["tensors"] for s in stages for p in parts(s))
    per_param = {"fp32": 8, "bf16": 12, "bf16_residual": 10}[c.precision]
    param, optim = n_params * elem, n_params * per_param + 4 * n_tensors

    def rows_of(s: int, mb: int) -> list:
        return [_received(x) for x in (rows or {}).get((s, mb)) or [None] * per]

    def groups(s: int, mb: int) -> list[tuple[float, float]]:
        return tiny_groups(cfg, N, elem, rows_of(s, mb), s == 0, s == last)

    def output(s: int) -> float:
        return 0 if s == last else N * D * elem  # the stage's output, held by the executor until the backward

    def offloaded(s: int, mb: int) -> bool:
        return offload and (s, mb) in moved

    def held_after_forward(s: int, mb: int, keep_last: bool) -> float:
        g = groups(s, mb)
        if not offloaded(s, mb):
            return sum(a + b for a, b in g) + output(s)
        return sum(b for _, b in g) + (g[-1][0] if keep_last else 0) + output(s)

    def working(op: str, s: int, mb: int) -> float:
        """The op's own bytes beyond what stays held: p2p buffers, the head's logits and their gradients, a
        layer's dispatch buffers, and (offloaded) the two groups on the device at once."""
        w = 2 * N * D * elem  # p2p: an activation arriving and one leaving
        if op == "W":
            return w
        if s == last:
            w += (N * V * (elem + (4 if elem == 2 else 0)) if op == "F" else 2 * 4 * N * V + N * D * elem)
        else:
            w += 2 * N * cfg.top_k * D * elem if cfg.n_expert else N * cfg.d_ff * elem
        rows_max = max((r if r is not None else N * cfg.top_k) for r in rows_of(s, mb)) if cfg.n_expert else N
        if c.a2a_codec in ("int8", "int4", "fp8") and op == "F":  # the codec's staging: two fp32 copies of the
            w += 2 * max(N * cfg.top_k, rows_max) * D * 4  # rows it encodes (sent) or decodes (received)
        if offloaded(s, mb):
            g = [a for a, _ in groups(s, mb)]
            w += max(x + y for x, y in zip(g, g[1:] + [0]))  # a group computed (or reloaded) beside the next
            if op in ("B", "I"):  # and the gradient of the reloaded group's largest tensor
                w += rows_max * cfg.d_ff * elem
        return w

    order = [a for action in sched.ranks[pp_rank] for a in action.parts]
    moved = None  # the (stage, mb) the offloader moves: those whose backward is far enough from their forward
    if offload:
        from toolkit.memory.offload import long_lived, schedule_order
        moved = {key[:2] for key in long_lived(schedule_order(sched, pp_rank), c.offload_skip_within)}
    held: dict[tuple[int, int], float] = {}
    grads: dict[int, set] = {s: set() for s in stages}  # which gradients exist: "other", "linear"
    best = {"total": -1.0}
    for i, a in enumerate(order):
        key = (a.stage, a.mb)
        if a.op == "B":
            grads[a.stage] |= {"other", "linear"}
        elif a.op == "I":
            grads[a.stage].add("other")
        elif a.op == "W":
            grads[a.stage].add("linear")
        grad = sum(p[kind] for s in stages for p in parts(s) for kind in grads[s]) * elem
        current = 0.0
        if a.op == "F":  # the forward being computed: its saved bytes (offloaded: only what stays)
            current = held_after_forward(*key, keep_last=False)
        act = sum(held.values()) + current + working(a.op, *key)
        total = param + optim + grad + act
        if trace is not None:
            trace.append({"at": str(a), "act": act, "grad": grad, "total": total})
        if total > best["total"]:
            best = {"param": param, "grad": grad, "optim": optim, "act": act, "total": total, "at": str(a)}
        if a.op == "F":
            nxt = next((b for b in order[i + 1:] if b.op in ("B", "I")), None)
            held[key] = held_after_forward(*key, keep_last=nxt is not None and (nxt.stage, nxt.mb) == key)
        elif a.op == "B" or a.op == "W":
            held.pop(key, None)
        elif a.op == "I":
            held[key] = tiny_deferred_bytes(cfg, N, elem, rows_of(*key), a.stage == last)
    best["static"] = param + optim
    return best


def tiny_param_shapes(cfg, part: str, ep: int = 1) -> list[tuple[int, ...]]:
    """Shapes of the parameters of ``part`` (``embed``, ``block`` without its experts when ep > 1, ``head``), in
    the model's order: what a data-parallel bucket of that part holds."""
    D, F, V, T, E = cfg.d_model, cfg.d_ff, cfg.vocab_size, cfg.seq_len, cfg.n_expert
    if part == "embed":
        return [(V, D), (T, D)]
    if part == "head":
        return [(D,), (D,), (V, D)]
    shapes = [(D,), (D,), (3 * D, D), (3 * D,), (D, D), (D,), (D,), (D,)]
    if not E:
        return shapes + [(F, D), (F,), (D, F), (D,)]
    shapes.append((E, D))
    if ep == 1:
        shapes += [(F, D), (F,), (D, F), (D,)] * E
    return shapes


def _received(x):
    """Rows an MoE layer's experts receive: an int, the first of a ``record_routing`` tuple, or None."""
    return x[0] if isinstance(x, (tuple, list)) else x


def composed_bytes(c, pp_rank: int, rows: dict | None = None, edgc_ranks: list | None = None) -> dict[str, float]:
    """Bytes this pipeline rank sends in one training step of the composed run ``c``, by op (module docstring):
    ``isend`` (pipeline p2p), ``all_to_all_single`` (per MoE layer and micro-batch: the pairs this rank sends to
    other ranks' experts, in the dispatch codec and, as gradients, in the combine dtype; the rows it received
    from other ranks, back in the combine and, as gradients, in the dispatch's backward: ``rows`` as
    ``Composed.record_routing`` gives them, else (ep-1)/ep of N·k each way) and ``all_reduce`` (data parallel;
    ``edgc_ranks``: each step's ranks of this rank's buckets under EDGC, averaged; default r_init)."""
    from toolkit.comm.edgc import step_elements
    from toolkit.comm.quant_a2a import wire_bytes_per_token
    from toolkit.pipeline.schedule import make_schedule
    cfg = c.model_config()
    elem = 4 if c.precision == "fp32" else 2
    sched = make_schedule(c.schedule, c.pp, c.m)
    last, per = sched.n_stages - 1, c.n_layer // sched.n_stages
    N, D = c.micro_batch * cfg.seq_len, cfg.d_model
    out = {"isend": 0.0, "all_to_all_single": 0.0, "all_reduce": 0.0}
    acts = [a for action in sched.ranks[pp_rank] for a in action.parts]
    out["isend"] = sum(len(sched.sends(a)) for a in acts) * N * D * elem
    ep = c.ep if cfg.n_expert else 1
    if ep > 1:
        dtype_bytes = {4: "float32", 2: "bfloat16"}[elem]
        import torch
        row = wire_bytes_per_token(c.a2a_codec, D, c.a2a_block, getattr(torch, dtype_bytes))
        S, leave = N * cfg.top_k, (ep - 1) / ep
        for a in acts:
            if a.op != "F":
                continue
            for x in (rows or {}).get((a.stage, a.mb)) or [None] * per:
                sent, recv = (x[1], x[2]) if isinstance(x, (tuple, list)) else (S * leave, S * leave)
                out["all_to_all_single"] += sent * (row + D * elem) + recv * 2 * D * elem
    if c.dp > 1:
        steps = [list(r) for r in edgc_ranks] if edgc_ranks else [[]]
        for i, s in enumerate(sched.stages_of(pp_rank)):
            shapes = [sh for _ in range(per) for sh in tiny_param_shapes(cfg, "block", ep)]
            shapes = (tiny_param_shapes(cfg, "embed") if s == 0 else []) + shapes + \
                (tiny_param_shapes(cfg, "head") if s == last else [])
            for ranks in steps:
                rank = (ranks[i] if i < len(ranks) else c.edgc_rank) if c.dp_comm == "edgc" else None
                elements = sum(step_elements(shapes, rank, 2.0))
                out["all_reduce"] += 2 * (c.dp - 1) / c.dp * elements * elem / len(steps)
    return out
