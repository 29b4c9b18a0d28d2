"""Parameter copy reuse: exact split/merge, bit-exact training against the same-rounding reference,
2 bytes per parameter saved, checkpoints in fp32, bad inputs."""
import copy
import sys

import pytest
import torch

from toolkit import launch
from toolkit.data import batches
from toolkit.lessons import l07_param_reuse
from toolkit.memory import param_reuse
from toolkit.memory.param_reuse import (HALF, MasterAdamW, ReuseAdamW, bytes_by_category, count_ties, merge,
                                        round_half_away, split)
from toolkit.models import GPT, count_params, preset
from toolkit.runtime.memory import MemoryTracker


def _random_finite(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (4 * n,), dtype=torch.uint8, generator=g).view(torch.float32)
    return x[torch.isfinite(x)]


def test_round_trip_is_bit_exact_on_random_bit_patterns():
    """2 x 10^7 random finite fp32 bit patterns (the notes ask 10^8: this is what fits in a few seconds;
    the benchmark runs 10^8)."""
    for seed in range(2):
        x = _random_finite(10_000_000, seed)
        hi, lo = split(x)
        assert hi.dtype == torch.bfloat16 and lo.dtype == torch.int16
        assert torch.equal(merge(hi, lo).view(torch.int32), x.view(torch.int32))


@pytest.mark.parametrize("hi16", [0x0000, 0x0001, 0x3F80, 0x7F7E, 0x7F7F, 0x8000, 0x8001, 0xBF80, 0xFF7F])
def test_every_low_half_round_trips_and_rounds_ties_away(hi16):
    lo16 = torch.arange(0, 1 << 16, dtype=torch.int64)
    x = ((hi16 << 16) | lo16).to(torch.int64)
    x = torch.where(x >= 1 << 31, x - (1 << 32), x).to(torch.int32).view(torch.float32)  # [65536]
    hi, lo = split(x)
    assert torch.equal(merge(hi, lo).view(torch.int32), x.view(torch.int32))
    # bf16 half: truncation below half an ulp, one ulp up in magnitude from half an ulp on (ties included)
    expect = torch.where(lo16 >= HALF, hi16 + 1, hi16)
    assert torch.equal(hi.view(torch.int16).to(torch.int64) & 0xFFFF, expect & 0xFFFF)
    # against torch's round-half-even cast: different exactly on the tie when hi16 is even
    rne = x.bfloat16().view(torch.int16)
    differs = (hi.view(torch.int16) != rne).nonzero().flatten().tolist()
    assert differs == ([HALF] if hi16 % 2 == 0 else [])
    assert count_ties(x) == {"ties": 1, "rne_mismatches": int(hi16 % 2 == 0)}


def test_largest_finite_values_round_to_bf16_inf_but_still_merge_back():
    x = torch.tensor([0x7F7F8000, 0x7F7FFFFF], dtype=torch.int32).view(torch.float32)  # finite, near fp32 max
    hi, lo = split(x)
    assert torch.isinf(hi.float()).all() and torch.isfinite(x).all()
    assert torch.equal(merge(hi, lo).view(torch.int32), x.view(torch.int32))


@pytest.mark.skipif(sys.byteorder != "little", reason="the in-place alias needs a little-endian host")
def test_bf16_half_is_the_second_int16_of_each_word_on_little_endian():
    """MindSpeed aliases the bf16 weight into the fp32 buffer; on little-endian hosts it is the high int16."""
    x = _random_finite(10_000, 3)
    j = x.view(torch.int32) + HALF
    words = j.view(torch.int16).view(-1, 2)  # [N, 2] = (low half, high half) in memory order
    hi, lo = split(x)
    assert torch.equal(words[:, 1], hi.view(torch.int16)) and torch.equal(words[:, 0], lo)


def test_shift_and_mask_path_gives_the_same_bits(monkeypatch):
    """The byte-order-independent path (used on big-endian hosts) against the de-interleave path."""
    x = _random_finite(1_000_000, 5)[:900_000].view(1000, 900)  # 2-D, to check shapes too
    hi, lo = split(x)
    monkeypatch.setattr(param_reuse, "LITTLE_ENDIAN", False)
    hi2, lo2 = split(x)
    assert torch.equal(hi.view(torch.int16), hi2.view(torch.int16)) and torch.equal(lo, lo2)
    assert torch.equal(merge(hi2, lo2).view(torch.int32), x.view(torch.int32))
    assert hi2.shape == x.shape and lo2.shape == x.shape


