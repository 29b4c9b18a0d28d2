"""Seq1F1B: chunked attention equals the unsplit model, the schedule's bubble and memory, real runs, bad input."""
from __future__ import annotations

import pytest
import torch

from toolkit import launch
from toolkit.lessons import l11_seq1f1b as lesson
from toolkit.models.gpt import GPT, GPTConfig, split_stages
from toolkit.pipeline import seq1f1b as s1
from toolkit.pipeline.schedule import one_f_one_b
from toolkit.pipeline.simulate import simulate

P, K = 4, 4


# ---- partitions -------------------------------------------------------------------------------
def test_partitions_sum_and_equal_compute_front_loads_tokens():
    cfg = GPTConfig(vocab_size=32000, seq_len=32768, n_layer=32, n_head=32, d_model=4096)
    a, b = s1.flop_coefficients(cfg)
    tokens = s1.partition(cfg.seq_len, 4, "equal_tokens", a, b)
    compute = s1.partition(cfg.seq_len, 4, "equal_compute", a, b)
    assert tokens == [8192] * 4 and sum(compute) == cfg.seq_len
    assert compute == sorted(compute, reverse=True) and compute[0] > compute[-1]  # earlier chunks longer
    flops_t, flops_c = s1.chunk_flops(tokens, a, b), s1.chunk_flops(compute, a, b)
    assert max(flops_c) / min(flops_c) < 1.001 < 1.5 < max(flops_t) / min(flops_t)
    assert sum(flops_c) == pytest.approx(sum(flops_t))


def test_partition_is_min_max_and_respects_multiples():
    # brute force over every split of 12 tokens into 3 chunks
    a, b = 1.0, 100.0
    best = min((max(s1.chunk_flops([x, y, 12 - x - y], a, b)), [x, y, 12 - x - y])
               for x in range(1, 11) for y in range(1, 12 - x))
    assert max(s1.chunk_flops(s1.partition(12, 3, "equal_compute", a, b), a, b)) == best[0]
    assert all(n % 4 == 0 for n in s1.partition(64, 3, "equal_compute", a, b, multiple_of=4))
    assert s1.partition(10, 10, "equal_compute", a, b) == [1] * 10


@pytest.mark.parametrize("kwargs, match", [
    (dict(seq_len=8, k=9), "seq_chunks=9"), (dict(seq_len=8, k=0), "seq_chunks"),
    (dict(seq_len=8, k=2, strategy="halves"), "partition='halves'"),
    (dict(seq_len=10, k=2, multiple_of=4), "multiple_of=4")])
def test_partition_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        s1.partition(**{"strategy": "equal_compute", "a": 1.0, "b": 1.0, **kwargs})


# ---- the chunked stage, one process --------------------------------------------------------------
@pytest.mark.parametrize("strategy", s1.PARTITIONS)
def test_chunked_stages_equal_unsplit_model(strategy):
    torch.manual_seed(0)
    cfg = GPTConfig(seq_len=24, n_layer=2, n_head=2, d_model=32)
    model = GPT(cfg)
    idx, tgt = torch.randint(0, 256, (2, 24)), torch.randint(0, 256, (2, 24))
    ref_loss = model(idx, tgt)
    ref_loss.backward()
    ref = {n: q.grad.clone() for n, q in model.named_parameters()}
    model.zero_grad()
    stages = [s1.ChunkedStage(s, cfg.n_head) for s in split_stages(model, 2)]
    lengths = s1.partition(24, 3, strategy, *s1.flop_coefficients(cfg))
    held, loss = [], 0.0
    for j, (s, e) in enumerate(s1.chunk_bounds(lengths)):
        h = stages[0].forward(0, j, idx[:, s:e], s)
        h_in = h.detach().requires_grad_()
        logits = stages[1].forward(0, j, h_in, s)
        chunk_loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), tgt[:, s:e].reshape(-1),
                                                       reduction="sum") / tgt.numel()
        loss += chunk_loss.item()
        held.append((h, h_in, chunk_loss))
    for j in reversed(range(len(lengths))):
        h, h_in, chunk_loss = held[j]
        stages[1].backward(0, j, chunk_loss)
        stages[0].backward(0, j, h, h_in.grad)
    assert loss == pytest.approx(ref_loss.item(), abs=1e-5)
    for n, q in model.named_parameters():
        torch.testing.assert_close(q.grad, ref[n], rtol=0, atol=1e-5)
    assert not stages[0].caches and not stages[1].caches  # freed after chunk 0's backward


def test_backward_out_of_order_raises():
    torch.manual_seed(0)
    cfg = GPTConfig(seq_len=16, n_layer=1, n_head=2, d_model=16)
    stage = s1.ChunkedStage(split_stages(GPT(cfg), 1)[0], cfg.n_head)
    idx = torch.randint(0, 256, (1, 16))
    outs = [stage.forward(0, j, idx[:, 8 * j:8 * j + 8], 8 * j).sum() for j in range(2)]
    with pytest.raises(RuntimeError, match="backward of chunk 0 ran before"):
        outs[0].backward()
    with pytest.raises(RuntimeError, match="out of order"):
        stage.forward(1, 1, idx[:, :8], 0)


# ---- the schedule in the simulator ------------------------------------------------------------------
@pytest.mark.parametrize("p, m, k", [(2, 2, 2), (4, 4, 4), (4, 8, 2), (8, 16, 4), (3, 5, 3)])
def test_schedule_bubble_and_peak_match_the_formulas(p, m, k):
    res = simulate(s1.seq1f1b(p, m, k), s1.ChunkCosts(1.0, 2.0, [1.0] * k))
    assert res.bubble == pytest.approx((p - 1) * 3.0 / k)
    assert res.bubble_fraction == pytest.approx(s1.bubble_formula(p, m, k))
    assert res.peak_mb == pytest.approx([s1.peak_formula(p, r, k) for r in range(p)])
    assert res.peak_mb[0] == pytest.approx(1 + (p - 1) / k)


