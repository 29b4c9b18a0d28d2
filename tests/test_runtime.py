"""The launcher, process grid, communication ledger and benchmark metrics, on real processes."""
from __future__ import annotations

import importlib
import json
import time
import warnings

import psutil
import pytest

from toolkit.runtime import LaunchError, LaunchTimeout, ProcessGrid, compat, launch, validate_grid
from toolkit.runtime import caller_start, caller_watch
from toolkit.runtime.bench import comm_efficiency_ratio, measure, memory_volatility
from toolkit.runtime.server_process import SERVER_ENV

LESSON = "toolkit.lessons.selftest"


@pytest.fixture
def fresh_launcher(monkeypatch):
    """The launch starts its own launcher: ``_workers_alive`` finds a launch's processes by their command line,
    which carries its out_dir; a served launcher's is the server's (tests/test_launch_server.py has its faults)."""
    monkeypatch.delenv(SERVER_ENV, raising=False)


def _workers_alive(marker: str) -> list[psutil.Process]:
    alive = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "toolkit.runtime." in cmd and marker in cmd:  # the agent and its ranks (forked or started afresh)
            alive.append(p)
    return alive


def test_launch_returns_every_rank():
    res = launch(LESSON, 2, {"steps": 3}, progress="plain", timeout_s=120)
    assert [r["rank"] for r in res] == [0, 1]
    assert all(r["sum"] == 3.0 and r["world_size"] == 2 and r["backend"] == "gloo" for r in res)
    assert res.wall_s > 0


@pytest.mark.usefixtures("fresh_launcher")
def test_failing_rank_is_named_with_its_traceback(tmp_path):
    with pytest.raises(LaunchError) as info:
        launch(f"{LESSON}:fail", 2, {"bad_rank": 1}, timeout_s=120, progress="none", out_dir=tmp_path)
    err = info.value
    assert err.rank == 1
    assert "rank 1 of 2 failed with RuntimeError: deliberate failure on rank 1" in str(err)
    assert "selftest.py" in err.traceback and "raise RuntimeError" in err.traceback
    written = json.loads((tmp_path / "rank1.error.json").read_text())  # renamed into place whole
    assert written["rank"] == 1 and written["type"] == "RuntimeError" and not list(tmp_path.glob("*.tmp"))
    time.sleep(0.5)
    assert not _workers_alive(str(tmp_path))


@pytest.mark.usefixtures("fresh_launcher")
def test_hanging_rank_times_out_with_its_stack_and_no_orphans(tmp_path):
    start = time.monotonic()
    with pytest.raises(LaunchTimeout) as info:
        # 30 s: long enough for the healthy rank to start and finish on a loaded 2-core machine (as test_faults)
        launch(f"{LESSON}:hang", 2, {"bad_rank": 1}, timeout_s=30, progress="none", out_dir=tmp_path)
    assert time.monotonic() - start < 60
    assert "ranks without a result: [1]" in str(info.value)
    assert "in hang" in info.value.traceback  # the watchdog's stack of the hung rank
    time.sleep(0.5)
    assert not _workers_alive(str(tmp_path))


@pytest.mark.parametrize("kwargs, match", [
    ({"world_size": 0}, "world_size must be a positive int"),
    ({"world_size": 2.0}, "world_size must be a positive int"),
    ({"world_size": 2, "backend": "mpi"}, "backend='mpi' is not allowed"),
    ({"world_size": 2, "backend": "nccl"}, "nccl"),
    ({"world_size": 2, "lesson": "toolkit.lessons.selftest:nope"}, "has no function 'nope'"),
    ({"world_size": 2, "lesson": "l99_no_such_lesson"}, "lessons that exist: .*'l00_foundations'"),
    ({"world_size": 2, "lesson": "no such thing!"}, "is not a lesson name or 'module:function'"),
    ({"world_size": 2, "lesson": 42}, "lesson must be a lesson name"),
    ({"world_size": 2, "timeout_s": 0}, "timeout_s must be > 0"),
    ({"world_size": 2, "progress": "fancy"}, "progress='fancy'"),
    ({"world_size": 2, "cfg": [1, 2]}, "cfg must be a dict"),
    ({"world_size": 2, "cfg": {"x": object()}}, "cfg must be JSON-able"),
    ({"world_size": 2, "seed": -1}, "seed must be an int >= 0"),
    ({"world_size": 2, "threads": 0}, "threads must be a positive int"),
    ({"world_size": 2, "accelerate_args": "--num_machines 2"}, "accelerate_args must be a list of strings"),
    ({"world_size": 2, "phases": [("a", 0)]}, "every phase must be \\(name, weight > 0\\)"),
    ({"world_size": 2, "phases": [("a", 1), ("a", 2)]}, "phase 'a' is declared twice"),
    ({"world_size": 10_000}, "world_size=10000 is far beyond this machine"),
])
def test_bad_launch_arguments_fail_before_any_process(kwargs, match, monkeypatch):
    started = []
    monkeypatch.setattr(caller_start.subprocess, "Popen", lambda *a, **k: started.append(a))
    lesson = kwargs.pop("lesson", LESSON)
    with pytest.raises(ValueError, match=match):
        launch(lesson, **kwargs)
    assert not started


