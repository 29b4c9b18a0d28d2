"""Vocabulary parallelism: sharded loss/grads equal the unsharded head on real processes, the ledger's bytes,
balance, the runs on the emulated cluster (schedules from virtual pass costs, the comm thread's time carried),
the deterministic paper-scale simulation, the paper's setting traced at its true shapes, and bad input."""
from __future__ import annotations

import random
from dataclasses import replace

import pytest

import torch

from toolkit import launch
from toolkit.lessons import l13_vocab_parallel as lesson
from toolkit.pipeline import vocab_parallel as vp
from toolkit.pipeline import vocab_passes as vx
from toolkit.pipeline.executor import PipelineExecutor
from toolkit.pipeline.schedule import Action, one_f_one_b
from toolkit.pipeline.simulate import simulate
from toolkit.models.matched import dense_layer_op
from toolkit.runtime.cluster import cluster

P = 4
M = lesson.PRESETS["smoke"]["m"]
PAPER = lesson.PAPER
A100 = cluster("a100-ib200")


@pytest.fixture(scope="module")
def results():  # on the notebook's emulated cluster: results are bitwise those without it
    return launch("l13_vocab_parallel", P, {"preset": "smoke"}, timeout_s=600, progress="none", cluster="h100-ib400")


# ---- real processes ---------------------------------------------------------------------------------
def test_loss_and_grads_equal_unsharded_head(results):
    for name in lesson.RUNS:
        for r in results:  # every rank has the loss; each rank checks what it owns
            assert abs(r["runs"][name]["loss"] - results[0]["ref_loss"]) <= lesson.TOL, (name, r["rank"])
            assert r["runs"][name]["max_grad_diff"] <= lesson.TOL, (name, r["rank"])


def test_the_run_is_the_simulators_schedule(results):
    """The action lists that ran are vocab_1f1b's from the gathered pass times (identical on every rank)."""
    for alg in vp.ALGORITHMS:
        _, rows = lesson.measured_rows(results, alg)
        want = vp.vocab_1f1b(P, M, alg, vp.StageCosts(rows)).to_strings()
        assert all(r["schedules"][f"vocab-{alg}"] == want for r in results)
        assert {a[1] for acts in want for a in acts} == {"F", "B", "S", "T"}


def test_collectives_issued_in_the_same_order_on_every_rank(results):
    for name in ("vocab-1", "vocab-2"):
        orders = []
        for r in results:
            per_group: dict[str, list[str]] = {}
            for group, what in r["runs"][name]["collectives"]:
                per_group.setdefault(group, []).append(what)
            orders.append(per_group)
        assert all(o == orders[0] for o in orders)
        assert orders[0]["c0"] == [f"C0 {i}" for i in range(M)]
        assert ("c1" in orders[0]) == (name == "vocab-1") and ("dx" in orders[0]) == (name == "vocab-2")


def test_activations_p_plus_2_and_p_plus_1_micro_batches(results):
    """Rank 0 holds p+2 (Algorithm 1) and p+1 (Algorithm 2) micro-batches of stage activations, counted and in
    bytes (every forward saves the same bytes); the schedule says so too."""
    for alg in vp.ALGORITHMS:
        name = f"vocab-{alg}"
        _, rows = lesson.measured_rows(results, alg)
        sim = simulate(vp.vocab_1f1b(P, M, alg, vp.StageCosts(rows)), vp.StageCosts(rows))
        held = [r["runs"][name]["peak_held"] for r in results]
        assert held == [int(x) for x in sim.peak_mb] and held[0] == P + 3 - alg
        run0 = results[0]["runs"][name]
        assert run0["peak_act_bytes"] == held[0] * run0["forward_bytes"][0]
        assert run0["peak_total"] > run0["peak_act_bytes"]  # plus S→T state


def test_c0_runs_on_the_comm_thread(results):
    for r in results:
        for name in ("vocab-1", "vocab-2"):
            run = r["runs"][name]
            assert sorted(s["mb"] for s in run["comm_spans"] if s["kind"] == "C0") == list(range(M))
            assert sum(w["msg"] == "C0" for w in run["waits"]) == M  # each T waited for its C0 (maybe 0 s)
            assert all(s["end"] >= s["start"] for s in run["comm_spans"])


