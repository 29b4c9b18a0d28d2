"""Lesson 09 per-rank program: block-wise INT8 vs FP8-E4M3, measured.

The ranks split one grid of experiments and gather the rows, so every rank returns the whole table::

    tasks = [qsnr(data, fmt, block)      data  in gaussian, student_t3, outlier_channels,
                                                  gpt_weights, gpt_activations, gpt_act_grads, gpt_weight_grads
             gemm(case, fmt, block)      case  in gaussian, outlier_channels, gpt_fc1   (blocks along K)
             kappa()                     per-block QSNR vs kappa = amax / RMS of the block
             train(run)]                 tiny GPT, every block GEMM fake-quantized (bf16 | int8 | fp8 | int4;
                                         "bf16@1": bf16 with another seed, the run-to-run spread)
    rank r runs tasks[r::world]  ──►  all_gather_object  ──►  one table on every rank

Blocks are ``block`` consecutive elements along the last dimension (the reduction dimension of
the GEMM that consumes the tensor); block 0 stands for one scale per tensor. The real tensors come
from a tiny GPT trained for ``capture_steps`` steps in fp32, by the first rank with a training run fewer
(after its runs), and broadcast to the others.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from toolkit import quant as Q
from toolkit.data import batches
from toolkit.models.gpt import GPT, preset
from toolkit.runtime.config import Param, common, require_divisible, resolve

PARAMS = {**common("model", "n_layer", "seq_len", "batch", "steps", "lr", "seed"),
          "rows": Param(int, "rows of the synthetic tensors", ge=1),
          "channels": Param(int, "channels (the last dimension) of the synthetic tensors", ge=2),
          "outliers": Param(int, "outlier channels of the outlier_channels data", ge=1),
          "outlier_scale": Param(float, "how many times larger the outlier channels are", gt=0),
          "gemm": Param(list, "shape [M, K, N] of the GEMM-error cases", of=int, ge=1),
          "capture_steps": Param(int, "fp32 training steps before the real tensors are captured", ge=1),
          "kappa_blocks": Param(int, "blocks in the QSNR-vs-kappa scatter", ge=1),
          "train_block": Param(int, "block size of the fake-quantized training runs (even)", ge=2),
          "fmts": Param(list, "formats of the QSNR and GEMM sweeps", of=str, choices=tuple(Q.GEMM_FORMATS)),
          "blocks": Param(list, "block sizes of the sweeps (0 = one scale per tensor)", of=int, ge=0),
          "train_fmts": Param(list, "training runs: a format, optionally with '@<seed offset>' (e.g. 'bf16@1')",
                              of=str)}
_SWEEPS = dict(fmts=["int8", "fp8_e4m3"], blocks=[32, 64, 128, 256, 0],
               train_fmts=["bf16", "bf16@1", "int8", "fp8_e4m3", "int4"], seed=0)
PRESETS = {  # "model" names a toolkit.models preset, n_layer / seq_len override it
    "smoke": dict(model="smoke", n_layer=2, seq_len=32, rows=8, channels=4096, outliers=8, outlier_scale=50.0,
                  gemm=[64, 1024, 256], capture_steps=5, kappa_blocks=512, steps=20, batch=8, lr=3e-3,
                  train_block=32, **_SWEEPS),
    "default": dict(model="default", n_layer=2, seq_len=64, rows=128, channels=4096, outliers=8,
                    outlier_scale=50.0, gemm=[256, 4096, 1024], capture_steps=60, kappa_blocks=4096,
                    steps=48, batch=16, lr=2e-3, train_block=128, **_SWEEPS),
    "full": dict(model="default", n_layer=4, seq_len=128, rows=1024, channels=4096, outliers=8, outlier_scale=50.0,
                 gemm=[256, 4096, 4096], capture_steps=300, kappa_blocks=32768, steps=1000, batch=32, lr=1e-3,
                 train_block=128, **_SWEEPS),
}
DATASETS = ("gaussian", "student_t3", "outlier_channels", "gpt_weights", "gpt_activations", "gpt_act_grads",
            "gpt_weight_grads")
GEMM_CASES = ("gaussian", "outlier_channels", "gpt_fc1")
INT8_THEORY_DB = 10 * math.log10(12 * 127**2)  # 52.9: uniform rounding noise s^2/12 with s = amax/127
ARTICLE_INT8_DB, E4M3_THEORY_DB = 46.9, 31.5  # the course's first guesses at the INT8 and E4M3 lines


def validate(cfg: dict, world_size: int) -> dict:
    cfg = resolve(cfg, PRESETS, PARAMS)
    bad = [f for f in cfg["train_fmts"] if not _is_run(f, seeded=True)]
    if bad:
        raise ValueError(f"train_fmts has {bad}: allowed are the formats {list(Q.GEMM_FORMATS)}, each optionally "
                         'with "@<seed offset>" (e.g. "bf16@1")')
    if len(cfg["gemm"]) != 3:
        raise ValueError(f"gemm={cfg['gemm']!r} must be three sizes [M, K, N]")
    require_divisible("train_block", cfg["train_block"], 2, "2", "int4 packs two codes a byte")
    if not cfg["outliers"] < cfg["channels"]:
        raise ValueError(f"outliers={cfg['outliers']} must be in 1..channels-1={cfg['channels'] - 1}")
    longest = preset(cfg["model"]).seq_len
    if cfg["seq_len"] > longest:
        raise ValueError(f"seq_len={cfg['seq_len']} exceeds the {cfg['model']} model's {longest}")
    return cfg


def _is_run(name: str, seeded: bool) -> bool:
    fmt, at, offset = name.partition("@")
    return fmt in Q.GEMM_FORMATS and (not at or (seeded and offset.isdigit()))


def model_config(cfg: dict):
    return preset(cfg["model"], n_layer=cfg["n_layer"], seq_len=cfg["seq_len"])


# ---- data ---------------------------------------------------------------------------------------------------
def synthetic(name: str, cfg: dict, gen: torch.Generator) -> torch.Tensor:
    """[rows, channels] float32: Gaussian, Student-t(3), or Gaussian with a few channels x outlier_scale."""
    shape = (cfg["rows"], cfg["channels"])
    if name == "gaussian":
        return torch.randn(shape, generator=gen)
    if name == "student_t3":  # t(3) = z / sqrt(chi2_3 / 3)
        z, chi2 = torch.randn(shape, generator=gen), torch.randn((3, *shape), generator=gen).pow(2).sum(0)
        return z / (chi2 / 3).sqrt()
    if name == "outlier_channels":
        x = torch.randn(shape, generator=gen)
        ch = torch.randperm(cfg["channels"], generator=gen)[:cfg["outliers"]]
        x[:, ch] *= cfg["outlier_scale"]
        return x
    raise ValueError(name)


def capture_gpt_tensors(cfg: dict) -> dict[str, list[torch.Tensor]]:
    """Train the tiny GPT ``capture_steps`` steps (fp32), then one forward/backward with hooks on every
    Linear of the blocks: weights [N,K], inputs [M,K], output grads [M,N], weight grads [N,K]."""
    torch.manual_seed(cfg["seed"])
    model = GPT(model_config(cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"])
    data = batches(cfg["batch"], model.cfg.seq_len, cfg["capture_steps"] + 1, seed=cfg["seed"] + 1)
    for _ in range(cfg["capture_steps"]):
        x, y = next(data)
        opt.zero_grad(set_to_none=True)
        model(x, y).backward()
        opt.step()
    out = {"gpt_weights": [], "gpt_activations": [], "gpt_act_grads": [], "gpt_weight_grads": [], "names": []}
    linears = [(n, m) for n, m in model.blocks.named_modules() if isinstance(m, torch.nn.Linear)]
    hooks = []
    for name, lin in linears:
        out["names"].append(name)
        hooks.append(lin.register_forward_hook(
            lambda m, i, o: out["gpt_activations"].append(i[0].detach().reshape(-1, i[0].shape[-1]))))
        hooks.append(lin.register_full_backward_hook(
            lambda m, gi, go: out["gpt_act_grads"].append(go[0].detach().reshape(-1, go[0].shape[-1]))))
    x, y = next(data)
    opt.zero_grad(set_to_none=True)
    model(x, y).backward()
    for h in hooks:
        h.remove()
    out["gpt_act_grads"].reverse()  # backward visits the layers last to first
    out["gpt_weights"] = [lin.weight.detach().clone() for _, lin in linears]
    out["gpt_weight_grads"] = [lin.weight.grad.detach().clone() for _, lin in linears]
    return out


# ---- measurements -------------------------------------------------------------------------------------------
def pooled_qsnr(tensors: list[torch.Tensor], fmt: str, block: int) -> float:
    """QSNR over a list of 2-D tensors, each fake-quantized on its own with blocks along its last dim."""
    signal = noise = 0.0
    for t in tensors:
        t = t.float()
        err = t - Q.fake_quantize_rows(t, fmt, block)
        signal += float(t.double().pow(2).sum())
        noise += float(err.double().pow(2).sum())
    return 10 * math.log10(signal / noise) if noise > 0 else math.inf


def block_kappa(t: torch.Tensor, block: int) -> torch.Tensor:
    """kappa = amax / RMS of every block of ``block`` elements along the last dim (padding excluded; zero blocks
    dropped). sqrt(block) is its maximum: one non-zero element."""
    t = t.float()
    pad = (-t.shape[-1]) % block
    b = torch.nn.functional.pad(t, (0, pad), value=float("nan")).reshape(-1, block)
    rms = b.pow(2).nanmean(1).sqrt()
    amax = b.nan_to_num(0.0).abs().amax(1)
    keep = rms > 0
    return amax[keep] / rms[keep]


def gemm_qsnr(x: torch.Tensor, w: torch.Tensor, fmt: str, block: int, exact: torch.Tensor) -> float:
    """QSNR of Y = X W^T (each output an inner product over K) when X [M,K] and W [N,K] are quantized along K.

    ``exact`` is X W^T in float64; the quantized product runs in float32 (its rounding, ~1e-7, is far below
    the quantization error)."""
    approx = Q.fake_quantize_rows(x, fmt, block) @ Q.fake_quantize_rows(w, fmt, block).t()
    return Q.qsnr_db(exact, approx)


def kappa_sweep(cfg: dict, gen: torch.Generator, block: int = 128, bins: int = 14) -> dict:
    """Per-block QSNR of INT8 and FP8 against kappa = amax/RMS of the block, binned on a log scale.

    Blocks: Gaussian with one element scaled by a factor from 1 to 100 (sweeps kappa from ~2.5 up to
    its maximum sqrt(block)), plus Student-t(3) blocks.
    """
    n = cfg["kappa_blocks"]
    x = torch.randn(n, block, generator=gen)
    x[:, 0] *= torch.logspace(0, 2, n)
    t3 = synthetic("student_t3", {**cfg, "rows": n // 4 or 1, "channels": block}, gen)
    x = torch.cat([x, t3])  # [nb, block]
    kappa = x.abs().amax(1) / x.pow(2).mean(1).sqrt()
    edges = torch.logspace(math.log10(float(kappa.min())), math.log10(float(kappa.max()) * 1.0001), bins + 1)
    which = torch.bucketize(kappa, edges) - 1
    out = {"kappa": [], "count": []}
    per_block = {}
    for fmt in ("int8", "fp8_e4m3"):
        err = (x - Q.fake_quantize_rows(x, fmt, block)).pow(2).sum(1)
        per_block[fmt] = 10 * torch.log10(x.pow(2).sum(1) / err)
        out[fmt] = []
    for b in range(bins):
        m = which == b
        if int(m.sum()) == 0:
            continue
        out["kappa"].append(float(kappa[m].mean()))
        out["count"].append(int(m.sum()))
        for fmt in ("int8", "fp8_e4m3"):
            out[fmt].append(float(per_block[fmt][m].mean()))
    k = torch.tensor(out["kappa"])
    out["int8_theory"] = (INT8_THEORY_DB - 20 * torch.log10(k)).tolist()
    out["int8_article"] = (ARTICLE_INT8_DB - 20 * torch.log10(k)).tolist()
    out["e4m3_theory"] = [E4M3_THEORY_DB] * len(out["kappa"])
    # residual of the measured INT8 curve from each line (mean over bins, dB)
    out["int8_minus_theory_db"] = float((torch.tensor(out["int8"]) - torch.tensor(out["int8_theory"])).mean())
    out["int8_minus_article_db"] = float((torch.tensor(out["int8"]) - torch.tensor(out["int8_article"])).mean())
    diff = torch.tensor(out["int8"]) - torch.tensor(out["fp8_e4m3"])
    cross = (diff[:-1] > 0) & (diff[1:] <= 0)
    out["crossover_kappa"] = None
    if bool(cross.any()):  # linear interpolation of the sign change in log-kappa
        i = int(cross.nonzero()[0])
        lk0, lk1 = math.log(out["kappa"][i]), math.log(out["kappa"][i + 1])
        out["crossover_kappa"] = math.exp(lk0 + (lk1 - lk0) * float(diff[i] / (diff[i] - diff[i + 1])))
    return out


def train_run(cfg: dict, run: str, progress=None) -> dict:
    """Train the tiny GPT with every GEMM of its blocks fake-quantized (the head stays fp32).

    ``run`` is a format, optionally "@<offset>" to shift the seed of init and data order ("bf16@1" is a second
    bf16 run: its distance to "bf16" is the run-to-run spread the other formats are judged against)."""
    fmt, _, offset = run.partition("@")
    seed = cfg["seed"] + int(offset or 0)
    torch.manual_seed(seed)
    model = GPT(model_config(cfg))
    replaced = Q.quantize_gemms(model, fmt, cfg["train_block"])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"])
    losses = []
    for step, (x, y) in enumerate(batches(cfg["batch"], model.cfg.seq_len, cfg["steps"], seed=seed + 2)):
        opt.zero_grad(set_to_none=True)
        loss = model(x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if progress:
            progress(step + 1)
    with torch.no_grad():
        evals = [model(x, y).item() for x, y in batches(cfg["batch"], model.cfg.seq_len, 4, seed=10_000)]
    return {"fmt": run, "losses": losses, "eval_loss": sum(evals) / len(evals), "quantized_linears": replaced}


def _tasks(cfg: dict) -> list[tuple]:
    tasks = [("train", f) for f in cfg["train_fmts"]]  # the heavy ones first, spread over ranks
    tasks += [("qsnr", d, f, b) for d in DATASETS for f in cfg["fmts"] for b in cfg["blocks"]]
    tasks += [("gemm", c, f, b) for c in GEMM_CASES for f in cfg["fmts"] for b in cfg["blocks"]]
    return tasks + [("kappa",)]


def run(ctx, cfg: dict) -> dict:
    tasks = _tasks(cfg)
    mine = tasks[ctx.rank::ctx.world_size]
    trains, others = [t for t in mine if t[0] == "train"], [t for t in mine if t[0] != "train"]
    total = sum(cfg["steps"] if t[0] == "train" else 1 for t in mine)
    done = 0
    rows, curves, kappa, exact = [], [], None, {}
    for task in trains:  # the heavy tasks first
        curves.append(train_run(cfg, task[1], lambda s, d=done: ctx.progress(d + s, total, f"train {task[1]}")))
        done += cfg["steps"]
    # the real tensors: one rank trains the capture model while the others finish their longer share of runs
    # (the first rank with a run fewer), and every rank receives them
    capture_rank = sum(t[0] == "train" for t in tasks) % ctx.world_size
    captured = [capture_gpt_tensors(cfg) if ctx.rank == capture_rank else None]
    dist.broadcast_object_list(captured, src=capture_rank)
    captured = captured[0]
    gen = torch.Generator().manual_seed(cfg["seed"])
    data = {name: [synthetic(name, cfg, gen)] for name in DATASETS[:3]}  # same on every rank (same seed)
    data.update({k: v for k, v in captured.items() if k.startswith("gpt_")})
    m, k, n = cfg["gemm"]
    fc1 = captured["names"].index("0.mlp.fc1")
    gemm_ops = {"gaussian": (torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)),
                "outlier_channels": (synthetic("outlier_channels", {**cfg, "rows": m, "channels": k}, gen),
                                     torch.randn(n, k, generator=gen)),
                "gpt_fc1": (captured["gpt_activations"][fc1], captured["gpt_weights"][fc1])}
    kappa_gen = torch.Generator().manual_seed(cfg["seed"] + 3)
    for task in others:
        if task[0] == "qsnr":
            _, name, fmt, block = task
            rows.append({"kind": "tensor", "data": name, "fmt": fmt, "block": block,
                         "qsnr_db": pooled_qsnr(data[name], fmt, block)})
        elif task[0] == "gemm":
            _, case, fmt, block = task
            if case not in exact:
                exact[case] = gemm_ops[case][0].double() @ gemm_ops[case][1].double().t()
            rows.append({"kind": "gemm", "data": case, "fmt": fmt, "block": block,
                         "qsnr_db": gemm_qsnr(*gemm_ops[case], fmt, block, exact[case])})
        else:
            kappa = kappa_sweep(cfg, kappa_gen)
        done += 1
        ctx.progress(done, total, task[0])
    kappa_by_data = {name: float(torch.cat([block_kappa(t, 128) for t in data[name]]).median()) for name in DATASETS}
    gathered = [None] * ctx.world_size
    dist.all_gather_object(gathered, {"rows": rows, "curves": curves, "kappa": kappa, "tasks": len(mine)})
    return {"rows": [r for g in gathered for r in g["rows"]],
            "curves": {c["fmt"]: c for g in gathered for c in g["curves"]},
            "kappa": next(g["kappa"] for g in gathered if g["kappa"] is not None),
            "median_kappa_block128": kappa_by_data,
            "tasks_per_rank": [g["tasks"] for g in gathered],
            "theory": {"int8_db_at_kappa_1": INT8_THEORY_DB, "article_int8_db_at_kappa_1": ARTICLE_INT8_DB,
                       "e4m3_db": E4M3_THEORY_DB},
            "config": {k: cfg[k] for k in ("preset", "model", "n_layer", "seq_len", "rows", "channels", "gemm", "train_block",
                                          "steps", "blocks", "fmts", "train_fmts")}}
