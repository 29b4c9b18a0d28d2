"""Lesson 04 per-rank program: MoE token dispatch through a real all-to-all, bf16 vs int8 vs int4.

Every rank runs three phases::

    1. invariants   int8 payload bitwise identical after the all-to-all; mode "none" == plain all_to_all_single;
                    all-zero tokens; expert-parallel MoE == the model's local MoE on the same tokens
    2. wire         the same tokens and splits sent in every mode (tag "wire/<mode>"): bytes from the ledger,
                    SNR of what arrives (Gaussian, outlier-channel and real MoE-input tokens)
    3. train        a tiny MoE GPT, expert parallel (rank r owns n_expert/world experts), once per dispatch mode;
                    the ledger tags split routing / dispatch / combine / backward bytes

Tokens reach experts through ``toolkit.moe`` (the project's one dispatcher; its codec is the wire format of
``toolkit.comm.quant_a2a``). The combine and every backward all-to-all stay in fp32; only the forward
dispatch is quantized. "routing" is the dispatcher's all-gather of per-expert counts.
"""
from __future__ import annotations


import torch
import torch.distributed as dist

from toolkit import quant as Q
from toolkit.comm.quant_a2a import MODES, all_to_all_quantized, encode, wire_bytes_per_token
from toolkit.moe import Codec, ExpertParallelMoE, all_to_all, expert_parallel
from toolkit.data import batches
from toolkit.models.gpt import GPT, preset
from toolkit.runtime.config import Param, common, require_divisible, require_ranks, resolve

PARAMS = {
    **common("model", "n_layer", "seq_len", "steps", "batch", "lr", "seed", "n_expert", "top_k"),
    "d_model": Param(int, "hidden size (the width of a dispatched token)", ge=1),
    "d_ff": Param(int, "inner size of each expert MLP", ge=1),
    "n_head": Param(int, "attention heads", ge=1),
    "wire_tokens": Param(int, "tokens per rank sent in the bytes/SNR sweep", ge=1),
    "block": Param(int, "channels per fp32 scale (even, divides d_model)", ge=2),
    "train_modes": Param(list, 'dispatch modes to train with, "<mode>@<seed offset>" for another seed; '
                               'None: bf16, int8, int4 (+ bf16@1 above smoke)', of=str, nullable=True),
    "wire_modes": Param(list, "dispatch modes of the bytes/SNR sweep", of=str, choices=MODES),
    "outlier_channels": Param(int, "channels scaled up in the outlier-channel tokens", ge=0),
    "outlier_scale": Param(float, "factor of the outlier channels", gt=0),
}
_SHARED = dict(block=128, train_modes=None, wire_modes=["none", "bf16", "int8", "int4"], outlier_channels=4,
               outlier_scale=50.0, seed=0)
PRESETS = {  # sizes: a "model" preset of toolkit.models with these fields overridden
    "smoke": dict(model="smoke", d_model=128, d_ff=256, n_head=2, n_layer=2, seq_len=32, n_expert=4, top_k=2,
                  steps=20, batch=4, lr=3e-3, wire_tokens=256, **_SHARED),
    "default": dict(model="default", d_model=256, d_ff=512, n_head=4, n_layer=2, seq_len=64, n_expert=8, top_k=2,
                    steps=24, batch=8, lr=2e-3, wire_tokens=1024, **_SHARED),  # 2 ranks x 8 sequences a step
    "full": dict(model="full", d_model=768, d_ff=3072, n_head=12, n_layer=12, seq_len=1024, n_expert=16, top_k=2,
                 steps=1000, batch=8, lr=6e-4, wire_tokens=8192, **_SHARED),
}


