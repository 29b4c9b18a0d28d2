"""A layer at a real model's shapes, timed on a target GPU without computing it (``toolkit.runtime.shapes``):
FakeTensorMode for the tensors, the emulated cluster's op cost model for the time. The trace is checked against
the analytic kernel list of the same layer (``toolkit.models.catalog`` style), not against itself."""
from __future__ import annotations

import pytest
import torch

from toolkit.runtime.cluster import cluster
from toolkit.runtime.efficiency import gemm, kernel_seconds
from toolkit.runtime.shapes import estimate

T, D, F = 2 * 8192, 4096, 14336  # Llama-3-8B's SwiGLU MLP on two sequences of 8192 tokens, bf16


def _build():
    w1, w3 = (torch.nn.Linear(D, F, bias=False, dtype=torch.bfloat16) for _ in range(2))
    w2 = torch.nn.Linear(F, D, bias=False, dtype=torch.bfloat16)
    return w1, w2, w3, torch.empty(T, D, dtype=torch.bfloat16, requires_grad=True)


def _step(w1, w2, w3, x):
    w2(torch.nn.functional.silu(w1(x)) * w3(x)).sum().backward()


def test_a_llama_mlp_at_its_true_shapes_is_timed_without_computing_it():
    est = estimate(_build, _step, "h100-ib400")
    # forward: 3 GEMMs; backward: dX and dW of each (9 in all), exactly the layer's FLOPs
    assert est.flops == 9 * 2 * T * D * F
    gemms = [k.dims[:3] for _, k, _ in est.kernels if k.kind == "gemm"]
    assert sorted(gemms) == sorted([(T, F, D)] * 2 + [(T, D, F)] + [(T, D, F), (F, D, T)] * 2 + [(T, F, D), (D, F, T)])
    g = cluster("h100-ib400").gpu
    analytic = sum(kernel_seconds(gemm(*dims), g.bf16_flops, g.hbm_bytes_per_s, g.sms, g.efficiency) for dims in gemms)
    assert est.by_kind()["gemm"] == pytest.approx(analytic)
    # elementwise passes (SiLU, the product, their backward) at HBM speed: a tenth of the step, not zero
    assert 0.05 < est.by_kind()["memory"] / est.step_s < 0.2
    mfu = est.flops / (est.step_s * g.bf16_flops)
    assert 0.4 < mfu < 0.6  # a training step's share of cuBLAS's rate (Efficiency.step), not the datasheet
    assert est.step_s == est.kernels_s > est.host_s  # GPU-sized work: the host runs ahead
    # memory at the true shapes: the weights and input exactly; during the step the forward's four [T, F] tensors
    # saved for backward (both projections, SiLU, the product) and what backward holds in flight
    assert est.static_bytes == (3 * D * F + T * D) * 2
    assert 4 <= (est.peak_bytes - est.static_bytes) / (T * F * 2) <= 8
    a100 = estimate(_build, _step, "a100-ib200")
    assert 2.5 < a100.step_s / est.step_s < 4  # 312 against 989 TFLOP/s, at their own achieved shares


def test_an_unknown_cluster_is_refused_before_anything_runs():
    with pytest.raises(ValueError, match="cluster='h200' is not a preset"):
        estimate(_build, _step, "h200")


S, D13, F13 = 2048, 5120, 13824  # Llama-2-13B's MLP on one sequence of 2048 tokens


