"""Whole training steps against published training throughput: the last table of ``data/published/``.

The kernel rates of a preset (``toolkit.runtime.efficiency``) are fitted to benchmarks of one kernel at a time.
A training step reaches less: a published run's MFU is its model FLOPs per second over the datasheet peak, and
the kernels of the same step, each at its isolated rate, would reach more. Their quotient is ``Efficiency.step``::

    published run (model, GPU, seq, micro-batch, checkpointing, tokens/s per GPU)
        published MFU = tokens/s · FLOPs per token / peak
        kernel MFU    = the same FLOPs over catalog.train_seconds at isolated rates (step = 1)
        step          = median over the runs of one GPU of  published MFU / kernel MFU       (``fit_step``)
        check         : kernel MFU · step  within ±35 % of the published MFU, every run       (``checks``)

The checked runs are MosaicML llm-foundry's benchmark table (PyTorch FSDP, bf16, 8-512 GPUs, sequences of
512-65 536 tokens, with and without activation checkpointing), the one table that states every setting a step's
time depends on. The fit folds in what the cost models also time on their own where a lesson runs them
(FSDP's exposed all-gathers, the optimizer): in these runs they are a small share of a step.

``python -m toolkit.models.throughput`` prints the fit and the worst runs.
"""
from __future__ import annotations

import dataclasses
import statistics

from toolkit.runtime.calibration import Check, load, preset_for
from toolkit.runtime.cluster import cluster

from .catalog import ModelSpec, gpt, train_seconds

MPT_SOURCE = "MosaicML llm-foundry scripts/train/yamls/pretrain/mpt-*.yaml (d_model, n_heads, n_layers; vocab 50368)"
MPT_SHAPES = {"125m": (12, 768, 12), "350m": (24, 1024, 16), "760m": (24, 1536, 12), "1b": (24, 2048, 16),
              "3b": (32, 2560, 20), "7b": (32, 4096, 32), "13b": (40, 5120, 40), "30b": (48, 7168, 56),
              "70b": (80, 8192, 64)}
"""(layers, hidden, heads) of the MPT models of llm-foundry's benchmark table: plain GELU MLPs of 4·hidden."""
BOUND = 0.35
"""Allowed |model / published − 1| of a whole step: the fitted runs' own spread around their median."""


def _model(name: str, seq_len: int) -> ModelSpec | None:
    size = name.removeprefix("MPT-")
    if not name.startswith("MPT-") or size not in MPT_SHAPES:
        return None
    layers, hidden, heads = MPT_SHAPES[size]
    return dataclasses.replace(gpt(name, layers, hidden, 50368, seq_len, heads=heads), source=MPT_SOURCE)


def _hardware(text: str) -> tuple[str | None, str]:
    """A row's hardware as a preset: the 80 GB SXM cards (the 40 GB A100's HBM is slower than the preset's)."""
    base, _, memory = text.partition(" (")
    if base in ("A100-SXM", "H100-SXM") and memory.startswith("80"):
        return preset_for(base, "training")
    return None, f"{text}: no preset describes this card"


def _runs() -> list[tuple[int, dict, str | None, str, ModelSpec | None]]:
    """Every training row with its preset, the reason it is not a check, and its model."""
    out = []
    for i, r in enumerate(load("training")):
        preset, reason = _hardware(r["hardware"])
        seq = int(r["seq_len"]) if r["seq_len"] else 0
        spec = _model(r["model"], seq) if seq else None
        if not reason and "bf16" not in r["precision"].lower() or "fp8" in r["precision"].lower():
            reason = reason or f"{r['precision']}: the presets time bf16 kernels"
        if not reason and spec is None:
            reason = "a model whose shapes the table does not give (its source names a config this check lacks)"
        if not reason and (int(r["pp"] or 1) > 1 or int(r["tp"] or 1) > 1):
            reason = "tensor or pipeline parallel: the check times one GPU's whole model"
        if not reason and not r["tokens_per_s_per_gpu"]:
            reason = "no tokens/s per GPU"
        out.append((i, r, preset, reason, spec))
    return out


def _mfus(r: dict, preset: str, spec: ModelSpec, isolated: bool = False) -> tuple[float, float]:
    """(published MFU, model MFU) of a row: the model at the preset's ``step``, or its kernels alone
    (``isolated``: ``Cluster.isolated``)."""
    c = cluster(preset)
    gpu = (c.isolated() if isolated else c).gpu
    seq = spec.seq_len
    recompute = r["activation_ckpt"].strip().lower() in ("true", "yes", "full")
    model = train_seconds(spec, gpu, int(r["micro_batch"]), seq, recompute=recompute)["mfu"]
    published = float(r["tokens_per_s_per_gpu"]) * spec.flops_per_token(seq) / gpu.bf16_flops
    return published, model


def fit_step(preset: str) -> float:
    """``Efficiency.step`` for ``preset``'s GPU: the median over its checked runs of published MFU over the MFU
    of the same steps' kernels at their isolated rates."""
    ratios = [p / m for _, r, pr, reason, spec in _runs() if pr == preset and not reason
              for p, m in [_mfus(r, pr, spec, isolated=True)]]
    if not ratios:
        raise ValueError(f"fit_step(preset={preset!r}): no published training run on this preset's GPU")
    return statistics.median(ratios)


def checks() -> list[Check]:
    """Every published training run beside the model's whole-step MFU (the preset's ``step`` applied)."""
    out = []
    for i, r, preset, reason, spec in _runs():
        what = (f"{r['model']} {r['gpus']} GPUs seq {r['seq_len'] or '?'} micro-batch {r['micro_batch'] or '?'} "
                f"ckpt {r['activation_ckpt'] or '?'} ({r['framework'][:40]})")
        measured, model = float("nan"), None
        if preset and not reason:
            measured, model = _mfus(r, preset, spec)
        out.append(Check("training", i, what, r["hardware"], measured, model, "MFU", BOUND,
                         bool(preset) and not reason, reason, r["source"]))
    return out


if __name__ == "__main__":
    from toolkit.runtime.calibration import summary
    for name in ("a100-ib200", "h100-ib400"):
        print(f"{name}: fitted step {fit_step(name):.3f}, preset's {cluster(name).gpu.efficiency.step:.3f}")
    rows = checks()
    print(summary(rows))
    for c in sorted((c for c in rows if c.checked), key=lambda c: abs(c.ratio - 1))[-5:]:
        print(f"  {c.what} on {c.hardware}: model {c.model:.3f} against {c.measured:.3f} MFU (x{c.ratio:.3f})")