def test_extra_collectives_bytes_from_the_ledger(results):
    cfg = lesson.validate({"preset": "smoke"}, P)
    N, D = cfg["micro_batch"] * cfg["seq_len"], cfg["d_model"]
    ring = lambda s: 2 * (P - 1) * s // P
    for r in results:
        for alg, last in ((1, "c1"), (2, "dx")):
            comm = r["runs"][f"vocab-{alg}"]["comm"]
            assert comm["input:all_reduce"] == ring(N * D * 4) and comm["input:broadcast"] == N * D * 4
            assert comm["x:broadcast"] == N * D * 4 and comm["c0:all_reduce"] == ring(N * 4) + ring(2 * N * 4)
            assert comm[f"{last}:all_reduce"] == ring(N * D * 4)
            closed = vp.collective_bytes(P, N, D, alg)  # the technique's closed form, as the notebook uses it
            assert closed == {k: b for k, b in comm.items() if k in closed} and len(closed) == 5
            inner = 0 < r["rank"] < P - 1
            assert comm["world:isend"] == N * D * 4 * (2 if inner else 1)


def test_algorithm_2_state_keeps_g_and_h():
    torch.manual_seed(0)
    x, w, target = torch.randn(6, 4), torch.randn(8, 4), torch.randint(0, 16, (6,))
    one, two = (vp.s_pass(x, w, target, 8, alg) for alg in vp.ALGORITHMS)
    assert vp.state_bytes(two) - vp.state_bytes(one) == 2 * 6 * 4 * 4  # G_i and H_i, [N, D] each


def test_vocab_passes_bad_input():
    groups = dict.fromkeys(vx.GROUPS)
    with pytest.raises(ValueError, match="runs a VocabSchedule"):
        PipelineExecutor(one_f_one_b(2, 2), 0, {0: torch.nn.Identity()}, None, (1, 2, 4),
                         hooks=[vx.VocabPasses(None, groups)])
    with pytest.raises(ValueError, match=r"groups lacks \['c0', 'c1', 'dx', 'input', 'x'\]"):
        vx.VocabPasses(None, {})
    costs = vp.StageCosts([{"F": 1, "B": 2, "S": 1, "T": 1}] * 2)
    with pytest.raises(ValueError, match=r"nothing runs ops \['S', 'T'\]"):
        PipelineExecutor(vp.vocab_1f1b(2, 2, 2, costs), 0, {0: torch.nn.Identity()}, None, (1, 2, 4))
    with pytest.raises(ValueError, match="algorithm=3"):
        vp.collective_bytes(2, 4, 8, 3)


def test_parameters_balanced(results):
    base = [r["param_bytes"]["baseline"] for r in results]
    ours = [r["param_bytes"]["vocab"] for r in results]
    assert max(ours) / min(ours) <= 1.1 < 3 < max(base) / min(base)
    assert sum(ours) == sum(base)  # the same parameters, placed differently


def test_timings_and_calibration_present(results):
    for r in results:
        assert all(v > 0 for v in r["times"].values())
    cal = results[0]["calibration"]
    assert cal["matmul_flops"] > 0 and cal["mem_bw"] > 0 and cal["op_overhead_s"] > 0
    rows = lesson.cost_model_check(lesson.validate({"preset": "smoke"}, P), results)
    assert len(rows) == 2 * P and all(row["model_ms"] > 0 for row in rows)