def test_cheap_checks_import_nothing_heavy():
    """A bad world size or lesson name is refused before torch (or any lesson) is imported."""
    import subprocess
    import sys
    code = ("import sys\nfrom toolkit import launch\n"
            "for args in ((LESSON, 0), ('l99_missing', 2), (LESSON, 2, [1])):\n"
            "    try:\n        launch(*args)\n    except ValueError:\n        pass\n"
            "    else:\n        raise SystemExit('no error')\n"
            "print(sorted(m for m in ('torch', 'numpy', 'toolkit.lessons.selftest') if m in sys.modules))\n"
            ).replace("LESSON", repr(LESSON))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_far_too_many_ranks_are_refused_unless_allowed(monkeypatch):
    launch_module = importlib.import_module("toolkit.runtime.launch")
    monkeypatch.setattr(launch_module.os, "cpu_count", lambda: 2)
    with pytest.raises(ValueError, match="world_size=10000 is far beyond this machine \\(2 CPU cores.*"
                                         "oversubscribe=True"):
        launch_module.check_capacity(10_000, "gloo")
    with pytest.raises(ValueError, match="far beyond"):  # 9 ranks: more than 4 per core
        launch_module.check_capacity(9, "gloo")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert launch_module.check_capacity(10_000, "gloo", oversubscribe=True) == "gloo"
        assert launch_module.check_capacity(8, "gloo") == "gloo"
        # on two machines, this one starts half of the ranks
        assert launch_module.check_capacity(16, "gloo", ["--num_machines", "2"]) == "gloo"


