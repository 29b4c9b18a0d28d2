"""Lesson 17: the techniques composed on 4 real processes (pp 2 × dp 2, experts inside dp), each step's loss
within its tolerance of the step before, the planner's memory model within 5% of every rank's measured peak and
its bytes model equal to the ledger; conflicts and impossible layouts refused before any process starts; the
planner's configuration search; the headline records the course results page is built from."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from toolkit import compose_bytes, launch, planner
from toolkit.compose import LOSS_RTOL, TECHNIQUES, ComposeConfig, chain, loss_rtol
from toolkit.lessons import l17_capstone as lesson
from toolkit.report import MIME, collect, record, results_html, write_results
from toolkit.runtime.cluster import cluster

WORLD = 4


@pytest.fixture(scope="module")
def run():
    cfg = lesson.validate({"preset": "smoke"}, WORLD)
    return cfg, launch("l17_capstone", WORLD, cfg, timeout_s=600, progress="none")


def _by_name(results):
    names = [r["name"] for r in results[0]["runs"]]
    return names, {n: [r["runs"][i] for r in results] for i, n in enumerate(names)}


# ---- on real processes ----------------------------------------------------------------------------------------
def test_every_step_keeps_the_loss_within_its_tolerance(run):
    cfg, results = run
    names, runs = _by_name(results)
    assert names[:len(cfg["techniques"]) + 1] == ["baseline", *cfg["techniques"]]
    losses = {n: runs[n][0]["losses"] for n in names}
    assert all(r["runs"][i]["losses"] == losses[n] for r in results for i, n in enumerate(names))
    ref = results[0]["reference_loss"]
    assert abs(losses["baseline"][0] - ref) <= 1e-5 * ref  # the layout computes the model's own loss
    configs = lesson.configurations(cfg, WORLD)
    cfg_of = {n: c for n, c, _ in configs}
    for name, _, against in configs[1:]:
        tech = name.split(" (")[0]
        rel = max(abs(a - b) / abs(b) for a, b in zip(losses[name], losses[against]))
        assert rel <= loss_rtol(tech, cfg_of[against]), (name, rel)
    for exact in ("dualpipev", "bf16_residual", "offload"):  # only bytes or the order of micro-batches change
        prev = names[names.index(exact) - 1]
        assert losses[exact] == losses[prev], exact


def test_memory_model_within_5_percent_of_every_rank(run):
    cfg, results = run
    names, runs = _by_name(results)
    checked = 0
    for name, c, _ in lesson.configurations(cfg, WORLD):
        if c.vocab_parallel:
            continue
        for rank, r in enumerate(runs[name]):
            rows = {(x["stage"], x["mb"]): x["layers"] for x in r["routing"]}
            pred = compose_bytes.composed_memory(c, results[rank]["coords"]["pp"], rows)
            meas = r["memory"]["peak"]
            assert abs(pred["total"] / meas["total"] - 1) <= 0.05, (name, rank, pred, meas)
            assert pred["param"] == meas["param"] == r["param_bytes"]  # exact by construction
            assert pred["optim"] == meas["optim"]  # optimizer state is static: exact too
            checked += 1
    assert checked == WORLD * (len(cfg["techniques"]) + 1)


def test_bytes_model_equals_the_ledger(run):
    cfg, results = run
    names, runs = _by_name(results)
    for name, c, _ in lesson.configurations(cfg, WORLD):
        if c.vocab_parallel:
            continue
        for rank, r in enumerate(runs[name]):
            rows = {(x["stage"], x["mb"]): x["layers"] for x in r["routing"]}
            model = compose_bytes.composed_bytes(c, results[rank]["coords"]["pp"], rows, r["edgc_ranks"])
            got = {}
            for b in r["bytes"]:
                got[b["op"]] = got.get(b["op"], 0) + b["sent_bytes"]
            for op, want in model.items():
                assert got.get(op, 0) == pytest.approx(want, rel=1e-9), (name, rank, op)


def test_each_technique_buys_what_it_should(run):
    cfg, results = run
    names, runs = _by_name(results)

    def total(n, op=None, group=None):
        return sum(b["sent_bytes"] for r in runs[n] for b in r["bytes"]
                   if (op is None or b["op"] == op) and (group is None or b["group"] == group))

    def peak(n, key="total", rank=None):
        return max(r["memory"]["peak"][key] for i, r in enumerate(runs[n]) if rank is None or i == rank)

    assert total("bf16") < 0.6 * total("dualpipev")  # bf16 halves every tensor on the wire
    assert sum(r["param_bytes"] for r in runs["bf16"]) * 2 == sum(r["param_bytes"] for r in runs["dualpipev"])
    assert peak("bf16_residual", "optim") < peak("bf16", "optim")  # the residual replaces the fp32 master
    assert peak("offload", "act") < peak("bf16_residual", "act") and peak("offload", "host") > 0
    assert total("int8_a2a", "all_to_all_single") < total("offload", "all_to_all_single")
    assert total("edgc", "all_reduce", "dp") < 0.5 * total("int8_a2a", "all_reduce", "dp")
    assert runs["vocab_parallel (on baseline)"][0]["losses"][0] == pytest.approx(runs["baseline"][0]["losses"][0],
                                                                                rel=1e-5)
    for r in results:
        assert all(run["bench"]["mean_s"] > 0 for run in r["runs"])


def test_vocabulary_parallelism_composes_with_offload_int8_and_edgc():
    """The VocabPasses and Offload hooks on one executor (a list of hooks), with int8 all-to-all and EDGC in
    bf16: every loss stays within its tolerance (no NaN from a vocabulary shard whose gradient is zero)."""
    cfg = lesson.validate({"preset": "smoke", "techniques": ["vocab_parallel", "bf16_residual", "offload",
                                                             "int8_a2a", "edgc"], "branch": [], "rounds": 1}, WORLD)
    results = launch("l17_capstone", WORLD, cfg, timeout_s=600, progress="none")
    runs = results[0]["runs"]
    for prev, cur in zip(runs, runs[1:]):
        rel = max(abs(a - b) / abs(b) for a, b in zip(cur["losses"], prev["losses"]))
        assert rel <= max(LOSS_RTOL[cur["name"]], 1e-2), (cur["name"], rel)  # vocab's loss is bf16 from here on
    off = [r["runs"][3]["offload"] for r in results]
    assert all(o["offloaded_bytes"] == o["reloaded_bytes"] > 0 for o in off)


# ---- before any process starts ---------------------------------------------------------------------------------
BAD = [
    ({"pp": 3}, "world_size=4 is not a multiple of pp=3"),
    ({"m": 3}, "m >= 2 × pp"),
    ({"n_expert": 0}, "MoE options on a dense model"),
    ({"techniques": ["dualpipev", "vocab_parallel"]}, "conflict: vocab_parallel=True with schedule='dualpipev'"),
    ({"techniques": ["bf16", "bf16"]}, "turned on twice"),
    ({"techniques": ["no_such"]}, "not allowed"),
    ({"techniques": ["moe_overlap"]}, "not allowed"),  # not composed: see test_moe_overlap_is_refused
    ({"n_layer": 6}, "must be divisible by the 4 pipeline stages"),
]


@pytest.mark.parametrize("change, words", BAD)
def test_bad_input_is_named_before_launch(change, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        lesson.validate({"preset": "smoke", **change}, WORLD)


def test_world_size_not_a_product_of_the_degrees():
    with pytest.raises(ValueError, match="world_size=6 is not pp × dp = 2 × 2 = 4"):
        ComposeConfig().validate(6)
    with pytest.raises(ValueError, match="a pipeline|composed run"):
        lesson.validate({"preset": "smoke"}, 1)


def test_conflicts_name_both_sides():
    with pytest.raises(ValueError, match="dp_comm='sdp4bit' cannot be composed") as err:
        ComposeConfig(dp_comm="sdp4bit").validate(4)
    assert "pp=2" in str(err.value) and "edgc" in str(err.value)
    with pytest.raises(ValueError, match="a2a_block=24 must be even and divide d_model=32"):
        ComposeConfig(a2a_codec="int8", a2a_block=24).validate(4)
    with pytest.raises(ValueError, match="ep=1 every expert is local"):
        ComposeConfig(ep=1, a2a_codec="int8").validate(4)
    with pytest.raises(ValueError, match="ComposeConfig has no field"):
        ComposeConfig().replace(schedul="1f1b")
    steps = chain(ComposeConfig(), ["dualpipev", "bf16"], 4)
    assert [n for n, _ in steps] == ["baseline", "dualpipev", "bf16"]
    assert steps[-1][1].schedule == "dualpipev" and steps[-1][1].precision == "bf16"
    assert set(LOSS_RTOL) == set(TECHNIQUES)


def test_moe_overlap_is_refused_before_launch():
    """toolkit.moe.overlap runs a whole model; the composed pipeline has no stage-level overlapped forward."""
    with pytest.raises(ValueError, match="moe_overlap=True is not composed"):
        ComposeConfig(moe_overlap=True).validate(4)
    assert "moe_overlap" not in TECHNIQUES


def test_precision_tolerance_is_keyed_on_the_step_before():
    fp32, bf16, res = ComposeConfig(), ComposeConfig(precision="bf16"), ComposeConfig(precision="bf16_residual")
    assert loss_rtol("bf16_residual", bf16) == 0.0 and loss_rtol("bf16", res) == 0.0  # bit-exact pair
    assert loss_rtol("bf16_residual", fp32) == loss_rtol("bf16", fp32) == LOSS_RTOL["bf16"] > 0
    assert loss_rtol("edgc", res) == LOSS_RTOL["edgc"]


# ---- the planner ---------------------------------------------------------------------------------------------------
def test_memory_model_follows_the_schedule_and_precision():
    c = ComposeConfig()
    fp32, bf16 = compose_bytes.composed_memory(c, 0), compose_bytes.composed_memory(c.replace(precision="bf16"), 0)
    res = compose_bytes.composed_memory(c.replace(precision="bf16_residual"), 0)
    n_params = fp32["param"] // 4
    assert bf16["param"] * 2 == fp32["param"] and bf16["optim"] - res["optim"] == 2 * n_params
    off = compose_bytes.composed_memory(c.replace(precision="bf16_residual", offload="all", schedule="dualpipev"), 0)
    dual = compose_bytes.composed_memory(c.replace(precision="bf16_residual", schedule="dualpipev"), 0)
    assert off["act"] < dual["act"] and off["static"] == dual["static"]


def test_choose_prefers_what_fits_and_says_why():
    w, hw, gpus, assume = lesson.case_13b()
    rows = planner.choose(w, hw, gpus, micro_batches=(1,), schedules=("1f1b",), offload=("none", "cpu"),
                          assume=assume)
    fits = [r["fits"] for r in rows]
    assert fits == sorted(fits, reverse=True)  # everything that fits before anything that does not
    best = rows[0]
    assert best["fits"] and best["memory_gb"] <= 0.9 * hw.gpu.memory_bytes / 1e9
    assert all(best["step_s"] <= r["step_s"] for r in rows if r["fits"])
    assert all(r["dp"] * r["tp"] * r["pp"] == gpus for r in rows)
    why = planner.explain(rows, hw)
    assert planner.label(best) in why[0] and any("recompute True" in line for line in why)
    small = cluster("a100-ib200", gpus_per_node=1, gpu=replace(hw.gpu, memory_bytes=16e9))
    big = planner.choose(planner.Workload(params=13e9, layers=40, hidden=5120, heads=40, seq_len=2048,
                                          global_batch=8), small, 1)
    assert not big[0]["fits"] and "nothing fits in 90% of 16 GB" in planner.explain(big, small)[0]


def test_planner_reads_the_cluster_and_its_assumptions():
    """The hardware figures come from the Cluster, the software's from Assumptions: each moves its own term."""
    w, hw, gpus, assume = lesson.case_13b()
    assert hw.inter.bytes_per_s == 12e9 and hw.intra == cluster("a100-ib200").intra
    t = planner.step_time(w, hw, 8, 1, 3, 0, assume)  # dp spans the 3 nodes: the inter link
    faster_ib = planner.step_time(w, cluster(hw, inter=replace(hw.inter, bytes_per_s=24e9)), 8, 1, 3, 0, assume)
    assert faster_ib["dp_comm"] == pytest.approx(t["dp_comm"] / 2) and faster_ib["compute"] == t["compute"]
    assert planner.step_time(w, hw, 8, 1, 3, 0, replace(assume, mfu=0.2))["compute"] == pytest.approx(2 * t["compute"])
    one_node = planner.step_time(w, hw, 2, 2, 2, 0, assume)  # 8 GPUs: NVLink
    assert one_node["dp_comm"] == pytest.approx(2 * (2 - 1) / 2 * 2 * w.params / 4 / hw.intra.bytes_per_s
                                                 * (1 - assume.dp_overlap))
    shard = w.params / 8
    assert planner.offload_time(w, 8, 1, 1, 1, "nvme", hw, assume) == pytest.approx(
        4 * shard / hw.host.bytes_per_s + 16 * shard / assume.cpu_adam_bytes_per_s
        + 16 * shard / hw.disk.read_bytes_per_s + 16 * shard / hw.disk.write_bytes_per_s)
    for bad, match in (({"mfu": 0.0}, "mfu=0.0"), ({"dp_overlap": 1.5}, "dp_overlap=1.5"),
                       ({"cpu_adam_bytes_per_s": -1}, "cpu_adam_bytes_per_s=-1")):
        with pytest.raises(ValueError, match=match):
            planner.Assumptions(**bad)
    with pytest.raises(ValueError, match="gpus=0"):
        planner.plan(w, hw, 0)
    with pytest.raises(ValueError, match="cluster='h100' is not a preset"):
        planner.choose(w, "h100", 8)


