"""Every lesson notebook executes end to end with papermill at the smoke preset, taking one of its own Try
suggestions (its assert cells are the checks).

Each lesson's run sets the knobs of the Try item named in ``TRIED``, with the values the item writes (read by
``tools/nb.py``'s ``suggestions``, so the line and the test cannot drift apart). The notebook's own asserts must
hold at those values; ``TRIED`` also checks what the item predicts where that is deterministic (a byte ratio, a
load ratio, a peak from the schedule, an equality; never a timing); and the prose the run rendered must not
contradict its headline (``verdict_conflicts``). These runs take no emulated cluster (``cluster = "none"``, the
path a GPU run takes) unless the item's check reads its times (``Tried.emulated``) or the item sets the cluster;
nbval's run at the defaults takes the emulated one. nbval (``pytest --nbval-lax notebooks``) executes every
notebook once more at its defaults and compares the cells marked ``# NBVAL_CHECK_OUTPUT`` with the outputs
stored in the notebook. A notebook without a Try item (``your-experiment``) would run twice at its
defaults: in a session where nbval runs it (``make test``), its papermill run here is deselected (conftest.py).
"""
from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import nbformat
import pytest
from reading import notebook_problems  # tests/reading.py: what a learner reads, cell by cell

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
LESSONS = [p.stem for p in NOTEBOOKS if re.match(r"\d", p.stem)]
DUMP = "<tried>"  # marks the line the appended cell prints: the notebook variables a check reads, as JSON

_spec = importlib.util.spec_from_file_location("nb_tool", ROOT / "tools" / "nb.py")
nb_tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(nb_tool)


def test_notebooks_match_their_sources():
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "nb.py"), "check"], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_checked_cells_have_stored_outputs(notebook):
    """nbval skips a cell that never ran: a checked cell whose source changed needs ``tools/nb.py refresh``."""
    stale = [i for i, c in enumerate(nbformat.read(notebook, as_version=4).cells)
             if c.cell_type == "code" and nb_tool.CHECK_MARK in c.source and c.execution_count is None]
    assert not stale, f"cells {stale} are marked {nb_tool.CHECK_MARK} but hold no stored output: run refresh"


# ---- what each lesson's Try item predicts ------------------------------------------------------------------------
# ``check(ns)``: ``ns`` holds the notebook variables named in ``reads`` after the run ("results": every rank's dict).

def _pcie_nodes(ns):  # 00, cluster = "pcie-100gbe": section 6b's nodes are that preset's (its closed forms held)
    from toolkit.runtime.cluster import PRESETS
    nodes = ns["two_nodes"]
    assert nodes["name"] == "pcie-100gbe"
    assert nodes["inter"]["bytes_per_s"] == PRESETS["pcie-100gbe"].inter.bytes_per_s


def _offload_on_stage_1(ns):  # 00b, stage = 1: the optimizer offload works there, the parameters' disk offload not
    off = ns["results"][0]["offload"]
    assert off["stage"] == 1 and "nvme_params" not in off["memory"]
    assert off["memory"]["cpu"]["device"]["optim"] == 0 and all(off["bitwise_equal_to_zero"].values())


def _one_tile_is_the_ring(ns):  # 01, tiles = 1: the tiled ring is the plain ring, to the emulated cluster's clock
    for r in ns["results"]:
        assert r["tiles"] == 1
        for op in ("AG+GEMM", "GEMM+RS"):
            virtual = r["ops"][op]["virtual"]["mean_s"]
            assert virtual["tiled ring"] == virtual["ring"], (op, virtual)


def _heavier_experts(ns):  # 02, d_ff = 2048: heavier experts, the same all-to-all bytes in both schedules
    for r in ns["results"]:
        assert r["model"]["d_ff"] == 2048 and r["check"]["grads_bitwise"]
        assert r["check"]["a2a_sent_bytes"]["serial"] == r["check"]["a2a_sent_bytes"]["overlapped"]


def _bubble_falls(ns):  # 03, m = 8: the run's schedules have 8 micro-batches, and their bubble falls as 1/m
    from toolkit.pipeline import Costs, simulate
    from toolkit.pipeline.schedule import make_schedule
    r0 = ns["results"][0]
    assert r0["m"] == 8 and sum(a.startswith("0F") for a in r0["orders"]["1f1b"][0]) == 8
    bubble = {m: simulate(make_schedule("1f1b", r0["p"], m), Costs()).bubble_fraction for m in (4, 8)}
    assert bubble[8] == (r0["p"] - 1) / (8 + r0["p"] - 1) < bubble[4]  # (p−1)/(m+p−1)