def test_emulated_runs_use_the_virtual_schedules_and_carry_the_comm_threads_time(results):
    """On the emulated cluster, in each view (toy, matched to the paper's layer): every rank built the vocabulary
    schedules from every rank's pass costs on the virtual clock (identical on every rank, as ``vocab_1f1b`` makes
    them from the gathered times); the matched passes are the toy's at the layer's scale (longer); each C0 and dX
    job on the comm thread starts no earlier than its hand-over, which lies inside the S pass that handed it over
    (not always at its recorded end: a comm kernel the other thread issues later may still stretch the S pass's
    kernels by the SMs it takes, ``vclock.RankClock.issue``), and each T pass ends after its
    C0 has (its wait moved the main thread's clock); each run's step is on every rank's virtual clock."""
    E = [r["emulated"] for r in results]
    scales = E[0]["scales"]
    cfg = lesson.PRESETS["smoke"]
    toy = dense_layer_op(cfg["micro_batch"] * cfg["seq_len"], cfg["d_model"], 4 * cfg["d_model"])
    real = dense_layer_op(**{k: lesson.PAPER_LAYER[k] for k in ("tokens", "hidden", "ffn")})
    assert scales == pytest.approx({"flops": real["gemm_flops"] / toy["gemm_flops"],
                                    "bytes": real["wire_bytes"] / toy["wire_bytes"]})
    for view in ("toy", "matched"):
        gathered = [e[view]["times"] for e in E]
        for alg in vp.ALGORITHMS:
            _, rows = lesson.measured_rows([{"times": t} for t in gathered], alg)
            built = vp.vocab_1f1b(P, M, alg, vp.StageCosts(rows)).to_strings()
            assert all(e[view]["schedules"][f"vocab-{alg}"] == built for e in E)
        for e in E:
            for name in lesson.RUNS:
                run = e[view]["runs"][name]
                assert run["bench"]["clock"] == "virtual" and run["bench"]["mean_s"] > 0
                assert all("vstart" in sp for sp in run["spans"])
            for name in ("vocab-1", "vocab-2"):
                run = e[view]["runs"][name]
                s_span = {sp["meta"]["mb"]: (sp["vstart"], sp["vend"]) for sp in run["spans"] if sp["kind"] == "S"}
                t_end = {sp["meta"]["mb"]: sp["vend"] for sp in run["spans"] if sp["kind"] == "T"}
                c0_end = {}
                for job in run["comm_spans"]:  # handed over inside its S pass (at the end of its kernels so far)
                    s_start, s_end = s_span[job["mb"]]
                    assert s_start <= job["vhanded"] <= s_end
                    assert job["vstart"] >= job["vhanded"] and job["vend"] >= job["vstart"]
                    if job["kind"] == "C0":
                        c0_end[job["mb"]] = job["vend"]
                assert sorted(c0_end) == list(range(M))
                assert all(t_end[mb] > c0_end[mb] for mb in range(M))  # T computes after its wait for C0
    for r in results:  # the layer's scale makes every pass longer
        assert all(r["emulated"]["matched"]["times"][k] > r["emulated"]["toy"]["times"][k]
                   for k in ("blocks_FB", "S2", "T2"))


# ---- cost model and simulation (deterministic) --------------------------------------------------------
def test_stage_balance_in_the_cost_model():
    for layout, bound in (("vocab", 1.1),):
        flops = vp.stage_flops(PAPER, 8, layout)
        times = [sum(row[k] for k in "FBST") for row in vp.stage_costs(PAPER, 8, A100, layout)]
        assert max(flops) / min(flops) <= bound and max(times) / min(times) <= bound
    base = vp.stage_flops(PAPER, 8, "baseline")
    assert base[-1] / base[1] > 2  # the head and softmax make the last stage > 2x a middle one at 256k


def test_cost_model_reads_the_cluster_and_the_efficiency():
    """The passes' kernels timed by the GPU's efficiency model (the emulated cluster's); the vocabulary passes'
    collectives on the link the stages span; a CPU described by its achieved rates: a roofline of them plus its
    fixed cost per op."""
    from toolkit.runtime.efficiency import Kernel, kernel_seconds, memory
    ops = [Kernel("gemm", 2e12, 1e9), memory(8e9)]  # one compute-bound op (no shape: the plateau), one memory-bound
    g = A100.gpu
    assert vp.op_time(ops, A100) == sum(kernel_seconds(k, g.bf16_flops, g.hbm_bytes_per_s, g.sms, g.efficiency)
                                        for k in ops)
    assert vp.op_time(ops, A100) > 2e12 / g.bf16_flops + 8e9 / g.hbm_bytes_per_s  # below the datasheet's peaks
    cpu = vp.from_rates("cpu", matmul_flops=1e11, mem_bw=1e10, op_overhead_s=1e-5, link_bytes_per_s=1e9)
    assert vp.op_time(ops, cpu) == pytest.approx(2e12 / 1e11 + 8e9 / 1e10 + 2e-5)
    slow = cluster(A100, intra=replace(A100.intra, bytes_per_s=A100.intra.bytes_per_s / 4))
    fast_rows, slow_rows = (vp.stage_costs(PAPER, 8, hw, "vocab") for hw in (A100, slow))
    nbytes = PAPER.seq_len * PAPER.hidden * 2
    assert fast_rows[0]["bcast_x"] == pytest.approx(A100.intra.seconds(nbytes))
    assert slow_rows[0]["bcast_x"] == pytest.approx(slow.intra.seconds(nbytes))
    assert [r["F"] for r in slow_rows] == [r["F"] for r in fast_rows]  # compute does not read the link
    two_nodes = vp.stage_costs(PAPER, 16, cluster(A100, gpus_per_node=8), "vocab")  # 16 stages: across nodes
    assert two_nodes[0]["bcast_x"] == pytest.approx(A100.inter.seconds(nbytes))
    with pytest.raises(ValueError, match="Efficiency gemm=1.5"):
        replace(g.efficiency, gemm=1.5)