def validate(cfg: dict, world_size: int) -> dict:
    out = resolve(cfg, PRESETS, PARAMS)
    if out["train_modes"] is None:  # "bf16@1" (another seed) measures the run-to-run spread; skipped at smoke
        out["train_modes"] = ["bf16", "int8", "int4"] if out["preset"] == "smoke" else ["bf16", "bf16@1", "int8", "int4"]
    bad = [m for m in out["train_modes"] if m.partition("@")[0] not in MODES
           or (m.partition("@")[1] and not m.partition("@")[2].isdigit())]
    if bad:
        raise ValueError(f"train_modes={out['train_modes']!r}: {bad} not allowed; allowed modes are {MODES}, "
                         'optionally with "@<seed offset>", e.g. "bf16@1"')
    require_ranks(world_size, 2, "an all-to-all lesson")
    require_divisible("n_expert", out["n_expert"], world_size, "world_size", "each rank owns n_expert/world experts")
    if out["block"] % 2:
        raise ValueError(f"block={out['block']} must be even (int4 packs two codes per byte)")
    if out["d_model"] % out["block"]:
        raise ValueError(f"block={out['block']} must divide the hidden size d_model={out['d_model']} "
                         "(one fp32 scale per token per block of channels)")
    if out["top_k"] > out["n_expert"]:
        raise ValueError(f"top_k={out['top_k']} must be in 1..n_expert={out['n_expert']}")
    if out["outlier_channels"] >= out["d_model"]:
        raise ValueError(f"outlier_channels={out['outlier_channels']} must be in 0..d_model-1")
    return out


def model_config(cfg: dict):
    return preset(cfg["model"], **{k: cfg[k] for k in ("d_model", "d_ff", "n_head", "n_layer", "seq_len",
                                                        "n_expert", "top_k")})