def _scales_cost_4_of_32(ns):  # 04, block = 32: int8 rows cost H + 4H/32 bytes, 0.5625x bf16's 2H, above 0.52
    sent = {m: sum(r["wire"]["sent_bytes"][m] for r in ns["results"]) for m in ("bf16", "int8")}
    assert ns["results"][0]["config"]["block"] == 32 and sent["int8"] / sent["bf16"] == (1 + 4 / 32) / 2 > 0.52


def _bitwise_at_4_ranks(ns):  # 05, world_size = 4: torch's hook and ours agree bit for bit; the byte model holds
    from toolkit.comm.edgc import allreduce_wire_bytes
    results = ns["results"]
    assert len(results) == 4
    assert all(row["grads_bitwise_equal"] for r in results for row in r["torch_vs_ours"]["steps"])
    assert all(r["torch_vs_ours"]["params_bitwise_equal"] for r in results)
    assert all(r["torch_vs_ours"]["sent_bytes_torch"] == r["torch_vs_ours"]["sent_bytes_ours"] for r in results)
    r0 = results[0]
    assert r0["edgc"]["predicted_allreduce_bytes"] == r0["edgc"]["allreduce_bytes"]
    assert r0["plain_step_bytes"] == allreduce_wire_bytes(r0["n_params"], 4)


def _no_intra_node_leg(ns):  # 06, world_size = 2: two nodes of one rank, every gradient byte crosses nodes
    for r in ns["results"]:
        sdp = r["runs"]["sdp4bit"]
        assert r["local"] == 1 and set(sdp["grads_bytes_by_link"]) == {"inter-node"}
        assert sdp["grads_bytes_per_step"] == sdp["grads_bytes_by_link"]["inter-node"]


def _saving_per_rank(ns):  # 07, world_size = 4: each rank saves 2/DP bytes per parameter, the whole job 2
    r0, sharded = ns["results"][0], [r["bytes_per_param_sharded"] for r in ns["results"]]
    assert r0["dp"] == 4 and sharded[0]["amp"]["master"] - sharded[0]["reuse"]["master"] == 2 / 4
    saved = sum(s["amp"]["bytes"]["master"] - s["reuse"]["bytes"]["master"] for s in sharded)
    assert saved == 2 * r0["numel_padded"]


def _late_without_prefetch(ns):  # 08, prefetch = False: reloads are not fetched ahead, so the backward waits
    for r in ns["results"]:
        row = next(x for x in r["rows"] if x["variant"] == "all")
        assert r["prefetch"] is False and (row["late_reloads"] > 0 or row["reloaded_bytes"] == 0)
    assert any(next(x for x in r["rows"] if x["variant"] == "all")["late_reloads"] for r in ns["results"])


def _blocks_swept(ns):  # 09, blocks = [16, 32, 64, 128, 0]: the sweep has exactly these, and block 16 joins it
    assert {row["block"] for row in ns["results"][0]["rows"]} == {16, 32, 64, 128, 0}


def _cap_of_one(ns):  # 10, keep = 1: the cap policy holds one micro-batch on every rank, simulated and run
    from toolkit.pipeline import Costs, one_f_one_b, simulate
    r0 = ns["results"][0]
    assert r0["keep"] == 1 and max(simulate(one_f_one_b(4, 8, "bubble", keep=1), Costs()).peak_mb) == 1


def _first_stage_peak(ns):  # 11, seq_chunks = 8: the first stage holds 1 + (p−1)/k micro-batches, measured
    p, k = len(ns["results"]), 8
    assert ns["cfg"]["seq_chunks"] == k
    assert ns["results"][0]["runs"]["seq1f1b-compute"]["peak_mb"] == 1 + (p - 1) / k


def _sim_cap(ns):  # 12, sim_cap = 4096: section 4's cost model runs at half the tokens per rank
    assert ns["setup"]["cap"] == 4096


def _vocab_peaks(ns):  # 13, m = 12: rank 0 holds p + 2 (Algorithm 1) and p + 1 (Algorithm 2) micro-batches
    r0, p = ns["results"][0], len(ns["results"])
    assert sum(a.startswith("0F") for a in r0["schedules"]["1f1b"][0]) == 12
    for alg, extra in (("vocab-1", 2), ("vocab-2", 1)):
        run = r0["runs"][alg]
        assert run["peak_act_bytes"] == (p + extra) * run["forward_bytes"][0]


def _one_node_per_token(ns):  # 14, max_nodes = 1: a token's experts sit on one node, so it crosses nodes once
    for r in ns["results"]:
        tokens, row = r["config"]["tokens"], r["two_hop"]["row_bytes"]
        assert sum(r["layout"]["tokens_per_node"]) == tokens  # every token counted on exactly one node
        assert r["two_hop"]["ledger"]["hop1"] <= tokens * row