def test_article_claims_get_computed_verdicts():
    w, hw, gpus, assume = lesson.case_13b()
    best = planner.choose(w, hw, gpus, assume=assume)[0]
    claims = {cl["claim"]: cl for cl in lesson.article_claims(w, hw, assume, best)}
    assert claims["13B, ZeRO-2 on 8 GPUs: memory per GPU"]["verdict"] == "disagrees"  # 26 GB of weights alone
    assert claims["ZeRO-2 against plain DP: all-reduce traffic"]["model"].startswith("1.0×")
    bubble = claims["1F1B on 24 GPUs: bubble after micro-batch tuning"]
    assert f"{lesson.ARTICLE_STAGES} stages" in bubble["model"] and "47%" in bubble["model"]  # 7/15 (theory)
    nvme = claims["13B, ZeRO-3 + NVMe offload of optimizer and parameters: memory per GPU"]
    assert "3.25 GB of gradient shards + the article's 3.5 GB" in nvme["model"]
    assert claims["ZeRO-2 → ZeRO-3 + NVMe offload: step time"]["verdict"] == "not decidable"  # an upper bound


# ---- small fixes the composition needed -------------------------------------------------------------------------
def test_edgc_epsilon_keeps_a_zero_matrix_finite_in_bf16():
    from toolkit.comm.edgc import EDGCConfig, orthogonalize_
    zero = torch.zeros(1, 8, 2, dtype=torch.bfloat16)
    assert torch.isnan(orthogonalize_(zero.clone())).all()  # Gram-Schmidt divides 0 by 0
    assert torch.equal(orthogonalize_(zero.clone(), epsilon=1e-8), zero)
    with pytest.raises(ValueError, match="epsilon"):
        EDGCConfig(epsilon=-1.0).validate()


