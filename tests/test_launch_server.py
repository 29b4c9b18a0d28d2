"""The launch server (``toolkit.runtime.launch_server``): launches forked from one pre-imported launcher compute
what a fresh launcher's compute, report a failure and a hang as a fresh one does, leave nothing behind, and are
declined (the caller starts its own launcher) when the caller's environment is not the one the server imported
under. Each test runs its own server; the processes of a served launch are the server's descendants."""
from __future__ import annotations

import os
import threading
import time

import psutil
import pytest

from toolkit import LaunchError, LaunchTimeout, launch
from toolkit.runtime import launch_server
from toolkit.runtime.launch import serving
from toolkit.runtime.launch_server import SERVER_ENV, mismatch

TIMEOUT_S = 30  # as tests/test_faults.py: a loaded 2-core machine needs the margin to start 2 ranks


def descendants_after(server, within_s: float = 5.0) -> list[psutil.Process]:
    """The server's processes still alive after ``within_s``: none once its launches have ended."""
    end = time.monotonic() + within_s
    while True:
        left = [p for p in psutil.Process(server.pid).children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE]
        if not left or time.monotonic() > end:
            return left
        time.sleep(0.1)


@pytest.fixture
def server():
    with serving(threads=2) as running:
        assert running.ready, running.log.read_text()
        yield running
    assert os.environ.get(SERVER_ENV) != running.path  # the owner's previous setting is back


def test_a_served_launch_computes_the_bits_of_a_fresh_launcher(server, tmp_path, monkeypatch):
    served = launch("toolkit.lessons.selftest:ddp_steps", 2, {}, threads=2, progress="none")
    assert server.summary().startswith("1 launches served, 0 declined"), server.log.read_text()
    monkeypatch.delenv(SERVER_ENV)
    fresh = launch("toolkit.lessons.selftest:ddp_steps", 2, {}, threads=2, progress="none")
    assert [r["forked"] for r in served] == [True, True] and [r["threads"] for r in served] == [2, 2]
    assert [r["bits"] for r in served] == [r["bits"] for r in fresh]
    assert not descendants_after(server)


def test_a_served_launch_names_a_killed_rank_and_leaves_nothing(server, tmp_path):
    with pytest.raises(LaunchError) as info:
        launch("fault_targets:killed", 2, {}, threads=2, timeout_s=TIMEOUT_S, progress="none",
               out_dir=tmp_path / "out")
    assert info.value.rank == 1 and str(info.value).startswith("rank 1 of 2 was killed by SIGKILL (signal 9)")
    assert server.summary().startswith("1 launches served"), server.log.read_text()
    assert not descendants_after(server)


def test_a_served_launch_that_hangs_times_out_with_its_stacks_and_leaves_nothing(server, tmp_path):
    with pytest.raises(LaunchTimeout) as info:
        launch("toolkit.lessons.selftest:hang", 2, {"bad_rank": 1}, threads=2, timeout_s=TIMEOUT_S,
               progress="none", out_dir=tmp_path / "out")
    assert "ranks without a result: [1]" in str(info.value) and "in hang" in info.value.traceback
    assert not descendants_after(server)


def test_the_launcher_killed_is_reported_as_a_fresh_ones_death(server, tmp_path):
    out = tmp_path / "out"

    def kill_the_launcher() -> None:  # the server's grandchild: watcher, then the launcher (torchrun's agent)
        end = time.monotonic() + 60
        while not all((out / f"hanging{r}").exists() for r in (0, 1)) and time.monotonic() < end:
            time.sleep(0.1)
        for watcher in psutil.Process(server.pid).children():
            for agent in watcher.children():
                agent.kill()

    killer = threading.Thread(target=kill_the_launcher)
    killer.start()
    with pytest.raises(LaunchError) as info:
        launch("fault_targets:hangs", 2, {}, threads=2, timeout_s=TIMEOUT_S, progress="none", out_dir=out)
    killer.join()
    assert str(info.value).startswith("the launcher process (accelerate launch, torchrun's agent) was killed by "
                                      "SIGKILL (signal 9), and every rank with it"), str(info.value)
    assert not descendants_after(server)


def test_another_environment_is_declined_and_launches_afresh(server, monkeypatch):
    monkeypatch.setenv("TOOLKIT_SOME_SETTING", "1")
    res = launch("toolkit.lessons.selftest", 2, {}, threads=2, progress="none")
    assert [r["sum"] for r in res] == [3.0, 3.0]
    assert server.summary() == ("0 launches served, 1 declined (they started their own launcher); 1 as the "
                                "environment differs in TOOLKIT_SOME_SETTING"), server.log.read_text()


def test_what_a_kernel_sets_does_not_count_and_changed_sources_do():
    env = {"PATH": "/bin", "OMP_NUM_THREADS": "1"}
    kernel = dict(env, JPY_PARENT_PID="1", MPLBACKEND="inline", PYTEST_CURRENT_TEST="x", PLOTLY_RENDERER="json")
    assert mismatch(kernel, env, "a", "a") == ""
    assert mismatch(dict(env, OMP_NUM_THREADS="2"), env, "a", "a") == "the environment differs in OMP_NUM_THREADS"
    assert mismatch(env, env, "b", "a") == "the interpreter or the toolkit's sources changed"
    assert launch_server.sources() == launch_server.sources()


def test_no_server_at_the_path_starts_a_fresh_launcher(monkeypatch, tmp_path):
    monkeypatch.setenv(SERVER_ENV, str(tmp_path / "nobody-listens"))
    assert launch_server.request(str(tmp_path / "nobody-listens"), [], {}, tmp_path / "log") is None
    res = launch("toolkit.lessons.selftest", 2, {}, progress="none")
    assert [r["sum"] for r in res] == [3.0, 3.0]