def _uniform_routing(ns):  # 15, zipf_s = 0: the ranks are balanced before cloning, so the claim is not tested
    plan = ns["results"][0]["zipf"]["plan"]
    assert ns["results"][0]["config"]["zipf_s"] == 0 and plan["ratio_before"] <= 1.15
    assert "Zipf(0" in ns["rendered"] and "Zipf(1.2" not in ns["rendered"]  # the text follows the run's routing


def _four_stages(ns):  # 16, pp = 4, n_layer = 8, m = 8 on 4 ranks: one replica of four pipeline ranks
    r0 = ns["results"][0]
    assert (r0["pp"], r0["dp"], r0["m"], r0["model"]["n_layer"]) == (4, 1, 8, 8)


@dataclass(frozen=True)
class Tried:
    knob: str
    """Names the Try item the smoke run takes: its first item that sets this parameter."""
    check: Callable[[dict], None]
    """What the item predicts, on the run's variables (see ``reads``)."""
    reads: tuple[str, ...] = ("results",)
    refused: str = ""
    """The item predicts a refusal before any process starts: a text of the error."""
    emulated: bool = False
    """The check reads the emulated cluster's times: the run keeps the notebook's ``cluster``. Every other run
    takes ``cluster = "none"``, the path of a GPU run (where real time is the truth and the emulated sections
    step aside), which nbval's run at the defaults does not take."""


TRIED = {
    "00-foundations": Tried("cluster", _pcie_nodes, reads=("two_nodes",)),
    "00b-memory": Tried("stage", _offload_on_stage_1),
    "01-tp-overlap": Tried("tiles", _one_tile_is_the_ring, emulated=True),
    "02-moe-overlap": Tried("d_ff", _heavier_experts),
    "03-dualpipev": Tried("m", _bubble_falls),
    "04-int8-all-to-all": Tried("block", _scales_cost_4_of_32),
    "05-edgc": Tried("world_size", _bitwise_at_4_ranks),
    "06-sdp4bit": Tried("world_size", _no_intra_node_leg),
    "07-param-reuse": Tried("world_size", _saving_per_rank),
    "08-activation-offload": Tried("prefetch", _late_without_prefetch),
    "09-int8-vs-fp8": Tried("blocks", _blocks_swept),
    "10-recompute-in-bubbles": Tried("keep", _cap_of_one),
    "11-seq1f1b": Tried("seq_chunks", _first_stage_peak, reads=("results", "cfg")),
    "12-dynamic-cp": Tried("sim_cap", _sim_cap, reads=("results", "setup")),
    "13-vocab-parallel": Tried("m", _vocab_peaks),
    "14-deepep": Tried("max_nodes", _one_node_per_token),
    "15-echo": Tried("zipf_s", _uniform_routing),
    "16-cuda-graphs": Tried("pp", _four_stages),
    "17-capstone": Tried("pp", lambda ns: None, refused="turning on 'dualpipev'"),
}


def tried_params(name: str) -> dict:
    """The knobs (with values) of the Try item ``TRIED[name]`` names."""
    item = next(s for s in nb_tool.suggestions(name) if s.how == "parameters" and TRIED[name].knob in s.knobs)
    return {k: v for k, v in item.knobs.items() if v is not nb_tool.NO_VALUE}


def test_every_lesson_takes_a_try_item():
    assert sorted(TRIED) == LESSONS
    for name in LESSONS:
        assert tried_params(name), f"{name}: the item naming {TRIED[name].knob!r} gives it no value"


# ---- the prose a run rendered against its headline ---------------------------------------------------------------

POSITIVE = re.compile(r"(?<!not )\breproduc(?:ed|es)\b", re.I)
NEGATIVE = re.compile(r"\bnot reproduced\b|\bdoes not reproduce\b", re.I)


def rendered(nb) -> str:
    """The markdown a run displayed (its prose rendered from the results), the headline's own output left out."""
    from toolkit.report import MIME
    return "\n".join(out["data"]["text/markdown"] for cell in nb.cells for out in cell.get("outputs", [])
                     if "text/markdown" in out.get("data", {}) and MIME not in out["data"])


def printed(nb) -> str:
    return "".join(out.get("text", "") for cell in nb.cells for out in cell.get("outputs", []))