def test_k1_is_1f1b():
    assert s1.seq1f1b(4, 6, 1).to_strings() == one_f_one_b(4, 6).to_strings()


def test_unequal_chunks_cost_bubbles():
    cfg = GPTConfig(vocab_size=32000, seq_len=32768, n_layer=32, n_head=32, d_model=4096)
    a, b = s1.flop_coefficients(cfg)
    span = {name: simulate(s1.seq1f1b(4, 8, 4), s1.ChunkCosts(1.0, 2.0, s1.chunk_flops(
        s1.partition(cfg.seq_len, 4, name, a, b), a, b))).makespan for name in s1.PARTITIONS}
    assert span["equal_compute"] < span["equal_tokens"]


# ---- the paper's setting at its true shapes (a model) ------------------------------------------------
def test_byte_peak_counts_the_formulas_chunks():
    from toolkit.lessons.l11_true_shapes import peak_bytes
    sched = s1.seq1f1b(P, 8, K)
    assert [peak_bytes(sched, r, [1.0] * K) for r in range(P)] == [P - r - 1 + K for r in range(P)]


def test_true_shapes_verdict_flips_with_one_chunk_and_a_tiny_sequence():
    from toolkit.lessons import l11_true_shapes as ts
    paper = ts.true_shapes()
    lengths = list(paper["lengths"])
    assert sum(lengths) == ts.PAPER.seq_len and lengths == sorted(lengths, reverse=True)  # earlier chunks longer
    assert all(n % ts.PAPER.tp == 0 for n in lengths)
    assert paper["ratio"] > 1 and paper["memory_ratio"] < 1 and paper["overhead"] > 1  # the mask and K/V copies
    assert paper["ideal"] > paper["ratio"] and paper["memory_ideal"] < paper["memory_ratio"]
    assert ts.verdicts(paper)["throughput"].word in ("reproduced", "direction only")
    # k = 1 is 1F1B itself; 512 tokens cut in 4: chunks of 128 tokens pay mostly fixed kernel and all-reduce costs
    for setting in (ts.replace(ts.PAPER, k=1), ts.replace(ts.PAPER, seq_len=512)):
        got = ts.true_shapes(setting)
        assert got["ratio"] <= 1 and ts.verdicts(got)["throughput"].word == "not reproduced"
    assert ts.true_shapes(ts.replace(ts.PAPER, k=1))["memory_ratio"] == 1


# ---- real processes ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def results():
    return launch("l11_seq1f1b", P, {"preset": "smoke", "seq_chunks": K}, timeout_s=300, progress="none")


def test_real_runs_equal_unsplit_reference(results):
    for name in ("1f1b", "seq1f1b-tokens", "seq1f1b-compute"):
        assert abs(results[0]["runs"][name]["loss"] - results[0]["ref_loss"]) <= lesson.TOL, name
        for r in results:
            assert r["runs"][name]["max_grad_diff"] <= lesson.TOL, (name, r["rank"])


def test_real_runs_hold_the_predicted_chunks(results):
    for r in results:
        assert r["runs"]["1f1b"]["peak_chunks"] == P - r["rank"]
        for name in ("seq1f1b-tokens", "seq1f1b-compute"):
            assert r["runs"][name]["peak_chunks"] == P - r["rank"] - 1 + K
    assert results[0]["runs"]["seq1f1b-tokens"]["peak_mb"] == 1 + (P - 1) / K == 1.75
    assert results[0]["runs"]["1f1b"]["peak_mb"] == P
    assert results[0]["runs"]["seq1f1b-tokens"]["act_peak_bytes"] < results[0]["runs"]["1f1b"]["act_peak_bytes"]


def test_bytes_per_rank_fewer_first_more_last(results):
    """Bytes, not chunks: every rank keeps more than the chunk count says (K/V concatenation, waiting dK/dV);
    rank 0 keeps fewer bytes than 1F1B, the last rank (one micro-batch of chunks in both) more."""
    ratio = [r["runs"]["seq1f1b-compute"]["act_peak_bytes"] / r["runs"]["1f1b"]["act_peak_bytes"] for r in results]
    chunk_ratio = [s1.peak_formula(P, r, K) / (P - r) for r in range(P)]
    assert all(b > c for b, c in zip(ratio, chunk_ratio)), (ratio, chunk_ratio)
    assert ratio[0] < 1 < ratio[-1]


# ---- bad input, before any process starts ------------------------------------------------------------
@pytest.mark.parametrize("cfg, world, match", [
    ({"seq_chunks": 33}, 4, "seq_chunks=33"), ({"seq_chunks": 0}, 4, "seq_chunks must be >= 1"),
    ({"m": 2}, 4, "m=2"), ({"partitions": ["halves"]}, 4, "halves"),
    ({"partitions": []}, 4, "partitions must not be empty"), ({"micro_batches": 8}, 4, "did you mean 'micro_batch'"),
    ({"n_layer": 3}, 4, "n_layer=3"), ({}, 1, "world_size=1"), ({"preset": "huge"}, 4, "preset='huge'")])
def test_validate_rejects_bad_input(cfg, world, match):
    with pytest.raises(ValueError, match=match):
        lesson.validate({"preset": "smoke", **cfg}, world)


def test_launch_rejects_before_starting():
    with pytest.raises(ValueError, match="seq_chunks"):
        launch("l11_seq1f1b", 4, {"preset": "smoke", "seq_chunks": 1000}, progress="none")
