"""Quantization kernels: the Triton kernels (run by Triton's interpreter on CPU) against the torch reference,
and the invariants of block-wise quantization (the techniques' briefs: int8/int4 all-to-all, SDP4Bit, INT8 vs FP8)."""
import importlib
import math
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before triton.jit decorates the kernels

import pytest
import torch

from kernels import reference as ref
from toolkit import quant as Q

if "kernels.quant_triton" in sys.modules:  # imported earlier in this session without the interpreter
    importlib.reload(sys.modules["kernels.quant_triton"])

INT_CASES = [(bits, block, sr) for bits in (8, 4) for block in (32, 100, 128, 2048) for sr in (False, True)]


def _data(shape=(7, 300), seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.logspace(-3, 2, shape[-1])  # blocks of very different scales
    x[1] = 0.0  # an all-zero row (whole zero blocks for small block sizes)
    return x.to(dtype)


# ---- Triton == reference, bit for bit ---------------------------------------------------------------------
@pytest.mark.parametrize("bits,block,stochastic", INT_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_int_matches_reference(bits, block, stochastic, dtype):
    x = _data(dtype=dtype)
    a = Q.quantize_blockwise(x, bits, block, stochastic=stochastic, seed=11, impl="torch")
    b = Q.quantize_blockwise(x, bits, block, stochastic=stochastic, seed=11, impl="triton")
    assert a.payload.dtype == b.payload.dtype == (torch.int8 if bits == 8 else torch.uint8)
    assert torch.equal(a.payload, b.payload)
    assert torch.equal(a.scales, b.scales)
    assert torch.equal(Q.dequantize_blockwise(a, impl="torch"), Q.dequantize_blockwise(b, impl="triton"))


@pytest.mark.parametrize("block", [32, 100, 128, 4096])
def test_triton_fp8_matches_reference(block):
    x = _data(shape=(5, 1000))
    a = Q.quantize_fp8_blockwise(x, block, impl="torch")
    b = Q.quantize_fp8_blockwise(x, block, impl="triton")
    assert torch.equal(a.payload, b.payload) and torch.equal(a.scales, b.scales)
    assert torch.equal(Q.dequantize_blockwise(a, impl="torch"), Q.dequantize_blockwise(b, impl="triton"))


def test_fp8_rounding_on_every_binade_and_tie():
    """Every E4M3 value, every midpoint between neighbours (ties -> even) and points just off them.

    One block holds 448 so s = 1 and x/s = x: the kernel's grid rounding is compared with torch's cast.
    """
    grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448, subnormals too
    mids = (grid[:-1] + grid[1:]) / 2
    probes = torch.cat([grid, mids, mids * (1 + 2**-20), mids * (1 - 2**-20)])
    x = torch.cat([probes, -probes])
    x = torch.cat([x, torch.full(((-x.numel()) % 4096,), 448.0)])
    x[::4096] = 448.0
    a = Q.quantize_fp8_blockwise(x, 4096, impl="torch")
    b = Q.quantize_fp8_blockwise(x, 4096, impl="triton")
    assert torch.all(a.scales == 1.0)
    assert torch.equal(a.payload, b.payload)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_hadamard_matches_reference(dtype):
    x = _data(shape=(9, 320)).to(dtype)
    for inverse in (False, True):
        assert torch.equal(Q.hadamard32(x, inverse, impl="torch"), Q.hadamard32(x, inverse, impl="triton"))


# ---- invariants -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("bits,block", [(8, 128), (4, 128), (8, 32), (4, 100)])
def test_rtn_error_at_most_half_a_step(bits, block, impl):
    x = _data(shape=(6, 500))
    q = Q.quantize_blockwise(x, bits, block, impl=impl)
    err = (Q.dequantize_blockwise(q, impl=impl) - x).abs().reshape(-1)
    s = q.scales.repeat_interleave(block)[:x.numel()]
    assert torch.all(err <= s / 2 * (1 + 1e-6) + 1e-30), float((err - s / 2).max())


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_fp8_error_within_half_an_e4m3_step(impl):
    x = _data(shape=(6, 500))
    q = Q.quantize_fp8_blockwise(x, 128, impl=impl)
    err = (Q.dequantize_blockwise(q, impl=impl) - x).abs().reshape(-1)
    s = q.scales.repeat_interleave(128)[:x.numel()]
    # 3 mantissa bits: half a step is 2^-4 of |x| in the normal range, 2^-10 * s among subnormals (< 2^-6 * s)
    bound = torch.maximum(x.abs().reshape(-1) * 2**-4, s * 2**-10) * (1 + 1e-6)
    assert torch.all(err <= bound)


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8_e4m3"])
def test_all_zero_blocks_are_guarded(fmt, impl):
    x = torch.zeros(3, 256)
    x[2, 200] = 5.0  # one non-zero block among zero blocks
    q = Q.quantize_fp8_blockwise(x, 128, impl=impl) if fmt == "fp8_e4m3" else \
        Q.quantize_blockwise(x, 8 if fmt == "int8" else 4, 128, impl=impl)
    assert q.scales.tolist()[:5] == [0.0] * 5 and q.scales[5] > 0
    y = Q.dequantize_blockwise(q, impl=impl)
    assert torch.isfinite(y).all() and torch.equal(y[:2], x[:2])
    assert y[2, 200] == 5.0


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_padding_and_shape(impl):
    x = _data(shape=(3, 5, 7))  # 105 elements: 1 block of 128, 23 padded zeros
    for bits in (8, 4):
        q = Q.quantize_blockwise(x, bits, 128, impl=impl)
        assert q.scales.numel() == 1 and q.shape == x.shape
        codes = ref.unpack_int4(q.payload) if bits == 4 else q.payload
        assert codes.numel() == 128 and torch.all(codes[105:] == 0)
        assert q.nbytes() == (128 if bits == 8 else 64) + 4
        assert Q.dequantize_blockwise(q, impl=impl).shape == x.shape
    assert Q.dequantize_blockwise(Q.quantize_blockwise(x.bfloat16(), impl=impl), torch.bfloat16).dtype == torch.bfloat16


def test_int4_packing_round_trip():
    codes = torch.arange(-7, 8, dtype=torch.int8).repeat(2)[:30]
    packed = ref.pack_int4(codes)
    assert packed.dtype == torch.uint8 and packed.numel() == 15
    assert torch.equal(ref.unpack_int4(packed), codes)
    assert packed[0].item() == ((-7) & 0xF) | (((-6) & 0xF) << 4)  # element 0 low nibble, element 1 high nibble


def test_hadamard_is_sylvester_and_self_inverse():
    h = Q.hadamard32(torch.eye(32))  # row i = H e_i
    i, j = torch.meshgrid(torch.arange(32), torch.arange(32), indexing="ij")
    popcount = sum(((i & j) >> b) & 1 for b in range(5))
    assert torch.equal(h, (1 - 2 * (popcount % 2)).float())  # H[i,j] = (-1)^popcount(i & j)
    assert torch.equal(h @ h, 32 * torch.eye(32))  # H H = 32 I
    x = _data(shape=(4, 64))
    assert torch.allclose(Q.hadamard32(Q.hadamard32(x), inverse=True), x, rtol=1e-6, atol=1e-6 * x.abs().max())


def test_stochastic_rounding_is_unbiased():
    """x = 0.3 s everywhere except one amax element per block: RTN always gives 0 (bias -0.3 s),
    stochastic rounding gives 1 with probability 0.3. Over n = 65536 elements the standard error of
    the mean is sqrt(0.21 / n) = 0.0018 s, so |mean - 0.3 s| < 0.01 s is a 5-sigma tolerance."""
    block = 128
    x = torch.full((512, block), 0.3)
    x[:, 0] = 7.0  # int4: s = 7 / 7 = 1
    q_sr = Q.quantize_blockwise(x, 4, block, stochastic=True, seed=1234)
    q_rtn = Q.quantize_blockwise(x, 4, block)
    body = lambda q: Q.dequantize_blockwise(q)[:, 1:]
    assert abs(body(q_sr).mean().item() - 0.3) < 0.01
    assert body(q_rtn).abs().max().item() == 0.0
    assert set(body(q_sr).unique().tolist()) == {0.0, 1.0}
    # Gaussian data: the mean signed error over many elements is ~0, the error never exceeds one step
    g = torch.randn(1 << 16, generator=torch.Generator().manual_seed(0))
    q = Q.quantize_blockwise(g, 8, 128, stochastic=True, seed=7)
    err = Q.dequantize_blockwise(q) - g
    s = q.scales.repeat_interleave(128)
    assert abs((err / s).mean().item()) < 5 * math.sqrt(1 / 6 / g.numel())  # var of u - frac <= 1/4; 1/6 typical
    assert torch.all(err.abs() <= s * (1 + 1e-6))


def test_stochastic_rounding_is_seeded():
    x = _data()
    a = Q.quantize_blockwise(x, 8, 128, stochastic=True, seed=3)
    assert torch.equal(a.payload, Q.quantize_blockwise(x, 8, 128, stochastic=True, seed=3).payload)
    assert not torch.equal(a.payload, Q.quantize_blockwise(x, 8, 128, stochastic=True, seed=4).payload)


def test_qsnr_matches_theory_on_gaussian():
    """The INT8 vs FP8 brief's simulation: Gaussian, block 128: INT8 43.8 dB, FP8 31.8 dB; int4 18.6 dB (section 4)."""
    g = torch.randn(1 << 18, generator=torch.Generator().manual_seed(0))
    snr = {fmt: Q.qsnr_db(g, Q.fake_quantize(g, fmt, 128)) for fmt in ("int8", "int4", "fp8_e4m3")}
    assert abs(snr["int8"] - 43.8) < 0.5 and abs(snr["fp8_e4m3"] - 31.8) < 0.5 and abs(snr["int4"] - 18.6) < 0.6
    assert Q.qsnr_db(g, g) == math.inf and abs(Q.qsnr_db(g, torch.zeros_like(g))) < 1e-9


# ---- bad input --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad,word", [(float("nan"), "NaN"), (float("inf"), "Inf"), (float("-inf"), "Inf")])
def test_non_finite_input_is_rejected(bad, word):
    x = torch.randn(256)
    x[17] = bad
    for fn in (lambda: Q.quantize_blockwise(x), lambda: Q.quantize_fp8_blockwise(x), lambda: Q.hadamard32(x),
               lambda: Q.quantize_blockwise(x, impl="triton")):
        with pytest.raises(ValueError, match=f"1 {word}"):
            fn()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_all_finite_agrees_with_isfinite_all(dtype):
    """One aminmax pass: a NaN anywhere, +Inf or -Inf alone, all Inf, and the largest finite values (which a
    difference or a sum of the bounds would overflow) are told apart as torch.isfinite(x).all() tells them."""
    big = torch.finfo(dtype).max
    cases = [torch.randn(1000), torch.tensor([big, -big, big]), torch.tensor([float("inf")] * 3),
             torch.tensor([1.0, float("-inf")]), torch.tensor([float("nan"), 2.0, float("inf")]), torch.zeros(0)]
    for v in (float("nan"), float("inf"), float("-inf")):
        x = torch.randn(4096)
        x[1234] = v
        cases.append(x)
    for x in cases:
        x = x.to(dtype)
        assert Q.all_finite(x) == bool(torch.isfinite(x).all()), x


@pytest.mark.parametrize("dtype", [torch.int32, torch.int8, torch.bool, torch.complex64, torch.float8_e4m3fn])
def test_unsupported_dtype_is_rejected(dtype):
    x = torch.zeros(64, dtype=dtype)
    with pytest.raises(ValueError, match="dtype"):
        Q.quantize_blockwise(x)
    with pytest.raises(ValueError, match="dtype"):
        Q.quantize_fp8_blockwise(x)


def test_bad_arguments_are_named():
    x = torch.randn(64)
    with pytest.raises(ValueError, match="bits"):
        Q.quantize_blockwise(x, bits=3)
    with pytest.raises(ValueError, match="block"):
        Q.quantize_blockwise(x, block=0)
    with pytest.raises(ValueError, match="block=33 must be even"):
        Q.quantize_blockwise(x, bits=4, block=33)
    with pytest.raises(ValueError, match="numel % 32"):
        Q.hadamard32(torch.randn(40))
    with pytest.raises(ValueError, match="impl"):
        Q.quantize_blockwise(x, impl="cuda")
    with pytest.raises(ValueError, match="impl"):
        Q.set_impl("numpy")
    with pytest.raises(ValueError, match="empty"):
        Q.quantize_blockwise(torch.empty(0))
    with pytest.raises(ValueError, match="above the Triton kernels' limit"):
        Q.quantize_blockwise(torch.randn(1 << 15), block=1 << 15, impl="triton")
    with pytest.raises(ValueError, match="fmt"):
        Q.fake_quantize(x, "int2")


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        Q.quantize_blockwise(torch.randn(64), impl="triton")


def test_set_impl_changes_the_default():
    try:
        Q.set_impl("triton")
        a = Q.quantize_blockwise(_data())  # runs the interpreter
        Q.set_impl("torch")
        assert torch.equal(a.payload, Q.quantize_blockwise(_data()).payload)
    finally:
        Q.set_impl("auto")
    assert Q.get_impl() == "auto"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_cuda_kernels_match_reference():
    """On a GPU: the compiled kernels (not the interpreter this module turned on) against the reference."""
    import subprocess
    from pathlib import Path
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_kernels.py"
    out = subprocess.run([sys.executable, str(script), "--check-only"], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