def verdict_conflicts(text: str, reproduced: bool | None) -> list[str]:
    """Sentences of ``text`` whose verdict contradicts the headline's: one that calls something "not reproduced"
    when the headline says reproduced, or "reproduced" when the headline says not."""
    sentences = re.split(r"(?<=[.;!?])\s+|\n+", text)
    bad = NEGATIVE if reproduced is True else POSITIVE if reproduced is False else None
    return [s.strip() for s in sentences if bad is not None and bad.search(s)]


def test_verdict_conflicts_are_found():
    text = "- *\"Clone hot experts\"*: reproduced with the greedy planner.\nBytes: 0.5x. It is not reproduced here."
    assert verdict_conflicts(text, False) == ["- *\"Clone hot experts\"*: reproduced with the greedy planner."]
    assert verdict_conflicts(text, True) == ["It is not reproduced here."]
    assert verdict_conflicts(text, None) == []


# ---- the run ---------------------------------------------------------------------------------------------------

@pytest.mark.notebook
@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_at_smoke_preset(notebook, tmp_path):
    from nbclient.exceptions import CellTimeoutError
    from papermill.exceptions import PapermillExecutionError

    from toolkit.report import collect

    tried = TRIED.get(notebook.stem)
    params = {"preset": "smoke", **({"cluster": "none"} if tried and not tried.emulated else {}),
              **(tried_params(notebook.stem) if tried else {})}  # a Try item that sets the cluster wins
    nb = nbformat.read(notebook, as_version=4)
    if tried:  # a last cell prints what the check reads
        nb.cells.append(nbformat.v4.new_code_cell(
            f"import json as _json\nprint({DUMP!r} + _json.dumps({{_n: globals().get(_n) for _n in {tried.reads!r}}}, "
            "default=lambda o: o.to_dict() if hasattr(o, 'to_dict') else getattr(o, '__dict__', repr(o))))"))
    source = tmp_path / notebook.name
    nbformat.write(nb, source)

    def run(name: str):
        nb_tool.execute(source, tmp_path / name, params, cwd=str(notebook.parent), kernel_name="python3",
                        execution_timeout=CELL_TIMEOUT_S)
        return tmp_path / name

    start = time.monotonic()
    try:
        try:
            executed = run("run-" + notebook.name)
        except CellTimeoutError:
            # Seen once in a clean clone: the kernel had finished the cell and sat idle while the client waited
            # for its reply forever (a lost message below papermill: nteract/papermill#705, #711). Run it once
            # more; a cell that really hangs times out again and fails the test.
            executed = run("retry-" + notebook.name)
    except PapermillExecutionError as err:
        if not (tried and tried.refused):
            raise
        assert err.ename == "ValueError" and tried.refused in err.evalue, (err.ename, err.evalue)
        failed = nbformat.read(tmp_path / ("run-" + notebook.name), as_version=4).cells[err.cell_index]
        assert "launch(" not in failed.source, "refused in the cell that launches: after processes started?"
        return
    finally:
        print(f"{notebook.stem} {params}: {time.monotonic() - start:.1f} s at smoke")
    assert not (tried and tried.refused), f"the Try item predicts a refusal ({tried.refused!r}); the run went on"
    out = nbformat.read(executed, as_version=4)
    problems = notebook_problems(out)  # what a learner reads (tests/reading.py)
    assert not problems, "\n".join(problems)
    text = rendered(out)
    headline = collect(executed)
    if headline is not None:
        word = headline["reproduced"]["word"]
        conflicts = verdict_conflicts(text, {"reproduced": True, "not reproduced": False}.get(word))
        assert not conflicts, (f"the headline says {word!r}; the run's prose says otherwise:\n" + "\n".join(conflicts))
    if tried:
        line = next(line for line in printed(out).splitlines() if line.startswith(DUMP))
        tried.check({**json.loads(line[len(DUMP):]), "rendered": text})


CELL_TIMEOUT_S = 150  # per cell: the longest cell at smoke takes under a minute on 2 cores without bf16 GEMMs


# ---- a loaded laptop ---------------------------------------------------------------------------------------------
def test_lesson_03_draws_what_it_measured_beside_a_cpu_hog(tmp_path):
    """Two busy processes on the cores the ranks share (a laptop running something else): lesson 03's measured op
    times feed its simulator and closed forms, and noise there (a W as long as its B) is said, never a crash."""
    from toolkit.report import collect
    notebook = next(p for p in NOTEBOOKS if p.stem == "03-dualpipev")
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        nb_tool.execute(notebook, tmp_path / notebook.name, {"preset": "smoke"}, cwd=str(notebook.parent),
                        kernel_name="python3", execution_timeout=CELL_TIMEOUT_S)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    assert collect(tmp_path / notebook.name)["reproduced"]["word"] in ("check holds", "check fails")