def test_paper_setting_speedup_at_least_1_3():
    base = vp.stage_costs(PAPER, 8, A100, "baseline")
    for alg in vp.ALGORITHMS:
        vocab = vp.stage_costs(PAPER, 8, A100, "vocab", alg)
        res = vp.simulate_layouts(base, vocab, 24, alg, comm=vocab[0]["c0"] + vocab[0]["dx"])
        assert res["speedup"] >= 1.3, (alg, res["speedup"])
        assert res["vocab"].peak_mb[0] == 8 + (3 - alg)  # p+2 (Algorithm 1), p+1 (Algorithm 2)
        assert res["baseline"].peak_mb[0] == 8


@pytest.mark.parametrize("alg", vp.ALGORITHMS)
def test_vocab_schedule_reaches_the_ideal_makespan(alg):
    """Equal costs: m (F+B+S+T) + (p-1)(F+B), no more (the vocabulary passes fill, they do not stall)."""
    p, m, F, B, S, T = 4, 8, 1.0, 2.0, 0.3, 0.2
    costs = vp.StageCosts([{"F": F, "B": B, "S": S, "T": T}] * p)
    res = simulate(vp.vocab_1f1b(p, m, alg, costs), costs)
    assert res.makespan == pytest.approx(m * (F + B + S + T) + (p - 1) * (F + B))
    assert res.peak_mb[0] == p + 3 - alg


@pytest.mark.parametrize("alg", vp.ALGORITHMS)
def test_vocab_schedule_runs_at_skewed_costs(alg):
    """Pass costs as a loaded machine may measure them (lognormal, up to ~100x apart): on every rank each pass that
    B(last, i) waits for (S, and T for Algorithm 1) comes before B(q, i), which waits for B(last, i); otherwise the
    real run deadlocks or the last stage asks for a dX no T pass has made. The schedule then simulates to the end."""
    rng = random.Random(0)
    p = 4
    for _ in range(40):
        m = rng.choice([6, 8])
        costs = vp.StageCosts([{k: rng.lognormvariate(0, 1.5) for k in "FBST"} for _ in range(p)])
        sched = vp.vocab_1f1b(p, m, alg, costs)
        for q, acts in enumerate(sched.ranks):
            for i in range(m):
                b = acts.index(Action("B", q, i))
                assert acts.index(Action("S", q, i)) < b
                assert alg == 2 or acts.index(Action("T", q, i)) < b
        assert simulate(sched, costs).makespan > 0

def test_larger_vocab_larger_gain():
    gains = []
    for V in (32_000, 256_000):
        w = vp.Workload(vp.gpt("the paper's 4B GPT", layers=32, hidden=3072, vocab=V, seq_len=4096))
        gains.append(vp.simulate_layouts(vp.stage_costs(w, 8, A100, "baseline"),
                                         vp.stage_costs(w, 8, A100, "vocab"), 16)["speedup"])
    assert 1.0 < gains[0] < gains[1]


