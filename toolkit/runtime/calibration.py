"""The emulated cluster against published measurements: every row of ``data/published/`` next to the model.

Each table row is a measurement someone published (nccl-tests bus bandwidth, cuBLAS GEMM and FlashAttention
throughput, copy bandwidth), with its source. ``checks()`` puts the model's figure for the same setting beside
it::

    row (measured, source)  ─► the preset of its hardware ─► the model's figure ─► ratio = model / measured
                                                                                   bound: ±15 % (messages ≥ 1 MB,
                                                                                   GEMMs ≥ 1 GFLOP), ±30 % below

A row is ``checked`` (``tests/test_calibration.py`` holds it to its bound) or ``shown`` with the reason it is not
a check of a preset: hardware no preset describes (H200's compute, B200, PCIe cards, AWS's EFA network), FP8,
a statement without a size, a source that disagrees with another (both kept; the reason names the one the
preset follows), a run its author reports as broken. Reasons are rules on the row, written here, not a list of
rows picked by their error.

The presets were fitted to the checked rows (a handful of figures per link and per GPU; ``toolkit.runtime.
cluster``), so the check is how well a few physical parameters reproduce whole measured curves, not an
independent prediction; the rows of other sizes and ops than the fitted ones are the out-of-sample part.
"""
from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from . import collectives
from .cluster import Cluster, cluster as make_cluster
from .efficiency import Kernel, attention, gemm, kernel_seconds

DATA = Path(__file__).resolve().parents[2] / "data" / "published"
TABLES = ("collectives", "gemm", "attention", "overheads", "training")
LARGE_BYTES = 1 << 20
LARGE_FLOPS = 1e9


@lru_cache(maxsize=None)
def load(table: str) -> tuple[dict, ...]:
    """The rows of ``data/published/<table>.csv`` (strings, as published)."""
    if table not in TABLES:
        raise ValueError(f"table={table!r} is not one of {TABLES}")
    with open(DATA / f"{table}.csv", newline="") as f:
        return tuple(csv.DictReader(f))


@dataclass
class Check:
    """One published row beside the model."""

    table: str
    row: int
    """Index of the row in its table (0 = the first data row)."""
    what: str
    hardware: str
    measured: float
    model: float | None
    unit: str
    bound: float | None
    """Allowed |model / measured − 1| when the row is a check."""
    checked: bool
    reason: str
    """Why the row is only shown (empty for a check)."""
    source: str

    @property
    def ratio(self) -> float | None:
        return None if self.model is None or not self.measured else self.model / self.measured

    @property
    def within(self) -> bool | None:
        return None if self.ratio is None or self.bound is None else abs(self.ratio - 1) <= self.bound


def _float(text: str) -> float | None:
    try:
        return float(text)
    except (TypeError, ValueError):
        return None


def preset_for(hardware: str, table: str) -> tuple[str | None, str]:
    """(preset, reason it is none) of a row's hardware. H200 shares H100's NVLink 4 and NVSwitch, so its
    collectives inside a node check the H100 preset's link (its compute and memory differ: not checked)."""
    if hardware == "H100-SXM":
        return "h100-ib400", ""
    if hardware == "A100-SXM":
        return "a100-ib200", ""
    if hardware == "H200-SXM" and table == "collectives":
        return "h100-ib400", ""
    if hardware.startswith("Hopper H100/H200") and table == "attention":
        return "h100-ib400", ""
    if "EFA" in hardware:
        return None, "AWS's EFA network: no preset describes it"
    if hardware.startswith("H100 (variant not stated)"):
        return "h100-ib400", "an H100 of unstated variant (SXM or PCIe): shown beside the SXM preset, not a check"
    return None, f"{hardware}: no preset describes this hardware"


