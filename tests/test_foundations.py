"""Lesson 00's own pieces: checkpoint policies, mixed precision, NCCL settings check, planner, lesson validation."""
from __future__ import annotations

import copy

import pytest
import torch

from toolkit.comm.bandwidth import bus_factor, check_nccl_settings, parse_exports
from toolkit.data import batches
from toolkit.lessons import l00_foundations
from toolkit.memory.checkpointing import POLICIES, apply_checkpointing
from toolkit.runtime.memory import saved_activation_bytes
from toolkit.models import GPT, preset
from toolkit.planner import Workload, memory_per_gpu, plan, validate_memory_model
from toolkit.precision import train


def test_checkpoint_policies_keep_less_and_reproduce_grads_bitwise():
    torch.manual_seed(0)
    cfg = preset("smoke")
    base = GPT(cfg)
    x, y = next(batches(2, cfg.seq_len, 1))
    saved, grads = {}, {}
    for policy in POLICIES:
        model = apply_checkpointing(copy.deepcopy(base), policy)
        saved[policy], loss = saved_activation_bytes(lambda: model(x, y), list(model.parameters()))
        loss.backward()
        grads[policy] = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert all(torch.equal(grads[p], grads["none"]) for p in POLICIES)
    assert saved["block"] < saved["mlp"] < saved["none"] and saved["attn"] < saved["none"]
    # a block checkpoint keeps exactly each block's input [B,T,D] fp32, the head's saved tensors unchanged
    block_inputs = cfg.n_layer * 2 * cfg.seq_len * cfg.d_model * 4
    assert saved["none"] - saved["block"] > 0 and saved["block"] >= block_inputs
    with pytest.raises(ValueError, match="policy='half' is not known"):
        apply_checkpointing(base, "half")


def test_saved_bytes_count_each_storage_once():
    a = torch.randn(4, 6, requires_grad=True)
    w = torch.randn(6, 6, requires_grad=True)
    def forward():
        qkv = a @ w                          # [4,6], saved views below share its storage
        q, k = qkv[:, :3], qkv[:, 3:]
        return (q * k).sum()
    saved, _ = saved_activation_bytes(forward, [w])
    assert saved == 4 * 6 * 4 + 4 * 6 * 4    # `a` (saved by matmul) + qkv once, not q and k separately


def test_mixed_precision_modes_train_and_report_bytes():
    cfg = preset("smoke")
    fp32 = train("fp32", cfg, 3, 2)
    master = train("bf16_master", cfg, 3, 2)
    assert fp32["bytes_per_param"] == {"weights": 4.0, "grads": 4.0, "master": 0.0, "optimizer": 8.0}
    assert master["bytes_per_param"] == {"weights": 2.0, "grads": 2.0, "master": 4.0, "optimizer": 8.0}
    assert abs(master["losses"][-1] - fp32["losses"][-1]) < 0.05
    with pytest.raises(ValueError, match="mode='int8' is not known"):
        train("int8", cfg, 1, 1)


def test_nccl_settings_check_flags_what_is_wrong():
    values, repeated = parse_exports("export NCCL_PROTO=LL,llvm\nexport NCCL_FOO=1 # x\nexport NCCL_PROTO=Simple\n")
    assert values == {"NCCL_PROTO": "Simple", "NCCL_FOO": "1"} and repeated == ["NCCL_PROTO"]
    rows = {r["variable"]: r["verdict"] for r in check_nccl_settings({"NCCL_PROTO": "LL,llvm", "NCCL_FOO": "1",
                                                                       "NCCL_ALGO": "^Tree"})}
    assert rows == {"NCCL_PROTO": "unknown value(s) ['llvm']; allowed: LL, LL128, Simple",
                    "NCCL_FOO": "not a documented NCCL variable", "NCCL_ALGO": "ok"}
    assert bus_factor("all_reduce", 4) == 1.5 and bus_factor("all_gather", 4) == 0.75
    with pytest.raises(ValueError, match="op='gather'"):
        bus_factor("gather", 2)


def test_planner_memory_formulas_and_ranking():
    w = Workload(params=8e9)
    m0 = memory_per_gpu(w, dp=8, tp=1, pp=1, zero=0)
    m3 = memory_per_gpu(w, dp=8, tp=1, pp=1, zero=3)
    assert m0["weights"] == 16e9 and m0["grads"] == 16e9 and m0["optimizer"] == 96e9
    assert m3["weights"] == 2e9 and m3["grads"] == 2e9 and m3["optimizer"] == 12e9
    rows = plan(Workload(), "h100-ib400", gpus=64)
    assert rows[0]["fits"] and all(a["step_s"] <= b["step_s"] for a, b in zip(rows, rows[1:]) if a["fits"] and b["fits"])
    assert all(r["dp"] * r["tp"] * r["pp"] == 64 for r in rows)
    check = validate_memory_model(1000, 2, {"zero1": {"params": 4000, "grads": 4000, "optim": 4000}})
    assert [r["ratio"] for r in check] == [1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="zero=4 is not allowed"):
        memory_per_gpu(w, 1, 1, 1, 4)


@pytest.mark.parametrize("cfg, world, match", [
    ({"preset": "tiny"}, 2, "preset='tiny' is not known"),
    ({"preset": "smoke"}, 1, "needs at least 2 ranks"),
    ({"preset": "smoke", "sections": ["bench", "nope"]}, 2, "every item of sections='nope' is not allowed"),
    ({"preset": "smoke", "precision_steps": 0}, 2, "precision_steps must be >= 1"),
    ({"preset": "smoke", "pp_microbatches": 8}, 2, "unknown cfg key 'pp_microbatches'"),
    ({"preset": "smoke", "m": 2}, 4, "m=2 micro-batches must be >= the 4 pipeline stages"),
    ({"preset": "smoke", "dp_timing": ["zero4"]}, 2, "dp_timing"),
])
def test_lesson00_rejects_bad_config(cfg, world, match):
    with pytest.raises(ValueError, match=match):
        l00_foundations.validate(cfg, world)
