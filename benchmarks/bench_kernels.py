"""GB/s of the quantization kernels on a CUDA GPU, against the device's memory bandwidth.

    python benchmarks/bench_kernels.py [--numel 67108864] [--check-only]

Every kernel is first checked bit for bit against the torch reference (kernels/reference.py),
then timed with CUDA events (triton.testing.do_bench: warm-up, many repetitions, median).
GB/s counts the bytes each kernel must move (read its input, write its output):

    quantize int8   read 4n (fp32) or 2n (bf16)   write n + 4n/block
    quantize int4   read 4n / 2n                  write n/2 + 4n/block
    quantize fp8    read 4n / 2n                  write n + 4n/block
    dequantize      read n (or n/2) + 4n/block    write 4n
    hadamard32      read 4n                       write 4n

and compares them with (a) a device-to-device copy measured the same way (what a memory-bound
kernel can reach) and (b) the theoretical peak from the memory clock and bus width when torch
reports them. Without a GPU it prints why and exits 0 (the CPU tests cover correctness).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from toolkit.runtime import machine  # noqa: E402


def peak_bandwidth_gbs(device: int = 0) -> float | None:
    """2 (double data rate) x memory clock x bus width, when torch exposes them."""
    props = torch.cuda.get_device_properties(device)
    clock_khz, bus_bits = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9 if clock_khz and bus_bits else None


def check_rows(n: int = 1 << 20) -> list[tuple[str, bool, str]]:
    """Compiled kernels vs the torch reference, one (case, bit-equal, detail) per case."""
    from toolkit import quant as Q
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n + 77, generator=g) * torch.logspace(-3, 2, n + 77)  # ragged tail, many scales
    x[:4096] = 0.0  # all-zero blocks
    rows = []

    def case(name: str, pairs) -> None:
        diffs = [what for what, a, b in pairs if not torch.equal(a, b.cpu())]
        rows.append((name, not diffs, "bit-equal" if not diffs else "differs: " + ", ".join(diffs)))

    for bits, block, sr in ((8, 128, False), (4, 128, False), (8, 128, True), (4, 32, True), (8, 100, False)):
        a = Q.quantize_blockwise(x, bits, block, stochastic=sr, seed=9, impl="torch")
        b = Q.quantize_blockwise(x.cuda(), bits, block, stochastic=sr, seed=9, impl="triton")
        case(f"int{bits} block {block}{' SR' if sr else ''}",
             [("payload", a.payload, b.payload), ("scales", a.scales, b.scales),
              ("dequantized", Q.dequantize_blockwise(a, impl="torch"), Q.dequantize_blockwise(b, impl="triton"))])
    for block in (128, 32):
        a, b = Q.quantize_fp8_blockwise(x, block, impl="torch"), Q.quantize_fp8_blockwise(x.cuda(), block, impl="triton")
        case(f"fp8 block {block}", [("payload", a.payload, b.payload), ("scales", a.scales, b.scales),
                                    ("dequantized", Q.dequantize_blockwise(a, impl="torch"),
                                     Q.dequantize_blockwise(b, impl="triton"))])
    h = x[: n // 32 * 32]
    for dtype in (torch.float32, torch.bfloat16):
        for inverse in (False, True):
            case(f"hadamard32 {str(dtype).removeprefix('torch.')}{' inverse' if inverse else ''}",
                 [("output", Q.hadamard32(h.to(dtype), inverse, impl="torch"),
                   Q.hadamard32(h.to(dtype).cuda(), inverse, impl="triton"))])
    return rows


def check(n: int = 1 << 20) -> None:
    """Compiled kernels == torch reference, bit for bit (raises AssertionError otherwise)."""
    bad = [f"{name}: {detail}" for name, ok, detail in check_rows(n) if not ok]
    assert not bad, "; ".join(bad)
    print(f"check: Triton kernels on {torch.cuda.get_device_name()} == torch reference, bit for bit")


def bench(numel: int) -> list[dict]:
    import triton.testing
    from toolkit import quant as Q
    x32 = torch.randn(numel, device="cuda")
    rows = []

    def run(name: str, fn, bytes_moved: int) -> None:
        ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
        rows.append({"kernel": name, "ms": ms, "GB/s": bytes_moved / ms / 1e6})

    run("copy (d2d, reference)", lambda: x32.clone(), 8 * numel)
    for dtype, size in ((torch.float32, 4), (torch.bfloat16, 2)):
        x = x32.to(dtype)
        tag = str(dtype).removeprefix("torch.")
        for bits in (8, 4):
            run(f"quantize int{bits} {tag} block128", lambda: Q.quantize_blockwise(x, bits, 128, impl="triton"),
                size * numel + numel * bits // 8 + 4 * numel // 128)
        run(f"quantize int8 SR {tag} block128",
            lambda: Q.quantize_blockwise(x, 8, 128, stochastic=True, seed=1, impl="triton"),
            size * numel + numel + 4 * numel // 128)
        run(f"quantize fp8 {tag} block128", lambda: Q.quantize_fp8_blockwise(x, 128, impl="triton"),
            size * numel + numel + 4 * numel // 128)
    for bits in (8, 4):
        q = Q.quantize_blockwise(x32, bits, 128, impl="triton")
        run(f"dequantize int{bits} -> fp32", lambda: Q.dequantize_blockwise(q, impl="triton"),
            numel * bits // 8 + 4 * numel // 128 + 4 * numel)
    run("hadamard32 fp32", lambda: Q.hadamard32(x32, impl="triton"), 8 * numel)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=1 << 26, help="elements per tensor (default 64M)")
    parser.add_argument("--check-only", action="store_true", help="only compare with the reference")
    args = parser.parse_args()
    print(f"machine: {machine.describe()}", flush=True)  # what the times below mean
    if not torch.cuda.is_available():
        print("bench_kernels: no CUDA GPU visible, nothing to measure (Triton has no CPU backend; "
              "tests/test_kernels.py checks the kernels under TRITON_INTERPRET=1).")
        return 0
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("bench_kernels: TRITON_INTERPRET=1 is set; unset it to time the compiled kernels.")
        return 1
    check()
    if args.check_only:
        return 0
    rows = bench(args.numel)
    copy = rows[0]["GB/s"]
    peak = peak_bandwidth_gbs()
    print(f"\n{torch.cuda.get_device_name()}: {args.numel:,} elements; d2d copy {copy:.0f} GB/s"
          + (f", theoretical peak {peak:.0f} GB/s" if peak else ""))
    print(f"{'kernel':34s} {'ms':>8s} {'GB/s':>8s} {'% of copy':>10s}" + (f" {'% of peak':>10s}" if peak else ""))
    for r in rows:
        print(f"{r['kernel']:34s} {r['ms']:8.3f} {r['GB/s']:8.0f} {100 * r['GB/s'] / copy:9.0f}%"
              + (f" {100 * r['GB/s'] / peak:9.0f}%" if peak else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