def test_offload_host_buffers_reused_in_a_later_step_count_as_host():
    """A pooled host buffer reused under a MemoryTracker is host memory, not activations (it was "act")."""
    from toolkit.memory.offload import ActivationOffloader
    from toolkit.models import GPT, lm_loss, preset
    from toolkit.runtime.memory import MemoryTracker
    torch.manual_seed(0)
    model = GPT(preset("smoke"))
    x = torch.randint(0, 256, (2, 32))
    order = [("F", (0, 0, 0)), ("F", (0, 1, 0)), ("B", (0, 0, 0)), ("B", (0, 1, 0))]
    off = ActivationOffloader({0: model}, order, policy="all")

    def step() -> dict:
        losses = []
        for mb in range(2):
            with off.forward((0, mb, 0)):
                losses.append(lm_loss(model(x), x))
        after = MemoryTracker.active().current() if MemoryTracker.active() else None
        for mb in range(2):
            off.backward_begin((0, mb, 0))
            losses[mb].backward()
            off.backward_end((0, mb, 0))
        return after

    step()  # fills the pool
    with MemoryTracker(model) as mem:
        after = step()
    assert after["host"] > 0 and after["act"] < after["host"]


# ---- the results page ----------------------------------------------------------------------------------------------
def test_headline_record_checks_its_fields():
    rec = record("04", "int8 all-to-all", "1.94x fewer bytes", 1.94, "x", "2x (DeepSeek)", "paper", True)
    assert rec["value"] == 1.94 and rec["reproduced"] is True
    for bad in ({"lesson": ""}, {"value": float("nan")}, {"reproduced": "yes"}, {"value": True}):
        args = {"lesson": "04", "technique": "t", "measured": "m", **bad}
        with pytest.raises(ValueError):
            record(**args)


def test_collect_reads_the_last_headline_of_an_executed_notebook(tmp_path):
    import nbformat
    first = record("05", "EDGC", "first run")
    last = record("05", "EDGC", "second run", reproduced=False)
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("headline(...)", outputs=[
        nbformat.v4.new_output("display_data", data={"text/markdown": "x", MIME: first}),
        nbformat.v4.new_output("display_data", data={"text/markdown": "y", MIME: last})])])
    path = tmp_path / "05.ipynb"
    nbformat.write(nb, path)
    assert collect(path) == last
    empty = tmp_path / "empty.ipynb"
    nbformat.write(nbformat.v4.new_notebook(), empty)
    assert collect(empty) is None
    rows = [{"name": "05-edgc", "status": "ok", "headline": last}, {"name": "06-x", "status": "failed", "headline": None}]
    js, page = write_results(rows, tmp_path, {"preset": "smoke"})
    assert json.loads(js.read_text())["lessons"][0]["headline"]["measured"] == "second run"
    text = page.read_text()
    assert "second run" in text and "notebook failed" in text and "class='no'" in text
    assert "<script" not in results_html(rows, {})