# ---- bad input, before any process starts ------------------------------------------------------------
@pytest.mark.parametrize("cfg, world, match", [
    ({"vocab_size": 1001}, 4, "vocab_size=1001"), ({"m": 3}, 4, "m=3"),
    ({"n_layer": 6}, 4, "n_layer=6"), ({}, 1, "world_size=1"), ({"d_model": 31}, 4, "d_model=31"),
    ({"preset": "huge"}, 4, "preset='huge'")])
def test_validate_rejects_bad_input(cfg, world, match):
    with pytest.raises(ValueError, match=match):
        lesson.validate({"preset": "smoke", **cfg}, world)


def test_launch_rejects_before_starting():
    with pytest.raises(ValueError, match="vocab_size=1022"):
        launch("l13_vocab_parallel", 4, {"preset": "smoke", "vocab_size": 1022}, progress="none")


def test_shard_rows_and_bad_algorithm():
    assert [vp.shard_rows(12, 3, r) for r in range(3)] == [(0, 4), (4, 8), (8, 12)]
    with pytest.raises(ValueError, match="algorithm=3"):
        vp.vocab_1f1b(2, 4, 3, vp.StageCosts([{"F": 1, "B": 2, "S": 1, "T": 1}] * 2))
    with pytest.raises(ValueError, match="m=1 micro-batches"):
        vp.vocab_1f1b(2, 1, 2, vp.StageCosts([{"F": 1, "B": 2, "S": 1, "T": 1}] * 2))