def _tp_mlp(tp: int) -> tuple:
    """One rank of a sequence-parallel, tensor-parallel SwiGLU MLP (Megatron's layout): all-gather the tokens,
    gate+up column-parallel, down row-parallel, reduce-scatter the tokens."""
    import torch.distributed as dist

    def build():
        return (torch.nn.Linear(D13, 2 * F13 // tp, bias=False, dtype=torch.bfloat16),
                torch.nn.Linear(F13 // tp, D13, bias=False, dtype=torch.bfloat16),
                torch.empty(S // tp, D13, dtype=torch.bfloat16))

    def step(up, down, x):
        full = torch.empty(S, D13, dtype=torch.bfloat16)
        dist.all_gather_into_tensor(full, x)
        gate, val = up(full).chunk(2, dim=-1)
        dist.reduce_scatter_tensor(torch.empty(S // tp, D13, dtype=torch.bfloat16),
                                   down(torch.nn.functional.silu(gate) * val))
    return build, step


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_tensor_parallel_ranks_at_true_shapes_on_the_fake_process_group():
    """One process stands for a rank of tp = 2 and tp = 8 (torch's fake process group): the ledger counts the
    collectives' bytes at the true shapes, (n-1)/n of the gathered activations, and the link times them; the
    share of the step in communication grows with tp, as the GEMMs shrink and the gathered bytes do not."""
    share = {}
    for tp in (2, 8):
        est = estimate(*_tp_mlp(tp), "h100-ib400", world_size=tp)
        assert [c["op"] for c in est.comms] == ["all_gather_into_tensor", "reduce_scatter_tensor"]
        assert all(c["sent_bytes"] == (tp - 1) * S * D13 * 2 // tp and c["ranks"] == tp for c in est.comms)
        assert all(c["link"].startswith("NVLink") for c in est.comms)  # eight ranks a node
        assert est.flops == 3 * 2 * S * D13 * F13 / tp
        share[tp] = est.comm_s / est.step_s
    assert share[2] < 0.2 < share[8]
    inter = estimate(*_tp_mlp(8), cluster("h100-ib400", ranks_per_node=4), world_size=8)
    assert inter.comms[0]["link"].startswith("InfiniBand") and inter.comm_s > 1.2 * est.comm_s  # 4 NICs a node


def test_bad_ranks_are_refused():
    for kwargs, words in (({"world_size": 0}, "world_size=0"), ({"world_size": 2, "rank": 2}, "rank=2 must be < "),
                          ({"rank": -1}, "rank=-1")):
        with pytest.raises(ValueError, match=words):
            estimate(_build, _step, **kwargs)
    with pytest.raises(ValueError, match="overlap='bulk' must be one of"):
        estimate(_build, _step, overlap="bulk")


def test_fsdp_overlap_prefetches_each_all_gather_and_leaves_the_reductions_behind():
    """The declared schedules on a hand-made step: four 1 s kernels, an all-gather of 2 s before the first, one of
    0.5 s before the second, a reduce-scatter of 1 s after the third. Bulk: everything in a row (7.5 s). FSDP: the
    first all-gather is exposed (2 s), the second ran during the first kernel, the reduce-scatter behind the last
    kernel (6 s, 2 s exposed)."""
    from toolkit.runtime.efficiency import Kernel
    from toolkit.runtime.shapes import Estimate
    kernels = [("aten.mm", Kernel("gemm", 1.0, 0.0), 1.0)] * 4
    comms = [{"op": "all_gather_into_tensor", "seconds": 2.0, "at": 0},
             {"op": "all_gather_into_tensor", "seconds": 0.5, "at": 1},
             {"op": "reduce_scatter_tensor", "seconds": 1.0, "at": 3}]
    bulk, fsdp = (Estimate("H100", kernels, comms, overlap=o) for o in ("none", "fsdp"))
    assert bulk.step_s == 7.5 and bulk.exposed_s == 3.5
    assert fsdp.step_s == 6.0 and fsdp.exposed_s == 2.0
    comms[2]["seconds"] = 3.0  # a reduction longer than what follows it: the step waits for it at the end
    assert Estimate("H100", kernels, comms, overlap="fsdp").step_s == 8.0


def test_fsdp_sharded_parameters_and_their_optimizer_count_one_rank_s_shard():
    """Under torch's FSDP2 on the fake process group, a parameter is a DTensor: the memory counts this rank's
    shard, and the fused optimizer's in-place kernel (no tensor returned) is timed on the shard's bytes."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    def build():
        with unset_fake_temporarily():
            mesh = init_device_mesh("cpu", (8,))
        lin = fully_shard(torch.nn.Linear(4096, 4096, bias=False), mesh=mesh)
        opt = torch.optim.AdamW(lin.parameters(), fused=True)
        lin.weight.grad = torch.zeros_like(lin.weight)
        opt.step()  # the moments exist: a step in steady state
        return lin, torch.empty(8192, 4096), opt

    def step(lin, x, opt):
        lin(x).sum().backward()
        opt.step()
    est = estimate(build, step, "h100-ib400", world_size=8, overlap="fsdp")
    shard = 4096 * 4096 * 4 // 8
    assert est.static_bytes == shard + 8192 * 4096 * 4  # the weight's shard and the input
    adam = [k for name, k, _ in est.kernels if name == "aten._fused_adamw_"]
    assert len(adam) == 1 and shard * 3 <= adam[0].bytes <= shard * 5  # params, grads, two moments (+ the step)
    assert [c["op"] for c in est.comms] == ["all_gather_into_tensor", "reduce_scatter_tensor"]
