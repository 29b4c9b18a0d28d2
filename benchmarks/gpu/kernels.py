"""GPU check: the compiled Triton quantization kernels, bit-equal to their torch references, and their GB/s
against a device-to-device copy and the memory's theoretical peak (``benchmarks/bench_kernels.py``)."""
from __future__ import annotations

NUMEL = 1 << 26  # 64M elements per timed tensor


def check() -> list[dict]:
    from benchmarks.bench_kernels import bench, check_rows, peak_bandwidth_gbs
    rows = [{"check": f"triton == torch: {name}", "ok": ok, "value": detail} for name, ok, detail in check_rows()]
    perf = bench(NUMEL)
    copy, peak = perf[0]["GB/s"], peak_bandwidth_gbs()
    for r in perf:
        share = f"{100 * r['GB/s'] / copy:.0f}% of copy" + (f", {100 * r['GB/s'] / peak:.0f}% of peak {peak:.0f}"
                                                             if peak else "")
        rows.append({"check": f"GB/s: {r['kernel']}", "ok": r["GB/s"] > 0,
                     "value": f"{r['GB/s']:.0f} GB/s ({share})"})
    return rows