def test_round_half_away_differs_from_torch_cast_only_on_even_ties():
    x = _random_finite(2_000_000, 4)
    diff = int((round_half_away(x).view(torch.int16) != x.bfloat16().view(torch.int16)).sum())
    assert diff == count_ties(x)["rne_mismatches"]


def test_functional_adamw_is_torch_adamw():
    """Both optimizers run torch's single-tensor AdamW on the fp32 master: same bits as torch.optim.AdamW."""
    torch.manual_seed(0)
    w = torch.randn(1000, requires_grad=True)
    ref = torch.optim.AdamW([w], lr=1e-2, weight_decay=0.1, foreach=False)
    master, m, v, step = w.detach().clone(), torch.zeros(1000), torch.zeros(1000), torch.tensor(0.0)
    group = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1}
    for _ in range(5):
        g = torch.randn(1000)
        w.grad = g.clone()
        ref.step()
        ReuseAdamW._adamw(group, master, g, m, v, step)
        assert torch.equal(master, w.detach())


def _tiny(seed=0):
    torch.manual_seed(seed)
    return GPT(preset("smoke")).to(torch.bfloat16)


def _train(models_opts, steps):
    for x, y in batches(4, 32, steps, seed=1):
        for model, opt in models_opts:
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
        yield


def test_reuse_matches_same_rounding_master_bit_for_bit_and_amp_drifts():
    base = _tiny()
    a, b, c = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    oa = ReuseAdamW(a.parameters(), lr=1e-2, chunk_numel=2048)  # several chunks per matrix
    ob = MasterAdamW(b.parameters(), lr=1e-2, rounding="away")
    oc = MasterAdamW(c.parameters(), lr=1e-2)
    drifted = 0
    for _ in _train([(a, oa), (b, ob), (c, oc)], 8):
        for p, q in zip(a.parameters(), b.parameters()):
            assert torch.equal(p.view(torch.int16), q.view(torch.int16))
        for p, q in zip(oa.master_weights(), ob.master_weights()):
            assert torch.equal(p.view(torch.int32), q.view(torch.int32))
        drifted = sum(int((p != q).sum()) for p, q in zip(a.parameters(), c.parameters()))
    assert drifted > 0  # round-half-even training leaves the ties-away trajectory after the first even tie


def test_checkpoint_holds_the_fp32_master_and_resumes_exactly():
    base = _tiny()
    a = copy.deepcopy(base)
    oa = ReuseAdamW(a.parameters(), lr=1e-2)
    for _ in _train([(a, oa)], 3):
        pass
    sd = copy.deepcopy(oa.state_dict())
    assert all("residual" not in s and s["master"].dtype == torch.float32 for s in sd["state"].values())
    assert all(torch.equal(s["master"], m) for s, m in zip(sd["state"].values(), oa.master_weights()))
    b, c = copy.deepcopy(a), copy.deepcopy(a)
    for p in list(b.parameters()) + list(c.parameters()):
        p.data.zero_()  # the checkpoint must restore the bf16 weights from the master too
    ob = ReuseAdamW(b.parameters(), lr=1e-2)
    ob.load_state_dict(sd)
    oc = MasterAdamW(c.parameters(), lr=1e-2, rounding="away")  # a reuse checkpoint loads into the baseline
    oc.load_state_dict(sd)
    for _ in _train([(a, oa), (b, ob), (c, oc)], 3):
        for p, q, r in zip(a.parameters(), b.parameters(), c.parameters()):
            assert torch.equal(p, q) and torch.equal(p, r)