def even_splits(n: int, world: int) -> list[int]:
    return [n // world + (r < n % world) for r in range(world)]


# ---- 1. invariants ------------------------------------------------------------------------------------------
def invariants(ctx, cfg: dict) -> dict:
    """Checks of the technique on real collectives; every rank returns the same booleans for its own side."""
    h, block, world, rank = cfg["d_model"], cfg["block"], ctx.world_size, ctx.rank
    tokens = lambda r: torch.randn(3 * world + r, h, generator=torch.Generator().manual_seed(100 + r))
    splits_of = lambda r: even_splits(3 * world + r, world)  # rank r sends splits_of(r)[j] rows to rank j
    x = tokens(rank)
    in_splits = splits_of(rank)
    out_splits = [splits_of(src)[rank] for src in range(world)]
    res = {}
    # (a) the int8 wire rows arrive bit for bit as their sender encoded them
    wire = encode(x, "int8", block)
    got = wire.new_empty((sum(out_splits), wire.shape[1]))
    dist.all_to_all_single(got, wire, out_splits, in_splits)
    expected = torch.cat([encode(tokens(src), "int8", block).split(splits_of(src))[rank] for src in range(world)])
    res["int8_payload_bitwise"] = torch.equal(got, expected)
    # (b) quantization switched off == the plain collective, bitwise
    plain = x.new_empty((sum(out_splits), h))
    dist.all_to_all_single(plain, x, out_splits, in_splits)
    res["off_equals_plain_bitwise"] = torch.equal(all_to_all_quantized(x, in_splits, out_splits, "none"), plain)
    # dequantized int8 is within half a step of what was sent
    recv = all_to_all_quantized(x, in_splits, out_splits, "int8", block)
    scales = got[:, h:].contiguous().view(torch.float32)  # [R, H/block]
    res["int8_error_within_half_step"] = bool(((recv - plain).abs() <= scales.repeat_interleave(block, 1) / 2
                                               * (1 + 1e-6)).all())
    # (c) all-zero tokens: zero scales, zeros out, no NaN
    z = torch.zeros(2 * world, h)
    zr = all_to_all_quantized(z, [2] * world, [2] * world, "int8", block)
    zr4 = all_to_all_quantized(z, [2] * world, [2] * world, "int4", block)
    res["zero_tokens_ok"] = bool(torch.equal(zr, torch.zeros_like(zr)) and torch.equal(zr4, torch.zeros_like(zr4)))
    # (d) the expert-parallel MoE with dispatch off == the model's own MoE holding every expert
    torch.manual_seed(cfg["seed"])
    moe = GPT(model_config(cfg)).blocks[0].mlp
    hidden = torch.randn(2, 5, h, generator=torch.Generator().manual_seed(200 + rank))
    ep = ExpertParallelMoE(moe, codec="none")
    with torch.no_grad():
        res["ep_matches_local_moe_max_abs"] = float((ep(hidden) - moe(hidden)).abs().max())
    # (e) every token routed to rank 0's experts: the other ranks receive nothing and still run the same
    #     backward collectives (a rank whose graph skipped them would deadlock the job)
    ep = ExpertParallelMoE(moe, codec="int8", block=block)
    ep.router = _FixedRouter(cfg["top_k"])
    hidden.requires_grad_(True)
    ep(hidden).sum().backward()
    res["empty_rank_backward_ok"] = bool(torch.isfinite(hidden.grad).all())
    return res


class _FixedRouter(torch.nn.Module):
    """Routes every token to experts 0..k-1 with equal weights (all on rank 0)."""

    def __init__(self, k: int):
        super().__init__()
        self.k = k

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = x.shape[0]
        return torch.full((n, self.k), 1.0 / self.k), torch.arange(self.k).expand(n, self.k)


def bad_inputs(ctx, cfg: dict) -> dict:
    """Each scenario is wrong on one rank only; every rank must raise the same clear ValueError (no hang)."""
    h, world, rank = cfg["d_model"], ctx.world_size, ctx.rank
    splits = [1] * world
    x = torch.randn(world, h)
    bad_x = x.clone()
    bad_x[0, 3] = float("nan")
    scenarios = {
        "ranks_disagree_on_bits": lambda: all_to_all_quantized(x, splits, splits, "int4" if rank == 1 else "int8"),
        "ranks_disagree_on_block": lambda: all_to_all_quantized(x, splits, splits, "int8", 64 if rank == 1 else 128),
        "nan_on_one_rank": lambda: all_to_all_quantized(bad_x if rank == 1 else x, splits, splits, "int8"),
        "unsupported_dtype": lambda: all_to_all_quantized(x.double() if rank == 1 else x, splits, splits, "int8"),
        "unknown_mode": lambda: all_to_all_quantized(x, splits, splits, "fp4" if rank == 1 else "int8"),
        "block_does_not_divide_hidden": lambda: all_to_all_quantized(x, splits, splits, "int8", h - 2),
    }
    return collect_errors(scenarios)


def collect_errors(scenarios: dict) -> dict:
    """Run each scenario; its ValueError message (or None). Ends with a barrier: if every rank gets here, the
    collectives stayed matched (no rank hangs in one its peers skipped)."""
    out = {}
    for name, fn in scenarios.items():
        try:
            fn()
            out[name] = None
        except ValueError as exc:
            out[name] = str(exc)
    dist.barrier()
    return out


# ---- 2. bytes and SNR on the wire -----------------------------------------------------------------------------
def wire_sweep(ctx, cfg: dict, moe_input: torch.Tensor) -> dict:
    """Send the same tokens with the same splits in every mode; ledger bytes + SNR at the receiver."""
    h, world = cfg["d_model"], ctx.world_size
    gen = torch.Generator().manual_seed(300 + ctx.rank)
    n = cfg["wire_tokens"]
    outlier = torch.randn(n, h, generator=gen)
    outlier[:, torch.randperm(h, generator=torch.Generator().manual_seed(7))[:cfg["outlier_channels"]]] *= \
        cfg["outlier_scale"]
    data = {"gaussian": torch.randn(n, h, generator=gen), "outlier_channels": outlier,
            "moe_input": moe_input[:n]}
    rows, sent = [], {}
    for name, x in data.items():
        splits = even_splits(x.shape[0], world)  # the same count both ways keeps splits simple
        exact = all_to_all(x, splits, splits)
        for mode in cfg["wire_modes"]:
            with ctx.ledger.tag(f"wire/{name}/{mode}"):
                got = all_to_all(x, splits, splits, codec=Codec(mode, cfg["block"]))
            rows.append({"data": name, "mode": mode, "snr_db": Q.qsnr_db(exact, got),
                         "sent_bytes": ctx.ledger.total("sent_bytes", tag=f"wire/{name}/{mode}"),
                         "tokens_sent": x.shape[0] - splits[ctx.rank]})
        if name == "gaussian":
            sent = {m: next(r["sent_bytes"] for r in rows if r["data"] == name and r["mode"] == m)
                    for m in cfg["wire_modes"]}
    return {"rows": rows, "sent_bytes": sent,
            "bytes_per_token_formula": {m: wire_bytes_per_token(m, h, cfg["block"]) for m in cfg["wire_modes"]}}


# ---- 3. expert-parallel training ----------------------------------------------------------------------------
def train(ctx, cfg: dict, run: str, capture: bool = False, first_step: int = 0, all_steps: int | None = None) -> dict:
    """One training run; ``run`` is a dispatch mode, optionally "@<offset>" to shift the seed of init and data
    ("bf16@1": a second bf16 run, whose distance to "bf16" is the run-to-run spread). Progress counts its steps
    from ``first_step`` of ``all_steps`` (the steps of every run of the launch: one bar that never restarts)."""
    mode, _, offset = run.partition("@")
    seed = cfg["seed"] + int(offset or 0)
    torch.manual_seed(seed)  # identical init on every rank; each keeps only its experts
    model = GPT(model_config(cfg))
    replicated, experts = expert_parallel(model, codec=mode, block=cfg["block"])
    for moe in model.modules():
        if isinstance(moe, ExpertParallelMoE):  # attribute its collectives to ledger tags
            moe.phase = lambda name: ctx.ledger.tag(f"train/{run}/{name}")
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"])
    captured = []
    if capture:  # the tokens the first MoE layer dispatches at the last step (for the wire sweep)
        moe0 = next(m for m in model.modules() if isinstance(m, ExpertParallelMoE))
        moe0.register_forward_pre_hook(lambda m, a: captured.__setitem__(slice(None), [a[0].detach()]))
    losses = []
    data = batches(cfg["batch"], model.cfg.seq_len, cfg["steps"], seed=seed + 1, rank=ctx.rank,
                   world=ctx.world_size)
    for step, (x, y) in enumerate(data):
        opt.zero_grad(set_to_none=True)
        loss = model(x, y)
        with ctx.ledger.tag(f"train/{run}/backward"):
            loss.backward()
        with ctx.ledger.tag(f"train/{run}/grad_allreduce"):
            average_gradients(replicated, experts, ctx.world_size)
        opt.step()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        losses.append(mean_loss.item() / ctx.world_size)
        ctx.progress(first_step + step + 1, all_steps or cfg["steps"], f"train {run}")
    sent = {phase: ctx.ledger.total("sent_bytes", tag=f"train/{run}/{phase}") / cfg["steps"]
            for phase in ("routing", "dispatch", "combine", "backward", "grad_allreduce")}
    return {"mode": run, "losses": losses, "sent_bytes_per_step": sent,
            "moe_input": captured[0].reshape(-1, cfg["d_model"]) if captured else None}


def average_gradients(replicated: list, experts: list, world: int) -> None:
    """Data-parallel mean of the replicated params' grads (one flat all-reduce); the experts' grads already
    sum every rank's tokens, so they are divided by the world size to match the mean loss."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in replicated]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= world
    for p, g in zip(replicated, flat.split([q.numel() for q in replicated])):
        p.grad = g.view_as(p)
    for p in experts:
        if p.grad is not None:
            p.grad /= world


def run(ctx, cfg: dict) -> dict:
    inv = invariants(ctx, cfg)
    curves, moe_input = {}, None
    steps, modes = cfg["steps"], cfg["train_modes"]
    for i, mode in enumerate(modes):
        out = train(ctx, cfg, mode, capture=(i == 0), first_step=i * steps, all_steps=len(modes) * steps)
        moe_input = out.pop("moe_input") if i == 0 else moe_input
        curves[mode] = out
    wire = wire_sweep(ctx, cfg, moe_input)
    ledger = ctx.ledger.summary(by=("tag", "op"))
    return {"invariants": inv, "wire": wire, "curves": curves, "ledger": ledger,
            "config": {k: cfg[k] for k in ("preset", "d_model", "n_expert", "top_k", "block", "steps", "batch",
                                          "train_modes", "wire_modes")},
            "world_size": ctx.world_size, "n_local_experts": cfg["n_expert"] // ctx.world_size,
            "tokens_per_rank_step": cfg["batch"] * model_config(cfg).seq_len}
