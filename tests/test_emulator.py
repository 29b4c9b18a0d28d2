"""The emulated cluster's mechanics on real processes, as relations between the times of one run — never the
model's own formulas (``tests/test_calibration.py`` checks the model's figures against published measurements).

(a) every op's time grows with its size, and a group that spans nodes takes longer than one inside a node
(b) a late rank delays the collective by its lateness (measured on that rank)
(c) an async op under compute: at least the longer of the two, less than their sum; the compute that overlaps the
    collective runs on fewer SMs, so it ends later than alone        (d) two transfers share a rank's link
(e) pipeline schedules = toolkit.pipeline.simulate fed the same op times and link, within 5 %
(f) the same job at 2 and at 4 ranks on 2 cores: the same virtual time      (g) results bitwise those without it
(h) a host read (``host_read``) makes the host wait for its stream; ``paused()`` stops the clock, not the run
(i) a run re-timed from its trace: unchanged figures give its virtual times exactly; other figures give what a
    fresh run on them gives
"""
from __future__ import annotations

import pytest

from toolkit import launch
from toolkit.pipeline.schedule import make_schedule
from toolkit.pipeline.simulate import simulate
from toolkit.runtime.cluster import PRESETS, Link, cluster
from toolkit.runtime.launch import check_cluster

CHECKS = "toolkit.lessons.emulator_check"
FP32 = cluster("h100-ib400", ranks_per_node=2, float_bytes=4)  # two nodes of two; tensors timed as they are (fp32)
SCHEDULES = ["1f1b", "interleaved", "zb-h1", "dualpipev"]


@pytest.fixture(scope="module")
def emulated():
    return launch(CHECKS, 4, {}, cluster=FP32, progress="none", timeout_s=300)


@pytest.fixture(scope="module")
def plain():
    return launch(CHECKS, 4, {}, progress="none", timeout_s=300)