def test_more_ranks_than_cores_warns(monkeypatch):
    launch_module = importlib.import_module("toolkit.runtime.launch")  # the module, not the function
    monkeypatch.setattr(launch_module.os, "cpu_count", lambda: 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        launch_module.check_capacity(2, "gloo")
    assert any("more ranks than the 1 CPU cores" in str(w.message) for w in caught)


def test_launch_inside_a_rank_is_refused(monkeypatch):
    launch_module = importlib.import_module("toolkit.runtime.launch")
    monkeypatch.setenv(launch_module.RANK_ENV, "1")
    with pytest.raises(RuntimeError, match="called inside a rank"):
        launch(LESSON, 2)


def test_timeout_kills_the_tree_once(tmp_path, monkeypatch):
    import sys
    real, kills = caller_watch.kill_tree, []
    monkeypatch.setattr(caller_watch, "kill_tree", lambda pid: (kills.append(pid), real(pid)))
    cmd = [sys.executable, "-c", "import time; time.sleep(60)"]
    with pytest.raises(LaunchTimeout, match="timed out after 1s"):
        caller_watch.run_ranks(cmd, {}, tmp_path, 1, 1.0, None, "sleeper")
    assert len(kills) == 1


def test_rank_files_are_written_atomically(tmp_path, monkeypatch):
    """A rank writes results and errors through a temporary file: a failed write leaves the old file whole."""
    from pathlib import Path

    from toolkit.runtime.rank_process import write_atomic
    target = tmp_path / "rank0.error.json"
    write_atomic(target, '{"complete": true}')
    assert target.read_text() == '{"complete": true}' and not list(tmp_path.glob("*.tmp"))
    real = Path.write_text

    def half_write(self, text, *a, **k):
        real(self, text[:3], *a, **k)
        raise OSError("disk full")
    monkeypatch.setattr(Path, "write_text", half_write)
    with pytest.raises(OSError):
        write_atomic(target, '{"complete": false, "long": "..."}')
    monkeypatch.undo()
    assert target.read_text() == '{"complete": true}'


def test_validate_grid_names_the_parameter():
    assert validate_grid(8, tp=2, pp=2) == {"dp": 2, "pp": 2, "tp": 2, "cp": 1, "ep": 1}
    with pytest.raises(ValueError, match="world_size=6 is not divisible by pp\\*tp\\*cp=4"):
        validate_grid(6, tp=2, pp=2)
    with pytest.raises(ValueError, match="must equal dp\\*pp\\*cp\\*tp"):
        validate_grid(8, dp=3, tp=2)
    with pytest.raises(ValueError, match="ep=3 must divide dp=4"):
        validate_grid(4, ep=3)
    with pytest.raises(ValueError, match="tp must be a positive int"):
        validate_grid(4, tp=0)


def test_grid_layout_is_megatron_order():
    # world 8 = pp2 x dp2 x tp2, tp fastest (no process group needed to check the layout)
    g = ProcessGrid.build(8, 5, tp=2, pp=2)
    assert g.coords == {"pp": 1, "dp": 0, "cp": 0, "tp": 1}
    assert g.ranks("tp") == [4, 5] and g.ranks("dp") == [5, 7] and g.ranks("pp") == [1, 5]
    assert g.rank_in("dp") == 0 and g.size("world") == 8
    with pytest.raises(ValueError, match="unknown group 'xx'"):
        g.group("xx")


@pytest.fixture(scope="module")
def ledger_run():
    return launch(f"{LESSON}:ledger_ops", 4, {"n": 8}, progress="none", timeout_s=180)


def test_ledger_counts_exact_bytes(ledger_run):
    n, w, f32 = 8, 4, 4
    recs = {(r["op"], r["group"], r["tag"]): r for r in ledger_run[1]["records"]}
    assert recs[("all_reduce", "world", "untagged")]["sent_bytes"] == 2 * (w - 1) * n * f32 // w
    assert recs[("all_gather_into_tensor", "world", "untagged")]["sent_bytes"] == (w - 1) * n * f32
    assert recs[("reduce_scatter_tensor", "world", "untagged")]["sent_bytes"] == (w - 1) * n * f32
    assert recs[("all_to_all_single", "world", "untagged")]["sent_bytes"] == (w - 1) * n * f32
    assert recs[("broadcast", "world", "untagged")]["sent_bytes"] == n * f32
    assert recs[("reduce", "world", "untagged")]["sent_bytes"] == (w - 1) * n * f32 // w
    assert recs[("recv", "world", "p2p")]["recv_bytes"] == n * f32 and recs[("recv", "world", "p2p")]["sent_bytes"] == 0
    if compat.missing("single_collectives") is None:  # torch >= 2.13: the new names, counted under the old ones
        assert recs[("all_gather_into_tensor", "world", "single")]["sent_bytes"] == (w - 1) * n * f32
        assert recs[("reduce_scatter_tensor", "world", "single")]["sent_bytes"] == (w - 1) * n * f32
    assert recs[("all_reduce", "tp", "untagged")]["group_size"] == 2
    assert recs[("all_reduce", "tp", "untagged")]["sent_bytes"] == n * f32  # 2(n-1)/n with n=2
    rank0 = {(r["op"], r["tag"]) for r in ledger_run[0]["records"]}
    assert ("send", "p2p") in rank0
    summary = {(r["op"], r["group"]): r for r in ledger_run[1]["summary"]}
    assert summary[("all_reduce", "world")]["calls"] == 2  # sync + async
    assert summary[("isend", "p2p")]["sent_bytes"] == n * f32 and summary[("irecv", "p2p")]["recv_bytes"] == n * f32
    assert all(r["seconds"] >= 0 for r in ledger_run[1]["records"])


def test_grid_groups_on_real_ranks(ledger_run):
    assert [r["tp_ranks"] for r in ledger_run] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["dp_ranks"] for r in ledger_run] == [[0, 2], [1, 3], [0, 2], [1, 3]]


def test_bench_measure_and_metrics():
    calls = []
    res = measure(lambda: calls.append(1), warmup=2, steps=4, rounds=5, trim=1)
    assert len(calls) == 2 + 4 * 5 and len(res.step_times_s) == 20 and len(res.round_means_s) == 5
    kept = sorted(res.round_means_s)[1:4]
    assert res.mean_s == pytest.approx(sum(kept) / 3)
    assert res.throughput_stability >= 0
    assert memory_volatility([10, 10, 10]) == 0.0
    assert memory_volatility([5, 15]) == pytest.approx(0.5)
    assert comm_efficiency_ratio(0.3, 1.0, 0.6) == pytest.approx(0.75)
    with pytest.raises(ValueError, match="steps >= 1"):
        measure(lambda: None, steps=0)


def test_one_rank_runs_without_torchrun():
    """accelerate refuses --multi_gpu for one process; the rank then sets up a one-rank group itself."""
    (res,) = launch(LESSON, 1, {}, progress="none", timeout_s=60)
    assert res["world_size"] == 1 and res["sum"] == 1.0