def test_two_bytes_per_parameter_saved_by_storage_and_by_tracker():
    base = _tiny()
    n = count_params(base)
    rows, optim = {}, {}
    for name, make in (("reuse", lambda ps: ReuseAdamW(ps)), ("amp", lambda ps: MasterAdamW(ps))):
        model = copy.deepcopy(base)
        opt = make(list(model.parameters()))
        rows[name] = bytes_by_category(model, opt)
        with MemoryTracker(model, opt) as mem:
            pass
        optim[name] = mem.current()["optim"]
    assert rows["amp"]["param"] == rows["reuse"]["param"] == 2 * n
    assert rows["amp"]["master"] == 4 * n and rows["reuse"]["master"] == 2 * n
    assert rows["amp"]["moments"] == rows["reuse"]["moments"] == 8 * n
    assert optim["amp"] - optim["reuse"] == 2 * n


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="bfloat16"):
        ReuseAdamW([torch.zeros(4, requires_grad=True)])
    with pytest.raises(ValueError, match="bfloat16"):
        MasterAdamW(GPT(preset("smoke")).parameters())
    with pytest.raises(ValueError, match="inf/NaN"):
        ReuseAdamW([torch.tensor([1.0, float("nan")], dtype=torch.bfloat16)])
    with pytest.raises(ValueError, match="finite"):
        split(torch.tensor([1.0, float("inf")]))
    with pytest.raises(ValueError, match="float32"):
        split(torch.zeros(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="chunk_numel"):
        ReuseAdamW([torch.zeros(4, dtype=torch.bfloat16)], chunk_numel=100)
    with pytest.raises(ValueError, match="rounding"):
        MasterAdamW([torch.zeros(4, dtype=torch.bfloat16)], rounding="stochastic")
    # a non-finite gradient stops the step before anything changes
    w = torch.ones(4, dtype=torch.bfloat16)
    opt = ReuseAdamW([w])
    w.grad = torch.tensor([1.0, 0.0, float("inf"), 0.0], dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="gradient of parameter 0"):
        opt.step()
    assert torch.equal(w, torch.ones(4, dtype=torch.bfloat16)) and opt.state[w]["exp_avg"].abs().sum() == 0
    # an update that overflows the bf16 range is reported
    w = torch.full((2,), torch.finfo(torch.bfloat16).max, dtype=torch.bfloat16)  # 0x7F7F
    opt = ReuseAdamW([w], lr=1e36, weight_decay=0.0)
    w.grad = torch.full((2,), -1.0, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bf16 inf"):
        opt.step()


def test_validate_names_the_bad_parameter():
    with pytest.raises(ValueError, match="preset='huge'"):
        l07_param_reuse.validate({"preset": "huge"}, 2)
    with pytest.raises(ValueError, match="steps must be >= 1"):
        l07_param_reuse.validate({"preset": "smoke", "steps": 0}, 2)
    with pytest.raises(ValueError, match="unknown cfg key 'stpes'"):
        l07_param_reuse.validate({"preset": "smoke", "stpes": 3}, 2)
    with pytest.raises(ValueError, match="chunk_numel"):
        l07_param_reuse.validate({"preset": "smoke", "chunk_numel": 100}, 2)
    with pytest.raises(ValueError, match="seq_len"):
        l07_param_reuse.validate({"preset": "smoke", "seq_len": 10_000}, 2)


@pytest.fixture(scope="module")
def dp2():
    # the notebook's smoke run, which the suite's launch cache shares with nbval's
    return launch("l07_param_reuse", 2, {"preset": "smoke"}, timeout_s=300, progress="none")


def test_dp2_sharded_training_is_bit_exact_every_step(dp2):
    for r in dp2:
        assert r["bitexact_steps"] == r["steps"] == 20  # the smoke preset's
        for row in r["ties"]:  # reuse's bf16 differs from torch's cast of its own master exactly on even ties
            assert row["bf16_vs_rne_cast"] == row["rne_mismatches"] <= row["ties"]
    assert dp2[0]["amp_drift"] == dp2[1]["amp_drift"]


def test_dp2_saving_is_the_bf16_copy_over_dp(dp2):
    for r in dp2:
        shard = r["shard_numel"]
        assert r["numel_padded"] == 2 * shard
        reuse, amp = r["bytes_per_param_sharded"]["reuse"]["bytes"], r["bytes_per_param_sharded"]["amp"]["bytes"]
        assert amp["master"] - reuse["master"] == 2 * shard  # 2 B per parameter of my shard = 2 B / dp overall
        assert reuse["param"] == amp["param"] == 2 * r["numel_padded"]  # the bf16 weights stay whole
        t = r["tracked"]
        assert t["amp"]["end"]["optim"] - t["reuse"]["end"]["optim"] == 2 * shard
    total_saved = sum(r["bytes_per_param_sharded"]["amp"]["bytes"]["master"]
                      - r["bytes_per_param_sharded"]["reuse"]["bytes"]["master"] for r in dp2)
    assert total_saved == 2 * dp2[0]["numel_padded"]  # exactly 2 bytes per parameter across the job