# ---- collectives -------------------------------------------------------------------------------------------
def _collective_checks() -> list[Check]:
    out = []
    for i, r in enumerate(load("collectives")):
        preset, reason = preset_for(r["hardware"], "collectives")
        busbw = _float(r["busbw_gbps"])
        size, gpus, nodes = _float(r["bytes"]), _float(r["gpus"]), _float(r["nodes"])
        what = f"{r['op']} {r['bytes'] or '(statement)'} B on {r['gpus'] or '?'} GPUs / {r['nodes'] or '?'} nodes"
        model = None
        if preset and not reason:
            if size is None or gpus is None or nodes is None:
                reason = "a statement without a message size or a group: shown beside the model's large-message " \
                         "bus bandwidth"
            elif busbw is None:
                reason = "no bus bandwidth printed"
            elif "NCHANNELS" in r["algo"] or "too slow" in r["where"]:
                reason = "channels forced by the poster, or a run the poster reports as too slow"
            elif "ND_H100" in r["source"] or "ND_H200" in r["source"] or "ND_A100" in r["source"]:
                if r["hardware"] != "A100-SXM" and size < 2 * LARGE_BYTES:
                    reason = ("Azure's size labels below 2 MB give half of NVIDIA's DGX H100 table's bus bandwidth "
                              "at the same size (up to 2.2x apart); the preset follows NVIDIA's table")
            elif "li-plus/playground" in r["source"] and size < 2 * 134217728:
                reason = "the run's first size: 1211 µs for 128 MB against 1423 µs for 256 MB, a warm-up artefact"
            if r["nvls"] == "no" and r["op"] == "all_reduce" and "Ring" in r["algo"] and preset == "h100-ib400":
                reason = reason or "NVLink SHARP switched off: the preset's all_reduce uses it, as NCCL does by default"
        c = make_cluster(preset) if preset else None
        if c is not None and size is not None and gpus and nodes:
            n, nd = int(gpus), int(nodes)
            wire = _wire(r["op"], n, size)
            spec = make_cluster(c, ranks_per_node=n // nd) if nd > 1 else c
            if n // nd <= spec.gpus_per_node:
                t, _, _ = collectives.seconds(spec, r["op"], range(n), n, wire)
                model = wire / t / 1e9
        elif c is not None:  # a statement: the model at 8 GB on the group it names (one node of 8 by default)
            model = _statement_model(c, r)
        out.append(Check("collectives", i, what, r["hardware"], busbw if busbw is not None else _range_mid(r),
                         model, "GB/s busbw", 0.15 if (size or 0) >= LARGE_BYTES or size is None else 0.30,
                         preset is not None and not reason and model is not None, reason, r["source"]))
    return out


def _wire(op: str, n: int, size: float) -> float:
    """nccl-tests' bus-bandwidth bytes of a collective whose size column is ``size``."""
    kind = collectives.op_class(op if op != "alltoall" else "all_to_all")
    if kind == "all_reduce":
        return 2 * (n - 1) / n * size
    if kind == "send":
        return size
    return (n - 1) / n * size


def _range_mid(r: dict) -> float:
    parts = [p for p in r["busbw_gbps"].replace(",", "-").split("-") if _float(p) is not None]
    return sum(float(p) for p in parts) / len(parts) if parts else math.nan


def _statement_model(c: Cluster, r: dict) -> float | None:
    """A maintainer's statement of a large-message bus bandwidth: the model at 8 GB."""
    op = r["op"]
    if "per NDR" in r["hardware"] or "per CX-7" in r["hardware"]:
        nodes = 6 if op == "alltoall" else 2  # the thread's setting: 6 nodes (alltoall), 2 nodes one GPU each
        n, per = (nodes * 8, 8) if op == "alltoall" else (2, 1)
        spec = make_cluster(c, ranks_per_node=per)
        wire = _wire(op, n, 8e9)
        return wire / collectives.seconds(spec, op if op != "alltoall" else "all_to_all", range(n), n, wire)[0] / 1e9
    if _float(r["gpus"]) == 8 or r["gpus"] == "":
        wire = _wire(op, 8, 8e9)
        return wire / collectives.seconds(c, op if op != "alltoall" else "all_to_all", range(8), 8, wire)[0] / 1e9
    return None


# ---- GEMMs, attention, memory --------------------------------------------------------------------------------
def _device_seconds(c: Cluster, k: Kernel) -> float:
    g = c.isolated().gpu  # the tables time one kernel at a time
    return kernel_seconds(k, g.bf16_flops, g.hbm_bytes_per_s, g.sms, g.efficiency)


def _gemm_checks() -> list[Check]:
    out = []
    for i, r in enumerate(load("gemm")):
        preset, reason = preset_for(r["hardware"], "gemm")
        m, n, k, measured = (_float(r[x]) for x in ("m", "n", "k", "tflops"))
        what = f"{r['dtype']} GEMM {r['m']}x{r['n']}x{r['k']} ({r['library'][:40]})"
        model = None
        if preset and r["dtype"] not in ("bf16", "fp16"):
            reason = f"{r['dtype']}: the presets time bf16 GEMMs"
        elif preset and None in (m, n, k):
            reason = "a best-of-a-search figure without its shape"
        if preset and None not in (m, n, k) and r["dtype"] in ("bf16", "fp16"):
            c = make_cluster(preset)
            kernel = gemm(int(m), int(n), int(k))
            t = _device_seconds(c, kernel)
            if "torch.matmul" in r["library"]:  # an eager loop of the op: the host's cost per op is the floor
                t = max(t, c.gpu.efficiency.host_op_s)
            model = kernel.flops / t / 1e12
        flops = 2 * m * n * k if None not in (m, n, k) else 0
        out.append(Check("gemm", i, what, r["hardware"], measured, model, "TFLOP/s",
                         0.15 if flops >= LARGE_FLOPS else 0.30, bool(preset) and not reason, reason, r["source"]))
    return out


def _attention_checks() -> list[Check]:
    out = []
    for i, r in enumerate(load("attention")):
        preset, reason = preset_for(r["hardware"], "attention")
        measured, seq, d = _float(r["tflops"]), _float(r["seqlen"]), _float(r["headdim"])
        what = f"{r['impl'][:40]} {r['pass']} causal={r['causal']} s={r['seqlen']} d={r['headdim']}"
        model = None
        if preset and ("FP8" in r["impl"] or "FlashAttention-3" in r["impl"] or "standard" in r["impl"]
                       or "Triton" in r["impl"] or "cutlass" in r["impl"]):
            reason = "not the kernel the presets time (FlashAttention-2, what PyTorch's SDPA runs)"
        elif preset and (seq is None or d is None or measured is None):
            reason = "no sequence length, head size or figure"
        elif preset and r["pass"] not in ("fwd", "bwd"):
            reason = "the pass it measures is not stated"
        if preset and seq is not None and d is not None and measured is not None and r["pass"] in ("fwd", "bwd"):
            c = make_cluster(preset)
            causal = r["causal"] != "False"  # SDPA's benchmark does not state its mask: its figures match causal
            batch_heads = int(_float(r["batch"]) or 16) * int(_float(r["heads"]) or 16)
            kernel = attention(batch_heads, int(seq), int(d), causal, r["pass"] == "bwd")
            model = kernel.flops / _device_seconds(c, kernel) / 1e12
        out.append(Check("attention", i, what, r["hardware"], measured if measured is not None else math.nan, model,
                         "TFLOP/s", 0.15, bool(preset) and not reason and model is not None, reason, r["source"]))
    return out


def _memory_checks() -> list[Check]:
    out = []
    for i, r in enumerate(load("overheads")):
        if r["quantity"] != "hbm_achieved_bytes_per_s":
            continue
        hardware = r["hardware"].split(" (")[0]
        preset, reason = preset_for(hardware, "overheads")
        measured = _float(r["value"])
        model = None
        if preset and "Dot" in r["where"]:
            reason = "a reduction (Dot) reads without writing: the presets time copies and elementwise kernels"
        if preset and not reason:
            g = make_cluster(preset).gpu
            model = g.hbm_bytes_per_s * g.efficiency.hbm
        out.append(Check("overheads", i, f"memory-bound kernel ({r['where'][:60]})", r["hardware"], measured,
                         model, "B/s", 0.15, bool(preset) and not reason, reason, r["source"]))
    return out


def checks() -> list[Check]:
    """Every published row of collectives, GEMMs, attention and memory bandwidth beside the model."""
    return _collective_checks() + _gemm_checks() + _attention_checks() + _memory_checks()


def summary(rows: list[Check] | None = None) -> dict[str, dict]:
    """Per table: rows, checked rows, checked rows within their bound, the worst checked ratio."""
    rows = checks() if rows is None else rows
    out: dict[str, dict] = {}
    for table in sorted({c.table for c in rows}):
        mine = [c for c in rows if c.table == table]
        checked = [c for c in mine if c.checked]
        worst = max(checked, key=lambda c: abs(math.log(c.ratio)), default=None)
        out[table] = {"rows": len(mine), "checked": len(checked), "within": sum(bool(c.within) for c in checked),
                      "worst_ratio": worst.ratio if worst else None, "worst": worst.what if worst else ""}
    return out
