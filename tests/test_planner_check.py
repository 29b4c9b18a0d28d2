"""The planner's step-time model against the same configurations timed from the program at true shapes
(``toolkit.planner_check``): the traced units are the catalog's GEMMs, the pipeline is the simulator's with the
traced stage costs, and the planner ranks 13B's layouts as the traced program does — but not once a 256k
vocabulary makes the last stage heavy, which the planner's unit-cost bubble cannot see."""
from __future__ import annotations

import dataclasses

import pytest

from toolkit import planner
from toolkit.lessons.l17_capstone import case_13b
from toolkit.models.catalog import get
from toolkit.planner_check import compare, configuration_seconds, spearman, unit_seconds

W, HW, GPUS, ASSUME = case_13b()


def test_the_traced_layer_is_the_catalog_s_gemms_and_its_head_the_vocabulary_s():
    spec = get("llama2-13b")
    tokens = 2 * W.seq_len
    u = unit_seconds(spec, HW, W.seq_len, 1, 2)
    attention = spec.attention_flops(2, W.seq_len, causal=True)
    assert u["layer_flops"] == pytest.approx(spec.layer_gemm_flops(tokens) + attention, rel=1e-3)
    assert u["head_flops"] == pytest.approx(2 * tokens * spec.hidden * spec.vocab, rel=1e-3)
    tp8 = unit_seconds(spec, HW, W.seq_len, 8, 2)
    assert tp8["layer_flops"] == pytest.approx(u["layer_flops"] / 8, rel=1e-3)  # each rank an eighth of the GEMMs
    assert tp8["layer_F"] > u["layer_F"] / 8  # and the all-reduces on top
    assert u["layer_B"] == pytest.approx(2 * u["layer_F"], rel=0.25)
    assert 0.3 * u["layer_B"] < u["layer_W"] < 0.6 * u["layer_B"]  # dW: half the backward's GEMMs, no attention


def test_without_a_pipeline_the_step_is_every_micro_batch_through_the_whole_model():
    row = {"dp": 24, "tp": 1, "pp": 1, "zero": 1, "micro_batch": 1, "m": 8, "schedule": "none", "recompute": False,
           "offload": "none"}
    u = unit_seconds(W.model, HW, W.seq_len, 1, 1)
    one = W.layers * (u["layer_F"] + u["layer_B"]) + sum(u[k] for k in ("embed_F", "embed_B", "head_F", "head_B"))
    assert configuration_seconds(W, HW, row, ASSUME)["pipeline"] == pytest.approx(8 * one)
    recomputed = configuration_seconds(W, HW, {**row, "recompute": True}, ASSUME)["pipeline"]
    assert recomputed == pytest.approx(8 * (one + W.layers * u["layer_F"]))


def test_spearman_of_known_orders():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == -1.0
    assert spearman([1, 2, 3], [1, 3, 2]) == pytest.approx(0.5)
    assert spearman([1, 1, 2], [1, 1, 2]) == pytest.approx(1.0)  # ties share their mean rank


def test_the_planner_ranks_13b_layouts_as_the_traced_program_but_not_with_a_256k_vocabulary():
    """Lesson 17 asks Spearman >= 0.9 at 13B (its vocabulary of 32k); with 256k the head on the last stage
    dominates and the check fails: the verdict can come out the other way."""
    got = {}
    for vocab in (32000, 256000):
        w = dataclasses.replace(W, model=dataclasses.replace(get("llama2-13b"), vocab=vocab))
        got[vocab] = compare(w, HW, planner.choose(w, HW, GPUS, assume=ASSUME), ASSUME)
    assert len(got[32000]["pairs"]) >= 50
    assert got[32000]["spearman"] >= 0.9 > got[256000]["spearman"]
    assert 1.0 < got[32000]["worst"]["ratio"] < 1.35 < got[256000]["worst"]["ratio"]


def test_traced_activations_are_the_planner_s_and_a_layer_keeping_its_attention_scores_is_not():
    """One layer's forward graph at 13B's shapes keeps (8 + 24/tp) bytes per token per hidden unit (the project's
    GPT: SDPA's flash attention keeps no scores, no dropout masks, the LayerNorm and residual tensors whole on every
    TP rank), 2 with recompute (its input): the planner's formula, within 1 %, so the two agree on which layouts
    fit but at the edge. With SDPA's math backend the layer keeps its attention scores too and the formula would
    under-count it by far: the check can fail."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from toolkit.planner_check import activation_bytes
    sbh = W.seq_len * W.hidden

    def planned(tp: int, mb: int, recompute: bool) -> float:
        w = dataclasses.replace(W, micro_batch=mb, recompute=recompute)
        return planner.memory_per_gpu(w, 1, tp, 1, 0)["activations"] / W.layers
    for tp in (1, 2, 4, 8):
        assert activation_bytes(W.model, W.seq_len, tp, 1, False) == pytest.approx(planned(tp, 1, False), rel=0.01)
    assert activation_bytes(W.model, W.seq_len, 4, 2, True) == planned(4, 2, True) == 2 * 2 * sbh
    got = compare(W, HW, planner.choose(W, HW, GPUS, assume=ASSUME), ASSUME)
    assert all(p["traced_gb"] == pytest.approx(p["planner_gb"], rel=0.01) for p in got["pairs"])
    cap = HW.gpu.memory_bytes / 1e9 * 0.9
    assert all(abs(p["planner_gb"] / cap - 1) < 0.01 for p in got["fits_disagree"])  # only at the edge
    with sdpa_kernel([SDPBackend.MATH]):
        scores_kept = activation_bytes.__wrapped__(W.model, W.seq_len, 1, 1, False)
    assert scores_kept > 2.5 * planned(1, 1, False)