def test_the_gpu_check_passes_on_cpu_with_one_rank():
    """benchmarks/gpu/vocab_parallel.py's body on gloo/CPU (its GPU run differs only in device and streams)."""
    import json
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    code = ("import json, sys; sys.path.insert(0, 'benchmarks/gpu'); import vocab_parallel as v; "
            "print(json.dumps(v.run('gloo', 'cpu')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(rows) == 6 and all(row["ok"] for row in rows), rows


def test_the_gain_of_balancing_a_heavy_last_stage_grows_with_m():
    """Lesson 13's Try line: with the vocabulary on the last stage, every steady-state step of 1F1B waits for it,
    so the speed-up of balancing grows with m toward t_max / t_b: ((m-1)·t_max + p·t_b) / ((m-1+p)·t_b)."""
    base = vp.stage_costs(PAPER, 8, A100, "baseline")
    vocab = vp.stage_costs(PAPER, 8, A100, "vocab")
    gains = [vp.simulate_layouts(base, vocab, m, comm=vocab[0]["c0"] + vocab[0]["dx"])["speedup"]
             for m in (8, 12, 24, 48)]
    assert gains == sorted(gains) and gains[-1] > gains[0] * 1.1, gains


def test_the_head_cost_model_against_the_same_head_traced_at_its_true_shapes():
    """The cost model writes the output layer's passes by hand (``pass_ops``: head_f, head_b); the same layer run
    with fake tensors at the paper's shapes (V = 256k, hidden 3072, 4096 tokens; ``toolkit.runtime.shapes``) lists
    the kernels PyTorch really issues. Their GEMMs are the same; the hand-counted softmax passes leave out the
    gradient's cast back to bf16, and the trace counts nll_loss's whole input where it gathers a row each: the
    totals agree within 15 % (lesson 13, section 9)."""
    got = lesson.traced_head(PAPER, A100)
    assert got["traced_gemm_ms"] == pytest.approx(got["model_gemm_ms"], rel=1e-9)
    assert got["model_ms"] / got["traced_ms"] == pytest.approx(1, abs=0.15)
    assert {"aten._log_softmax", "aten.nll_loss_forward", "aten._log_softmax_backward_data"} <= set(got["traced_kernels"])


# ---- the paper's setting at its true shapes --------------------------------------------------------------
@pytest.fixture(scope="module")
def traced():  # the paper's setting on A100 (PP = 8, m = 24), and the same model at V = 32k
    small = vp.Workload(vp.gpt("the paper's 4B GPT at V = 32k", layers=32, hidden=3072, vocab=32_000, seq_len=4096))
    return {256_000: lesson.true_shapes(PAPER, 8, 24, A100), 32_000: lesson.true_shapes(small, 8, 24, A100)}


def test_the_traced_passes_are_the_layer_s_and_the_head_s_gemms(traced):
    """At the paper's shapes (N = 4096 tokens, D = 3072, FFN = 4D, V = 256k, p = 8) the traced passes' GEMM FLOPs
    are the closed forms: a layer 2N·D·(3D + D + 2·FFN) forward (qkv, proj, fc1, fc2), its backward twice that;
    the head 2N·D·V; the S pass 2N·D·V/p (Algorithm 2: twice, G = P W), the T pass 2N·D·V/p (Algorithm 1: twice,
    dX_i). Stage 0's embedding and the softmax are no GEMMs."""
    N, D, F, V, p = PAPER.seq_len, PAPER.hidden, PAPER.model.ffn, PAPER.model.vocab, 8
    layer, head, shard = 2 * N * D * (4 * D + 2 * F), 2 * N * D * V, 2 * N * D * V // p
    gemm = lambda est: sum(k.flops for _, k, _ in est.kernels if k.kind == "gemm")  # noqa: E731
    passes = traced[V]["passes"]
    for r, extra in ((0, 0), (1, 0), (p - 1, head)):
        assert gemm(passes[r]["base_F"]) == 4 * layer + extra, r
        assert gemm(passes[r]["base_FB"]) == 3 * (4 * layer + extra), r
        assert gemm(passes[r]["blocks_FB"]) == 3 * 4 * layer, r
    assert [gemm(passes[0][k]) for k in ("S1", "T1", "S2", "T2")] == [shard, 2 * shard, 2 * shard, shard]
    assert gemm(passes[0]["input_FB"]) == 0
    assert passes[p - 1]["base_F"].by_kind()["attention"] > 0  # the layers' flash attention, timed as such


def test_the_paper_s_setting_traced_reproduces_the_claim_and_a_small_vocabulary_does_not(traced):
    """The claim (the artifact's 1.85-1.87x at PP = 8, V = 256k, within ±25 %) judged on the traced setting over
    its sensitivity band: reproduced. The same model and schedule at V = 32k: the head weighs less than a layer
    per stage, the gain falls below the claim's band, and the verdict flips."""
    from toolkit.report import SENSITIVITY, band
    from toolkit.runtime.bench import Claim, judge
    claim = Claim.ratio("1F1B's step / Vocab-2's", 1.86, tolerance=0.25)
    words = {}
    for V, got in traced.items():
        b = band("speed-up", got["sensitivity"], key=lambda v: v[2])
        assert b["low"] <= got["speedup"][2] == b["value"] <= b["high"] and b["replays"] == 9
        words[V] = judge(claim, b["value"], b["low"], b["high"], SENSITIVITY).word
        for alg in vp.ALGORITHMS:
            sim = got["sims"][alg]
            assert sim["speedup"] == sim["baseline"].makespan / sim["vocab"].makespan
            assert sim["vocab"].peak_mb[0] == 8 + 3 - alg and sim["baseline"].peak_mb[0] == 8
    assert words == {256_000: "reproduced", 32_000: "direction only"}
    assert 1.0 < traced[32_000]["speedup"][2] < 0.8 * traced[256_000]["speedup"][2]


def test_the_band_re_times_what_a_trace_on_the_perturbed_cluster_gives(traced):
    """The band re-times the traced kernels and collectives on ``cluster.perturbed``: the same seconds as tracing
    again there (the ops do not depend on the figures). The vocabulary passes' collectives are on the fake process
    group of 8 ranks: the broadcast of X, C0's two all-reduces and the fused dX (Algorithm 2), on the NVLink."""
    slow = A100.perturbed(0.7, 0.8)
    again = lesson._trace_comm(PAPER, 8, slow)
    mine = lesson._trace_comm(PAPER, 8, A100)
    for alg in vp.ALGORITHMS:
        for est, est_slow in zip(mine[alg], again[alg]):
            assert est.on(slow).step_s == pytest.approx(est_slow.step_s, rel=1e-12)
            assert est.on(A100).step_s == pytest.approx(est.step_s, rel=1e-12)
    assert [c["op"] for c in mine[2][1].comms] == ["all_reduce"] * 3
    assert [c["op"] for c in mine[2][0].comms] == ["broadcast"] and mine[2][0].comms[0]["link"] == A100.intra.name
    assert traced[256_000]["comm"][2] == max(e.step_s for e in mine[2])
