"""What this machine's times mean: the CPU, its vector and bf16 instructions, and what torch makes of them.

::

    /proc/cpuinfo flags ──► avx2 · avx512 (f, bw, vl, dq) · bf16 instructions (avx512_bf16, amx_bf16; arm: bf16)
    environment         ──► ATEN_CPU_CAPABILITY (torch's vector kernels), ONEDNN_MAX_CPU_ISA (oneDNN's GEMMs)
    torch               ──► torch.backends.cpu.get_cpu_capability()
                                    │
                                    ▼
    bf16_gemm: "native"  oneDNN may use the CPU's bf16 instructions: a bf16 GEMM costs about what fp32 does
               "slow"    it may not (no such instructions, or capped by ONEDNN_MAX_CPU_ISA): torch falls back to
                         a scalar loop, ~50-75x slower than fp32 (measured: 203 ms vs 2.7 ms at 512², AVX2 EPYC)

``fingerprint()`` returns all of it as a dict (JSON-able), ``describe()`` as one line for a summary.
``toolkit.runtime.bf16`` reads ``bf16_gemm`` to decide how GEMMs on bf16 tensors compute.
"""
from __future__ import annotations

import functools
import os
import platform

OVERRIDES = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")
"""Environment variables that make torch use less of the CPU than it has (the slow path can be reproduced
with ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`` on a CPU that has bf16 instructions)."""

BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")  # x86 AVX-512 BF16, AMX, arm FEAT_BF16 ("Features: ... bf16")
AVX512_CORE = ("avx512f", "avx512bw", "avx512vl", "avx512dq")
ONEDNN_BF16_ISAS = ("AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16",
                    "AVX10_1_512", "AVX10_1_512_AMX", "AVX10_1_512_AMX_FP16", "ALL", "DEFAULT")
"""``ONEDNN_MAX_CPU_ISA`` values that still let oneDNN use bf16 instructions (oneDNN's ISA names)."""


def _cpuinfo() -> tuple[str, set[str]]:
    """(model name, flags) from /proc/cpuinfo; ("", set()) where there is none (macOS, Windows)."""
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return "", set()
    model, flags = "", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("model name", "cpu model", "hardware") and not model:
            model = value.strip()
        elif key in ("flags", "features") and not flags:
            flags = set(value.split())
    return model, flags


def bf16_gemm_path(flags: set[str], env: dict[str, str]) -> tuple[str, str]:
    """("native" | "slow", why): whether torch's bf16 GEMMs may use the CPU's bf16 instructions."""
    native = [f for f in BF16_FLAGS if f in flags]
    if not native:
        return "slow", "no bf16 instructions"
    cap = env.get("ONEDNN_MAX_CPU_ISA", "").upper()
    if cap and cap not in ONEDNN_BF16_ISAS:
        return "slow", f"{native[0]} present but ONEDNN_MAX_CPU_ISA={env['ONEDNN_MAX_CPU_ISA']} keeps oneDNN from it"
    return "native", native[0]


@functools.lru_cache(maxsize=1)
def fingerprint() -> dict:
    """This machine in a few fields (computed once per process)::

        {"cpu": "AMD EPYC 7B13", "cores": 2, "arch": "x86_64", "avx2": True, "avx512": False,
         "bf16_instructions": False, "bf16_gemm": "slow", "bf16_gemm_why": "no bf16 instructions",
         "torch_capability": "AVX2", "overrides": {}, "torch": "2.13.0+cpu"}
    """
    import torch

    model, flags = _cpuinfo()
    env = {k: os.environ[k] for k in OVERRIDES if os.environ.get(k)}
    path, why = bf16_gemm_path(flags, env)
    return {"cpu": model or platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "arch": platform.machine(), "avx2": "avx2" in flags, "avx512": all(f in flags for f in AVX512_CORE),
            "bf16_instructions": any(f in flags for f in BF16_FLAGS), "bf16_gemm": path, "bf16_gemm_why": why,
            "torch_capability": torch.backends.cpu.get_cpu_capability(), "overrides": env,
            "torch": torch.__version__}


def describe(fp: dict | None = None) -> str:
    """One line: ``AMD EPYC · 2 cores · AVX-512 · bf16 GEMMs slow (no bf16 instructions) · torch AVX2 (...)``."""
    fp = fp or fingerprint()
    isa = "AVX-512" if fp["avx512"] else "AVX2" if fp["avx2"] else fp["arch"]
    overrides = " ".join(f"{k}={v}" for k, v in fp["overrides"].items())
    return (f"{fp['cpu']} · {fp['cores']} cores · {isa} · bf16 GEMMs {fp['bf16_gemm']} ({fp['bf16_gemm_why']}) · "
            f"torch {fp['torch']} kernels {fp['torch_capability']}" + (f" · set: {overrides}" if overrides else ""))


__all__ = ["fingerprint", "describe", "bf16_gemm_path", "OVERRIDES"]