def test_a_every_op_grows_with_its_size_and_is_slower_across_nodes(emulated):
    rows = [row for result in emulated for row in result["ops"]]
    assert {(r["op"], r["link"]) for r in rows} == {(op, link) for op in ("send", "all_reduce", "all_gather",
                                                                         "reduce_scatter", "all_to_all")
                                                    for link in ("intra", "inter")}
    sizes = sorted({r["bytes"] for r in rows})
    assert len(sizes) == 3
    for op in ("send", "all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        for link in ("intra", "inter"):
            t = [max(r["virtual_s"] for r in rows if (r["op"], r["link"], r["bytes"]) == (op, link, b)) for b in sizes]
            assert t[0] < t[1] < t[2], (op, link, t)
        intra, inter = ([max(r["virtual_s"] for r in rows if (r["op"], r["link"], r["bytes"]) == (op, k, sizes[-1]))
                         for k in ("intra", "inter")])
        assert inter > intra, (op, intra, inter)


def test_b_a_late_rank_delays_the_collective_by_its_lateness(emulated):
    skew = [r["skew_s"] for r in emulated]
    late = emulated[1]["late_s"]
    assert late > 0 and skew[0] == skew[1] and skew[2] == skew[3]  # a collective ends together on its ranks
    assert skew[0] == pytest.approx(skew[2] + late, rel=1e-9)  # node 1's pair was not late


def test_c_an_async_op_under_compute_hides_the_shorter_and_overlap_costs_the_compute_sms(emulated):
    comm = emulated[2]["skew_s"]  # the same 4 MiB all_reduce on the pair, alone
    for r in emulated:
        short, long_ = (r["matmul_s"][str(n)] for n in r["matmul_n"])
        assert short < comm < long_  # one case of each
        for n, alone in ((r["matmul_n"][0], short), (r["matmul_n"][1], long_)):
            both = r["async_s"][str(n)]
            assert max(comm, alone) <= both < comm + alone
        # the long matmul overlaps the whole transfer: it loses the SMs NCCL's channels take for that long
        share = FP32.intra.channels / FP32.gpu.sms
        assert r["async_s"][str(r["matmul_n"][1])] > long_ + 0.5 * comm * share / (1 - share)


def test_d_two_transfers_of_one_rank_share_its_link(emulated):
    for r in emulated:
        assert r["sharing_s"]["second"] == pytest.approx(2 * r["sharing_s"]["first"], rel=1e-9)


def test_f_the_same_job_at_2_and_at_4_ranks_takes_the_same_virtual_time(emulated):
    two = launch(f"{CHECKS}:exchange", 2, {}, cluster=cluster("h100-ib400", float_bytes=4), progress="none",
                 timeout_s=120)
    times = [r["exchange_s"] for r in list(two) + list(emulated)]
    # equal to the rounding of the clocks' different offsets (the 4-rank run did more before), whatever the load
    assert times == pytest.approx([times[0]] * 6, rel=1e-12)
    assert times[0] > 0


def test_g_emulation_changes_no_result_and_models_communication(emulated, plain):
    assert [r["checksum"] for r in emulated] == [r["checksum"] for r in plain]
    assert all(r["totals"]["comm_s"] > 0 and r["totals"]["exposed_s"] > 0 for r in emulated)
    assert all(r["totals"] is None and r["ops"][0]["virtual_s"] is None for r in plain)


def test_h_a_host_read_waits_for_the_stream_and_pausing_stops_the_clock():
    h100 = cluster("h100-ib400", float_bytes=4)
    emulated = launch(f"{CHECKS}:host", 2, {}, cluster=h100, progress="none", timeout_s=300)
    plain = launch(f"{CHECKS}:host", 2, {}, progress="none", timeout_s=300)
    for r in emulated:
        # without the read the host issued the short matmul while the long one ran; with it, only after
        assert r["host_read_s"] > r["tolist_s"]
        assert r["paused_moved_s"] == 0 and r["paused_calls"] == 1  # counted by the ledger, not timed
    assert [r["checksum"] for r in emulated] == [r["checksum"] for r in plain]


def test_i_a_replay_gives_the_run_back_and_times_it_on_other_figures_as_a_fresh_run():
    slow = cluster("h100-ib400", float_bytes=4).perturbed(compute=0.5, bandwidth=0.25)
    base = launch(f"{CHECKS}:replayed", 2, {"other": slow.to_dict()}, cluster=cluster("h100-ib400", float_bytes=4),
                  progress="none", timeout_s=300)
    fresh = launch(f"{CHECKS}:replayed", 2, {"other": None}, cluster=slow, progress="none", timeout_s=300)
    for r, f in zip(base, fresh):
        assert r["replayed_same"] == r["live"]  # exactly
        assert r["replayed_other"] == pytest.approx(f["live"], rel=0.01)
        assert r["replayed_other"] > r["live"]  # it changed: slower compute and links


@pytest.mark.parametrize("p", [2, 4])
def test_e_pipeline_schedules_take_the_simulators_time_fed_the_same_op_times(p):
    h100 = cluster("h100-ib400")
    results = launch(f"{CHECKS}:pipeline", p, {"schedules": SCHEDULES}, cluster=h100, progress="none", timeout_s=400)
    b, t, d = results[0]["act_shape"]
    comm = h100.intra.seconds(b * t * d * 2)  # one activation or gradient in bf16, sent between neighbours
    for name in SCHEDULES:
        durations = {(s["op"], s["stage"], s["mb"], s["chunk"]): s["virtual_s"] for r in results for s in r[name]["spans"]}

        def cost(a):
            return sum(durations[(h.op, h.stage, h.mb, h.chunk)] for h in (a.sub or (a,)))
        cost.comm = comm
        predicted = simulate(make_schedule(name, p, 2 * p), cost).makespan
        step = max(r[name]["step_s"] for r in results)
        assert step == pytest.approx(predicted, rel=0.05), (name, step, predicted)
    if p == 2:  # (g) for a training step: losses and gradients bitwise those of the run without emulation
        real = launch(f"{CHECKS}:pipeline", p, {"schedules": SCHEDULES}, progress="none", timeout_s=400)
        for name in SCHEDULES:
            assert [(r[name]["loss"], r[name]["grads"]) for r in results] == \
                   [(r[name]["loss"], r[name]["grads"]) for r in real]


@pytest.mark.parametrize("spec, match", [
    ("h200-dream", "not a preset; presets: \\['a100-ib200', 'h100-ib400', 'pcie-100gbe'\\]"),
    (cluster("h100-ib400", ranks_per_node=3), "ranks_per_node=3 does not divide world_size=4"),
    ({"name": "x"}, "cluster must be a preset name or a Cluster"),
])
def test_bad_cluster_is_refused_before_launch(spec, match):
    with pytest.raises(ValueError, match=match):
        launch(CHECKS, 4, {}, cluster=spec, progress="none")


@pytest.mark.parametrize("field, value, match", [
    ("intra", Link("x", 0.0, 1e-6), "intra.bytes_per_s must be a finite number > 0"),
    ("inter", Link("x", 1e9, -1.0), "inter.latency_s must be a finite number > 0"),
    ("ranks_per_node", 9, "ranks_per_node must be None or an int in 1..gpus_per_node=8"),
])
def test_bad_figures_name_the_field(field, value, match):
    with pytest.raises(ValueError, match=match):
        cluster("a100-ib200", **{field: value})


def test_bad_peak_is_refused_and_nccl_sets_the_cluster_aside():
    import dataclasses
    gpu = dataclasses.replace(PRESETS["h100-ib400"].gpu, bf16_flops=0.0)
    with pytest.raises(ValueError, match="gpu.bf16_flops must be a finite number > 0"):
        cluster("h100-ib400", gpu=gpu)
    with pytest.warns(UserWarning, match="not emulated with backend 'nccl': on real GPUs the real time"):
        assert check_cluster("h100-ib400", 2, "nccl") is None
    with pytest.raises(ValueError, match="cluster"):  # still checked first
        check_cluster("no-such-cluster", 2, "nccl")


def test_virtual_clock_without_a_cluster_is_refused():
    from toolkit.runtime.bench import measure
    with pytest.raises(ValueError, match="clock='virtual' needs an emulated cluster"):
        measure(lambda: None, clock="virtual")


def _dispatched(fn) -> list[tuple]:
    """(func, args, kwargs, out) of every ATen op ``fn`` runs (no process group: the op costs only)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            seen.append((func, args, kwargs or {}, out))
            return out

    with Record():
        fn()
    return seen


def test_factorisations_have_golub_van_loan_flops_and_out_buffers_are_only_written():
    import torch
    from toolkit.runtime.opcost import OpKind, _flop_formulas
    formulas = _flop_formulas()

    def op_cost(func, args, kwargs, out, float_bytes, formulas):
        k = OpKind(func, formulas).kernel(args, kwargs, out, float_bytes)
        return k.flops, k.bytes
    a = torch.randn(3, 64, 8)  # a batch of thin matrices, as PowerSGD orthogonalises: l = 64, k = 8
    q, r = a.clone(), torch.empty(3, 8, 8)
    ops = [(f, args, kw, out) for f, args, kw, out in _dispatched(lambda: (
        torch.linalg.qr(a), torch.linalg.qr(a, mode="r"), torch.linalg.qr(a, out=(q, r)),
        torch.ops.aten._linalg_svd(a[0], compute_uv=False),  # svdvals under a dispatch mode computes U and V too
        torch.linalg.svd(a[0], full_matrices=False), torch.linalg.svd(a[0], full_matrices=True)))
        if "qr" in str(f) or "svd" in str(f)]
    geqrf = 2 * 64 * 8 ** 2 - 2 * 8 ** 3 / 3  # Householder QR; forming Q costs as much again
    assert [op_cost(*op, 4, formulas)[0] for op in ops] == [
        int(3 * 2 * geqrf), int(3 * geqrf), int(3 * 2 * geqrf),
        int(4 * 64 * 8 ** 2 - 4 * 8 ** 3 / 3), int(14 * 64 * 8 ** 2 + 8 * 8 ** 3),
        int(4 * 64 ** 2 * 8 + 8 * 64 * 8 ** 2 + 9 * 8 ** 3)]
    assert str(ops[2][0]) == "aten.linalg_qr.out"  # A read; Q and R only written
    assert op_cost(*ops[2], 4, formulas)[1] == 4 * (3 * 64 * 8 + 3 * 64 * 8 + 3 * 8 * 8)


def test_a_quantize_call_is_timed_as_the_one_triton_kernel_a_gpu_runs():
    import types

    import torch
    from toolkit.quant import dequantize_blockwise, quantize_blockwise
    from toolkit.runtime.emulator import Emulator
    emu = Emulator(cluster("h100-ib400"), 0, 1).install(types.SimpleNamespace(observer=None))
    try:
        x = torch.randn(4096)
        q = quantize_blockwise(x, bits=4, block=128, stochastic=True, seed=1)
        dequantize_blockwise(q)
        ops = {name: dict(row) for name, row in emu.ops.items()}
        before = emu.now()
        with emu.paused():  # a paused emulator charges no kernel either
            dequantize_blockwise(quantize_blockwise(x, bits=4, block=128))
        assert emu.now() == before and emu.ops["quantize_int (Triton kernel)"]["calls"] == 1
    finally:
        emu.uninstall()
    # the reference's passes (its integer hash for stochastic rounding, the packing) are not charged, the kernel is:
    # x read (floats at bf16: 2 bytes), 4-bit codes and a scale per 128 written; then read back, floats written
    assert not any(name in ops for name in ("aten.bitwise_xor", "aten.__rshift__", "aten.bitwise_and"))
    quantize, dequantize = ops["quantize_int (Triton kernel)"], ops["dequantize (Triton kernel)"]
    assert quantize["calls"] == dequantize["calls"] == 1
    assert quantize["launch_s"] == PRESETS["h100-ib400"].gpu.efficiency.host_op_s  # one eager op of the host
    assert quantize["bytes"] == dequantize["bytes"] == 4096 * 2 + 4096 / 2 + 4096 / 128 * 2


def test_paused_takes_the_timer_off_the_dispatch_stack_and_hides_the_emulator_on_that_thread():
    import threading
    import types

    import torch
    from torch.utils._python_dispatch import _get_current_dispatch_mode
    from toolkit.runtime.emulator import ComputeTimer, Emulator, current
    ledger = types.SimpleNamespace(observer=None)
    emu = Emulator(cluster("h100-ib400"), 0, 1).install(ledger)
    try:
        a, seen = torch.ones(64, 64), {}
        assert isinstance(_get_current_dispatch_mode(), ComputeTimer) and current() is emu and ledger.observer is emu
        with emu.paused():
            with emu.paused():  # nested: nothing more to take off
                torch.mm(a, a)
            seen["mode"], seen["current"] = _get_current_dispatch_mode(), current()
            work = object()  # the ledger's calls pass through until the outer pause ends (any thread's)
            seen["passed"] = emu.on_collective("all_reduce", None, 0, (), {}, work, True, "t") is work
            other = threading.Thread(target=lambda: seen.__setitem__("thread", current()))
            other.start()
            other.join()
            calls = emu.ops["aten.mm"]["calls"]
        assert seen["mode"] is None and seen["current"] is None and calls == 0  # native ops, no emulator here
        assert seen["passed"] and ledger.observer is emu  # collectives carry no clock inside
        assert seen["thread"] is emu  # pausing is per thread
        assert isinstance(_get_current_dispatch_mode(), ComputeTimer) and current() is emu
        torch.mm(a, a)
        assert emu.ops["aten.mm"]["calls"] == 1
    finally:
        emu.uninstall()


def test_ops_are_bitwise_unchanged_except_the_spectral_values_torch_computes_otherwise_under_a_dispatch_mode():
    """The emulator runs every op as it is, so results are bitwise those of a plain run; the one exception is
    torch's: under any Python dispatch mode the composites that return singular or eigen values only also compute
    the vectors (``_may_require_fw_or_bw_grad``), a LAPACK path whose values differ in the last bits. This pins
    both sides and the bound the emulator's docstring states (in float64 within 1e-12 of the largest value: a
    backward-stable algorithm's error is relative to the matrix's norm), so a torch that changes either shows up
    here."""
    import types

    import torch
    import torch.nn.functional as F
    from toolkit.runtime.emulator import Emulator
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(200, 130, generator=gen, dtype=torch.float64)
    sq = torch.randn(100, 100, generator=gen, dtype=torch.float64)
    bitwise = {"mm": lambda: a @ a.T, "sum": lambda: a.sum(0), "qr": lambda: torch.linalg.qr(a)[1],
               "svd": lambda: torch.linalg.svd(a, full_matrices=False)[1], "pinv": lambda: torch.linalg.pinv(a),
               "matrix_rank": lambda: torch.linalg.matrix_rank(a), "eigvals": lambda: torch.linalg.eigvals(sq),
               "solve": lambda: torch.linalg.solve(sq, sq[:, :3]), "slogdet": lambda: torch.linalg.slogdet(sq)[1],
               "std": lambda: a.std(0), "softmax": lambda: a.softmax(0),
               "layer_norm": lambda: F.layer_norm(a, (130,)), "fro": lambda: torch.linalg.matrix_norm(a),
               "cross_entropy": lambda: F.cross_entropy(a, torch.arange(200) % 130)}
    spectral = {"svdvals": lambda: torch.linalg.svdvals(a), "eigvalsh": lambda: torch.linalg.eigvalsh(a @ a.T),
                "matrix_norm(ord=2)": lambda: torch.linalg.matrix_norm(a, ord=2),
                "matrix_norm(ord='nuc')": lambda: torch.linalg.matrix_norm(a, ord="nuc"),
                "cond": lambda: torch.linalg.cond(a)}
    plain = {k: f() for k, f in {**bitwise, **spectral}.items()}
    emu = Emulator(cluster("h100-ib400"), 0, 1).install(types.SimpleNamespace(observer=None))
    try:
        emulated = {k: f() for k, f in {**bitwise, **spectral}.items()}
    finally:
        emu.uninstall()
    assert [k for k in bitwise if not torch.equal(emulated[k], plain[k])] == []
    moved = [k for k in spectral if not torch.equal(emulated[k], plain[k])]
    assert moved, "every spectral value is bitwise now: the docstring's exception can go"
    for k in spectral:
        assert (emulated[k] - plain[k]).abs().max() <= 1e-12 * plain[k].abs().max(), k
