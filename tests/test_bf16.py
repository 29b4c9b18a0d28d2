"""bf16 as storage (toolkit.runtime.bf16) and the machine fingerprint (toolkit.runtime.machine).

The fp32-compute mode must give what a GPU's fp32-accumulating bf16 GEMM gives: the fp32 product of the bf16
operands rounded to bf16 once, forward and backward; keep only bf16 tensors for backward; leave everything
that is not all-bf16-on-CPU alone.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from toolkit.models import GPT, preset
from toolkit.runtime import bf16, machine


def _bf16(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16().requires_grad_()


def _fp32_reference(fn, *inputs):
    """fn in float64 on the bf16 values (exact enough), output and grads rounded to bf16 once."""
    xs = [t.detach().double().requires_grad_() for t in inputs]
    out = fn(*xs)
    grads = torch.autograd.grad(out, xs, torch.ones_like(out))
    return out.bfloat16(), [g.bfloat16() for g in grads]


@pytest.mark.parametrize("case", ["linear", "linear_no_bias", "matmul_broadcast", "bmm", "attention"])
def test_each_gemm_is_the_fp32_product_rounded_once_forward_and_backward(case):
    fn, inputs = {
        "linear": (F.linear, (_bf16(3, 5, 16), _bf16(8, 16, seed=1), _bf16(8, seed=2))),
        "linear_no_bias": (F.linear, (_bf16(7, 16), _bf16(8, 16, seed=1))),
        "matmul_broadcast": (torch.matmul, (_bf16(2, 5, 16), _bf16(16, 4, seed=1))),
        "bmm": (torch.bmm, (_bf16(2, 5, 16), _bf16(2, 16, 4, seed=1))),
        "attention": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                      (_bf16(1, 2, 6, 8), _bf16(1, 2, 6, 8, seed=1), _bf16(1, 2, 6, 8, seed=2))),
    }[case]
    with bf16.Fp32Compute():
        out = fn(*inputs)
        grads = torch.autograd.grad(out, inputs, torch.ones_like(out))
    want, want_grads = _fp32_reference(fn, *inputs)
    assert out.dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in grads)
    # fp32 accumulation vs float64: at most one bf16 ulp apart after the one rounding
    torch.testing.assert_close(out, want, rtol=2 ** -7, atol=1e-6)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, rtol=2 ** -7, atol=1e-5)


def test_what_is_saved_for_backward_is_no_more_than_torchs_own_bf16_ops_save():
    """The GEMMs keep their bf16 inputs; fp32 is kept only where torch's bf16 path keeps it too (the loss's
    log-softmax of fp32 logits, LayerNorm's statistics)."""
    model = GPT(preset("smoke")).to(torch.bfloat16)
    x = torch.randint(0, 256, (2, 16))
    saved = {}
    for on in (False, True):
        kept = saved[on] = {torch.bfloat16: 0, torch.float32: 0}

        def pack(t, kept=kept):
            if t.dtype in kept:
                kept[t.dtype] += t.numel() * t.element_size()
            return t
        with bf16.bf16_as_storage(on), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(x, x).backward()
    assert saved[True][torch.float32] <= saved[False][torch.float32], saved
    assert saved[True][torch.bfloat16] <= saved[False][torch.bfloat16], saved


def test_a_bf16_gpt_trains_the_same_way_in_both_paths():
    """The losses of a bf16 GPT with fp32-computed GEMMs stay within bf16 rounding of torch's own bf16 ops."""
    torch.manual_seed(0)
    base = GPT(preset("smoke")).to(torch.bfloat16)
    x, y = torch.randint(0, 256, (4, 32)), torch.randint(0, 256, (4, 32))
    losses = {}
    for on in (False, True):
        model = copy.deepcopy(base)
        with bf16.bf16_as_storage(on):
            loss = model(x, y)
            loss.backward()
        losses[on] = (loss.item(), torch.cat([p.grad.float().flatten() for p in model.parameters()]))
    assert abs(losses[True][0] - losses[False][0]) < 1e-2 * losses[False][0]
    g_on, g_off = losses[True][1], losses[False][1]
    assert torch.linalg.vector_norm(g_on - g_off) < 0.05 * torch.linalg.vector_norm(g_off)


def test_fp32_and_mixed_calls_pass_through_untouched():
    a, w = torch.randn(4, 8), torch.randn(3, 8)
    want = F.linear(a, w)
    with bf16.Fp32Compute():
        assert torch.equal(F.linear(a, w), want)
        with pytest.raises(RuntimeError):  # torch's own error for mixed dtypes, not a silent upcast
            F.linear(a, w.bfloat16())


def test_compute_follows_the_fingerprint_and_the_override(monkeypatch):
    monkeypatch.delenv(bf16.ENV, raising=False)
    assert bf16.compute() == ("fp32" if machine.fingerprint()["bf16_gemm"] == "slow" else "bf16")
    for choice in ("fp32", "bf16"):
        monkeypatch.setenv(bf16.ENV, choice)
        assert bf16.compute() == choice
    monkeypatch.setenv(bf16.ENV, "fast")
    with pytest.raises(ValueError, match="TOOLKIT_BF16_COMPUTE='fast' is not known; allowed: auto, fp32, bf16"):
        bf16.compute()


@pytest.mark.parametrize("flags, env, path", [
    ({"avx2", "fma"}, {}, "slow"),                                                 # AMD Zen 2/3, Intel client
    ({"avx2", "avx512f", "avx512bw", "avx512vl", "avx512dq"}, {}, "slow"),         # AVX-512 without bf16
    ({"avx2", "avx512f", "avx512_bf16"}, {}, "native"),                            # Zen 4, Cooper Lake
    ({"avx2", "amx_bf16"}, {}, "native"),                                          # Sapphire Rapids
    ({"avx2", "avx512_bf16"}, {"ONEDNN_MAX_CPU_ISA": "AVX2"}, "slow"),             # the slow path, reproduced
    ({"avx2", "avx512_bf16"}, {"ONEDNN_MAX_CPU_ISA": "avx512_core_bf16"}, "native"),
    ({"asimd", "bf16"}, {}, "native"),                                             # arm with FEAT_BF16
])
def test_bf16_gemm_path_from_flags_and_overrides(flags, env, path):
    got, why = machine.bf16_gemm_path(flags, env)
    assert got == path and why
    if env.get("ONEDNN_MAX_CPU_ISA") == "AVX2":
        assert "ONEDNN_MAX_CPU_ISA=AVX2" in why


def test_fingerprint_is_json_and_describes_this_machine(monkeypatch):
    import json
    fp = machine.fingerprint()
    assert json.loads(json.dumps(fp)) == fp
    assert fp["torch_capability"] == torch.backends.cpu.get_cpu_capability()
    assert fp["bf16_gemm"] in ("native", "slow") and isinstance(fp["avx512"], bool)
    line = machine.describe(dict(fp, overrides={"ONEDNN_MAX_CPU_ISA": "AVX2"}))
    assert fp["cpu"] in line and "bf16 GEMMs" in line and "ONEDNN_MAX_CPU_ISA=AVX2" in line
