"""Lesson 15, per rank: ECHO, elastic cloning of hot experts (``toolkit.moe.echo``), on 4 ranks.

    (a) plan      Zipf(s) routing of ``tokens`` per rank over the experts: all-gathered counts ─► plan_clones;
                  rank loads before/after, the plan's invariants, and a sweep of the clone budget (planner only)
    (b) layer     one MoE layer of the tiny GPT on the same Zipf routing (the real gate's weights at the Zipf ids),
                  expert parallel with and without ECHO: outputs, input / router / expert gradients (home grad +
                  Σ clone grads vs the grad without cloning), tokens per expert and per rank, clone weights bitwise
                  equal to the home expert's, weight and gradient bytes (ledger) against the closed form
    (c) timing    the layer's training step (forward, backward, clone gradients home) for each clone budget,
                  side by side (bench.compare): wall time and the busiest rank's main-thread CPU time
    (c') emulated on an emulated cluster (``launch(..., cluster=)``), matched to STANDS_FOR's experts: the step
                  per clone budget at two token counts (virtual time, deterministic); the cost model
                  A·max_rank_tokens + B·clones + C fitted there, and ``clone_break_even`` at the real size
    (d) learned   the tiny MoE GPT trained (plain SGD) with ECHO on real text: the loads its own router produces,
                  before and after cloning, step by step
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from toolkit.models import catalog
from toolkit.data import batches
from toolkit.lessons.l04_int8_a2a import average_gradients
from toolkit.models import GPT, preset
from toolkit.moe import ExpertParallelMoE, expert_parallel
from toolkit.moe.echo import (Echo, check_plan, clone_break_even, enable_echo, expert_counts, expert_flops_per_pair,
                              expert_param_count, fit_cost_model, flat_params, plan_clones, zipf_routing)
from toolkit.runtime import compat
from toolkit.runtime.bench import compare
from toolkit.runtime.config import Param, common, require_divisible, require_ranks, resolve

WORLD_SIZE = 4
PARAMS = {
    **common("model", "n_layer", "batch", "steps", "lr", "warmup", "bench_steps", "rounds", "seed", "n_expert",
             "top_k"),
    "d_ff": Param(int, "hidden size of each expert's MLP (0: 4 x d_model)", ge=0),
    "spare_slots": Param(int, "empty expert slots per rank that can each host one clone", ge=1),
    "zipf_s": Param(float, "Zipf exponent of the synthetic routing (0: uniform)", ge=0),
    "tokens": Param(int, "tokens per rank of the Zipf-routed layer", ge=1),
    "budgets": Param(list, "clone budgets timed in (c) (0: no cloning)", of=int, ge=0),
    "min_tokens": Param(int, "clones taking fewer pairs are reclaimed", ge=1),
}
PRESETS = {
    "smoke": dict(model="smoke", n_layer=2, batch=2, steps=4, lr=0.2, warmup=1, bench_steps=2, rounds=3, seed=0,
                  n_expert=8, top_k=2, d_ff=0, spare_slots=1, zipf_s=1.2, tokens=256, budgets=[0, 1, 2, 3],
                  min_tokens=1),
    "default": dict(model="smoke", n_layer=2, batch=2, steps=10, lr=0.2, warmup=1, bench_steps=2, rounds=2, seed=0,
                    n_expert=8, top_k=2, d_ff=512, spare_slots=1, zipf_s=1.2, tokens=512, budgets=[0, 1, 2, 3],
                    min_tokens=1),
    "full": dict(model="default", n_layer=4, batch=8, steps=200, lr=0.1, warmup=2, bench_steps=5, rounds=5, seed=0,
                 n_expert=16, top_k=2, d_ff=0, spare_slots=2, zipf_s=1.2, tokens=4096, budgets=[0, 1, 2, 4, 8],
                 min_tokens=1),
}
PHASES = [("plan", 1), ("layer", 2), ("timing", 5), ("emulated", 2), ("learned", 4)]
STANDS_FOR = "deepseek-v3"  # (c'): each toy expert timed as one of this model's experts (toolkit.models.catalog)


def validate(cfg: dict, world_size: int) -> dict:
    cfg = resolve(cfg, PRESETS, PARAMS)
    require_ranks(world_size, 2, "cloning experts onto other ranks")
    require_divisible("n_expert", cfg["n_expert"], world_size, "world_size", "each rank owns n_expert/world_size experts")
    if cfg["top_k"] > cfg["n_expert"]:
        raise ValueError(f"top_k={cfg['top_k']} must be in 1..n_expert={cfg['n_expert']}")
    if len(set(cfg["budgets"])) < 2:
        raise ValueError(f"budgets={cfg['budgets']} needs at least 2 different clone budgets to compare")
    if cfg["tokens"] < 2:
        raise ValueError(f"tokens={cfg['tokens']} must be >= 2: the emulated timing also runs half as many")
    return cfg


def model_config(cfg: dict):
    return preset(cfg["model"], n_layer=cfg["n_layer"], n_expert=cfg["n_expert"], top_k=cfg["top_k"],
                  **({"d_ff": cfg["d_ff"]} if cfg["d_ff"] else {}))


class ZipfRouter(torch.nn.Module):
    """The layer's own gate, but the expert ids are given (Zipf draws): weights = the gate's softmax at those ids,
    renormalized, so the router still gets a gradient."""

    def __init__(self, gate: torch.nn.Module, ids: torch.Tensor):
        super().__init__()
        self.gate, self.ids = gate, ids

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = self.gate.gate(x).softmax(-1)
        w = probs.gather(1, self.ids.clamp(0, probs.shape[1] - 1))  # an id out of range is the dispatcher's to reject
        return w / w.sum(-1, keepdim=True), self.ids


def zipf_ids(cfg: dict, rank: int, tokens: int | None = None) -> torch.Tensor:
    return zipf_routing(tokens or cfg["tokens"], cfg["n_expert"], cfg["top_k"], cfg["zipf_s"],
                        seed=cfg["seed"] * 1000 + rank)


# ---- (a) the plan ----------------------------------------------------------------------------------------------------
def plan_section(ctx, cfg: dict) -> dict:
    R, E = ctx.world_size, cfg["n_expert"]
    mine = expert_counts(zipf_ids(cfg, ctx.rank), E)
    counts = torch.empty(R * E, dtype=mine.dtype)
    compat.all_gather_single(counts, mine)
    counts = counts.view(R, E)
    plan = plan_clones(counts, E // R, cfg["spare_slots"], None, cfg["min_tokens"])
    sweep = []
    for budget in range(R * cfg["spare_slots"] + 1):
        p = plan_clones(counts, E // R, cfg["spare_slots"], budget, cfg["min_tokens"])
        sweep.append({"budget": budget, "clones": len(p.clones), "ratio_after": p.ratio(p.load_after),
                      "max_rank_tokens": max(p.load_after)})
    return {"counts": counts.tolist(), "plan": plan.to_dict(), "invariants": check_plan(plan), "budget_sweep": sweep}


# ---- (b) one layer with and without cloning ----------------------------------------------------------------------------
def make_layers(cfg: dict, ctx, tokens: int | None = None
                ) -> tuple[torch.nn.Module, ExpertParallelMoE, ExpertParallelMoE, Echo]:
    """The tiny GPT's first MoE layer (the same weights on every rank): a reference copy holding every expert,
    the expert-parallel layer without spare slots, and one with ECHO (routing ``tokens`` per rank, default the
    config's)."""
    torch.manual_seed(cfg["seed"])
    moe = GPT(model_config(cfg)).blocks[0].mlp
    ids = zipf_ids(cfg, ctx.rank, tokens).to(ctx.device)
    plain = ExpertParallelMoE(copy.deepcopy(moe))
    cloned = ExpertParallelMoE(copy.deepcopy(moe), spare_slots=cfg["spare_slots"])
    for layer in (plain, cloned):
        layer.router = ZipfRouter(layer.router, ids)
    echo = Echo(cloned, min_tokens=cfg["min_tokens"])
    echo.phase = lambda name: ctx.ledger.tag(f"layer/{name}")
    return moe, plain, cloned, echo


def layer_tokens(cfg: dict, ctx, d_model: int, tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(cfg["seed"] * 1000 + 100 + ctx.rank)
    x = torch.randn(tokens or cfg["tokens"], d_model, generator=g)
    return x.to(ctx.device), torch.randn(tokens or cfg["tokens"], d_model, generator=g).to(ctx.device)


def layer_section(ctx, cfg: dict) -> dict:
    moe, plain, cloned, echo = make_layers(cfg, ctx)
    x, upstream = layer_tokens(cfg, ctx, moe.router.gate.in_features)
    out, grads = {}, {}
    for name, layer in (("plain", plain), ("echo", cloned)):
        xi = x.clone().requires_grad_(True)
        y = layer(xi[None])[0]
        (y * upstream).sum().backward()
        own = [p.grad.clone() for p in layer.experts.parameters()]
        if name == "echo":
            echo.reduce_grads()
        out[name], grads[name] = y.detach(), {"x": xi.grad, "router": layer.router.gate.gate.weight.grad,
                                              "experts": [p.grad for p in layer.experts.parameters()], "own": own}
    plan, dplan = echo.last_plan, cloned.last_plan
    close = lambda a, b: bool(torch.allclose(a, b, rtol=1e-5, atol=1e-6))
    # an expert's gradient is one sum over its tokens without cloning, home + clone partial sums with it: the float
    # rounding of that reassociation is relative to the gradient's scale, not to each element
    sum_close = lambda a, b: bool(torch.allclose(a, b, rtol=1e-5, atol=1e-6 * max(1.0, float(b.abs().max()))))
    exp_close = all(sum_close(a, b) for a, b in zip(grads["echo"]["experts"], grads["plain"]["experts"]))
    # home grad + Σ clone grads, by hand: this rank's experts' own grads plus the rows that came back
    local = cloned.local
    summed = [g.clone() for g in grads["echo"]["own"]]
    params = list(cloned.experts.parameters())
    per_expert = len(params) // local
    for c, g in zip(echo.sent_to, echo.clone_grads if echo.clone_grads is not None else []):
        offset = 0
        for j in range((c.expert % local) * per_expert, (c.expert % local + 1) * per_expert):
            n = params[j].numel()
            summed[j] = summed[j] + g[offset:offset + n].view_as(params[j])
            offset += n
    decomposition = all(sum_close(a, b) for a, b in zip(summed, grads["plain"]["experts"]))
    # tokens: per expert over home and clone slots (dispatcher counts) == the routed pairs
    spr = cloned.slots_per_rank
    slot_expert = {r * spr + j: r * local + j for r in range(ctx.world_size) for j in range(local)}
    slot_expert.update({c.rank * spr + c.slot: c.expert for c in plan.clones})
    per_slot = dplan.tokens_per_expert.tolist()
    per_expert = [0] * cfg["n_expert"]
    for s, n in enumerate(per_slot):
        if n:
            per_expert[slot_expert[s]] += n
    received = {name: torch.tensor(sum(layer.last_plan.recv_counts)) for name, layer in (("plain", plain), ("echo", cloned))}
    loads = {}
    for name, t in received.items():
        every = torch.empty(ctx.world_size, dtype=t.dtype)
        compat.all_gather_single(every, t.reshape(1))
        loads[name] = every.tolist()
    # the clones' weights, bitwise the home expert's (every rank holds the reference layer's weights)
    bitwise = all(torch.equal(row, flat_params(moe.experts[c.expert]))
                  for c, row in zip(echo._into, echo.received if echo.received is not None else []))
    P = expert_param_count(moe.router.gate.in_features, moe.experts[0].fc1.out_features)
    mine_out = sum(1 for c in plan.clones if c.expert // local == ctx.rank)
    return {"outputs_close": close(out["echo"], out["plain"]), "outputs_bitwise": torch.equal(out["echo"], out["plain"]),
            "outputs_max_abs_diff": float((out["echo"] - out["plain"]).abs().max()),
            "grad_x_close": close(grads["echo"]["x"], grads["plain"]["x"]),
            "grad_router_close": close(grads["echo"]["router"], grads["plain"]["router"]),
            "grad_experts_close": exp_close, "home_plus_clone_grads_equal_plain": decomposition,
            "grad_experts_max_abs_diff": max(float((a - b).abs().max()) for a, b in
                                             zip(grads["echo"]["experts"], grads["plain"]["experts"])),
            "grad_experts_max_abs": max(float(b.abs().max()) for b in grads["plain"]["experts"]),
            "clone_grad_norm": float(echo.clone_grads.norm()) if echo.clone_grads is not None and echo.clone_grads.numel() else 0.0,
            "own_grad_norm": float(torch.cat([g.reshape(-1) for g in grads["echo"]["own"]]).norm()),
            "per_expert_pairs": per_expert, "routed_per_expert": plan.load_per_expert,
            "rank_loads": loads, "planned_loads": {"plain": plan.load_before, "echo": plan.load_after},
            "clones_bitwise_home": bitwise, "clones_here": len(echo._into), "clones_sent": mine_out,
            "plan": plan.to_dict(), "invariants": check_plan(plan), "expert_params": P,
            "weight_bytes": {"ledger": ctx.ledger.total("sent_bytes", tag="layer/echo_weights"),
                             "grad_ledger": ctx.ledger.total("sent_bytes", tag="layer/echo_grads"),
                             "closed_form": mine_out * P * 4}}


# ---- (c) step time per clone budget, measured -------------------------------------------------------------------
def timing_section(ctx, cfg: dict) -> dict:
    """The layer's step per clone budget, side by side. Two clocks: wall time (the four ranks share this machine's
    cores, so it shows the total work more than the busiest rank) and each rank's own CPU time (``thread_time``
    of the main thread: its compute and copies, not its waiting), whose maximum over the ranks is what a step
    would take if every rank had its own processor (communication aside)."""
    import statistics
    import time
    moe, plain, cloned, echo = make_layers(cfg, ctx)
    x, upstream = layer_tokens(cfg, ctx, moe.router.gate.in_features)
    stats, cpu = {}, {b: [] for b in cfg["budgets"]}

    def candidate(budget: int):
        def step():
            c0 = time.thread_time()
            echo.max_clones = budget
            cloned.zero_grad(set_to_none=True)
            (cloned(x[None])[0] * upstream).sum().backward()
            echo.reduce_grads()
            cpu[budget].append(time.thread_time() - c0)
            stats[budget] = {"clones": len(echo.last_plan.clones), "max_rank_tokens": max(echo.last_plan.load_after),
                             "my_tokens": echo.last_plan.load_after[ctx.rank]}
        return step
    with ctx.ledger.tag("timing"):
        times = compare({str(b): candidate(b) for b in cfg["budgets"]}, warmup=cfg["warmup"], steps=cfg["bench_steps"],
                        rounds=cfg["rounds"], sync=ctx.barrier, on_round=lambda d, t: ctx.progress(d, t, "timing"))
    n = cfg["bench_steps"] * cfg["rounds"]
    rows = [{"budget": b, **stats[b], "wall_s": times[str(b)].mean_s, "cpu_s": statistics.median(cpu[b][-n:])}
            for b in cfg["budgets"]]
    every = torch.empty(ctx.world_size * len(rows), dtype=torch.float64)
    compat.all_gather_single(every, torch.tensor([r["cpu_s"] for r in rows], dtype=torch.float64))
    every = every.view(ctx.world_size, len(rows))
    for j, r in enumerate(rows):
        r["cpu_per_rank_s"] = every[:, j].tolist()
        r["busiest_cpu_s"] = max(r["cpu_per_rank_s"])
    return {"rows": rows}


# ---- (c') the clone budgets on the emulated cluster, and the cost model fitted there ------------------------------
def emulated_section(ctx, cfg: dict) -> dict | None:
    """The layer's training step per clone budget (every budget the slots allow), at ``tokens`` and half as many
    per rank (the busiest rank's pairs then move apart from the clone count), one step each on the emulated
    cluster's clock (deterministic). Matched to ``STANDS_FOR``'s experts, phase by phase: every op's FLOPs as a
    pair of its SwiGLU expert's (the router's GEMM too: a fixed cost, in C), token rows and the dispatch as its
    hidden size, each clone's weights out and gradient back as its expert's parameters, the count exchanges as
    they are. The cost model is fitted to the slowest rank's times; ``clone_break_even`` at the real size on both
    links of the cluster beside it (a formula, not a run)."""
    emu = ctx.emulator
    if emu is None:
        return None
    real, mc = catalog.get(STANDS_FOR), model_config(cfg)
    flops = expert_flops_per_pair(real.hidden, real.ffn, gated=True) / expert_flops_per_pair(mc.d_model, mc.d_ff)
    rows = real.hidden / mc.d_model
    weights = (expert_param_count(real.hidden, real.ffn, gated=True, bias=False)
               / expert_param_count(mc.d_model, mc.d_ff))
    byte_scale = {"echo_weights": weights, "echo_grads": weights, "echo_counts": 1.0, "routing": 1.0}
    phase = lambda name: emu.scaled(flops=flops, bytes=byte_scale.get(name, rows))  # noqa: E731
    budgets = list(range(ctx.world_size * cfg["spare_slots"] + 1))
    points = []
    for i, tokens in enumerate((cfg["tokens"], cfg["tokens"] // 2)):
        moe, plain, cloned, echo = make_layers(cfg, ctx, tokens)
        echo.phase = cloned.dispatcher.phase = phase
        x, upstream = layer_tokens(cfg, ctx, mc.d_model, tokens)
        for budget in budgets:
            echo.max_clones = budget
            cloned.zero_grad(set_to_none=True)
            ctx.barrier()  # clocks aligned, hosts synchronized
            t0 = emu.now()
            with emu.scaled(flops=flops, bytes=rows):
                (cloned(x[None])[0] * upstream).sum().backward()
                echo.reduce_grads()
            emu.synchronize()
            plan = echo.last_plan
            points.append({"tokens": tokens, "budget": budget, "clones": len(plan.clones),
                           "max_rank_tokens": max(plan.load_after), "my_step_s": emu.now() - t0})
        ctx.progress(i + 1, 2, "emulated")
    every = torch.empty(ctx.world_size * len(points), dtype=torch.float64)
    compat.all_gather_single(every, torch.tensor([p["my_step_s"] for p in points], dtype=torch.float64))
    for p, slowest in zip(points, every.view(ctx.world_size, -1).max(0).values.tolist()):
        p["step_s"] = slowest
    fit = fit_cost_model([p["max_rank_tokens"] for p in points], [p["clones"] for p in points],
                         [p["step_s"] for p in points])
    c = emu.cluster
    return {"cluster": c.name, "gpu": c.gpu.name, "link": c.link_between(list(range(ctx.world_size)),
                                                                          ctx.world_size).name,
            "stands_for": STANDS_FOR, "expert": {"hidden": real.hidden, "ffn": real.ffn, "top_k": real.top_k,
                                                 "seq_len": real.seq_len},
            "scales": {"flops": flops, "rows": rows, "weights": weights}, "points": points, "cost_model": fit,
            "break_even": {link.name: clone_break_even(real.hidden, real.ffn, link, c.gpu)
                           for link in (c.intra, c.inter)}}




# ---- (d) the routing the tiny MoE learns -------------------------------------------------------------------------------
def learned_section(ctx, cfg: dict) -> dict:
    torch.manual_seed(cfg["seed"])
    model = GPT(model_config(cfg))
    replicated, experts = expert_parallel(model, spare_slots=cfg["spare_slots"])
    echos = enable_echo(model, min_tokens=cfg["min_tokens"])
    params = list(model.parameters())  # plain SGD by hand: a torch.optim optimizer imports torch._dynamo (seconds)
    history = []
    data = batches(cfg["batch"], model.cfg.seq_len, cfg["steps"], seed=cfg["seed"] + 1, rank=ctx.rank,
                   world=ctx.world_size, device=ctx.device)
    for step, (x, y) in enumerate(data):
        model.zero_grad(set_to_none=True)
        loss = model(x, y)
        loss.backward()
        for e in echos:
            e.reduce_grads()
        average_gradients(replicated, experts, ctx.world_size)
        with torch.no_grad():
            for p in params:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-cfg["lr"])
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        history.append({"step": step, "loss": mean.item() / ctx.world_size,
                        "layers": [{"ratio_before": e.last_plan.ratio(e.last_plan.load_before),
                                    "ratio_after": e.last_plan.ratio(e.last_plan.load_after),
                                    "clones": len(e.last_plan.clones), "per_expert": e.last_plan.load_per_expert}
                                   for e in echos]})
        ctx.progress(step + 1, cfg["steps"], "train")
    return {"history": history, "invariants": [check_plan(e.last_plan) for e in echos]}


def run(ctx, cfg: dict) -> dict:
    import time
    out = {"rank": ctx.rank, "world_size": ctx.world_size, "config": cfg, "phase_s": {}}
    for name, section in (("plan", plan_section), ("layer", layer_section), ("timing", timing_section),
                          ("emulated", emulated_section), ("learned", learned_section)):
        t0 = time.perf_counter()
        with ctx.phase(name), ctx.paused(name != "emulated"):  # the real run only: no bookkeeping on every op
            out["zipf" if name == "plan" else name] = section(ctx, cfg)
        out["phase_s"][name] = time.perf_counter() - t0
    mc = model_config(cfg)
    out["model"] = {"d_model": mc.d_model, "d_ff": mc.d_ff, "n_layer": mc.n_layer, "n_expert": mc.n_expert,
                    "top_k": mc.top_k}
    return out
