"""Faults beyond a Python exception, on real processes: a rank killed, a rank that exits, out of memory, a full
disk, a result JSON cannot hold, the caller killed, interrupted or frozen, torchrun's agent killed, two launches
at once.

Each case checks what the user is told (the faulty rank, or the caller, and the cause) and that no process of
the launch is left on the machine: every process whose command line carries the launch's out_dir (torchrun's
agent, ``-m toolkit.runtime.launcher_process ... OUT_DIR/spec.json``, and each rank: forked from the agent, its
command line is the agent's; started afresh, ``-m toolkit.runtime.rank_process OUT_DIR/spec.json``), whoever its
parent now is.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from toolkit import LaunchError, launch
from toolkit.runtime.server_process import SERVER_ENV

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
TIMEOUT_S = 30  # a failing launch ends long before; a loaded 2-core machine needs the margin to start 2 ranks
LEFT_WAIT_S = 5.0  # the launch's promise: nothing is left this long after the caller dies, or after its deadline


@pytest.fixture(autouse=True)
def _fresh_launcher(monkeypatch):
    """Every launch here starts its own launcher: these cases find a launch's processes by their command line,
    which carries its out_dir; a served launcher's is the server's (tests/test_launch_server.py has its faults)."""
    monkeypatch.delenv(SERVER_ENV, raising=False)


def launch_processes(out_dir: Path) -> list[str]:
    """Command lines of the launch's processes still on the machine (zombies are gone already)."""
    left = []
    for p in psutil.process_iter(["cmdline", "status"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "toolkit.runtime." in cmd and str(out_dir) in cmd and p.info["status"] != psutil.STATUS_ZOMBIE:
            left.append(cmd)
    return left


def wait_gone(out_dir: Path, within_s: float) -> list[str]:
    """Poll until no process of the launch is left, for at most ``within_s``; what is left then."""
    end = time.monotonic() + within_s
    while (left := launch_processes(out_dir)) and time.monotonic() < end:
        time.sleep(0.1)
    return left


def failing(fn: str, tmp_path: Path, **cfg) -> LaunchError:
    """Launch ``fault_targets:fn`` on 2 ranks, expecting LaunchError; nothing of it may be left."""
    with pytest.raises(LaunchError) as info:
        launch(f"fault_targets:{fn}", 2, cfg, timeout_s=TIMEOUT_S, progress="none", out_dir=tmp_path / "out")
    assert not wait_gone(tmp_path / "out", LEFT_WAIT_S)
    return info.value


def caller(tmp_path: Path, fn: str, timeout_s: float = TIMEOUT_S, **cfg) -> subprocess.Popen:
    """A Python process that calls launch and prints the results as JSON (what a notebook kernel is)."""
    # SIGINT handled as a kernel handles it: the process would inherit an ignored SIGINT from this pytest worker,
    # where an earlier test's library left it ignored (seen in the full suite, never alone)
    code = (f"import json, signal, sys; sys.path.insert(0, {str(TESTS)!r})\n"
            "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
            "from toolkit import launch\n"
            f"res = launch('fault_targets:{fn}', 2, {cfg!r}, timeout_s={timeout_s}, progress='none', "
            f"out_dir={str(tmp_path / 'out')!r})\n"
            "print(json.dumps(list(res)))\n")
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def hanging(tmp_path: Path, timeout_s: float = TIMEOUT_S) -> subprocess.Popen:
    """A caller whose 2 ranks have started and hang."""
    proc = caller(tmp_path, "hangs", timeout_s)
    end = time.monotonic() + 60
    while not all((tmp_path / "out" / f"hanging{r}").exists() for r in (0, 1)):
        assert proc.poll() is None and time.monotonic() < end, proc.communicate()
        time.sleep(0.1)
    return proc


# ---- a rank ------------------------------------------------------------------------------------------------
def test_a_rank_killed_by_sigkill_is_the_root_cause_not_its_peer(tmp_path):
    err = failing("killed", tmp_path)
    message = str(err)
    assert err.rank == 1 and message.startswith("rank 1 of 2 was killed by SIGKILL (signal 9)"), message
    assert "out-of-memory killer" in message
    consequences = message.split("consequences on the other ranks:")[1]
    assert consequences.lstrip().startswith("rank 0 "), message  # its gloo error is listed second, as a consequence


def test_a_rank_that_exits_without_a_result(tmp_path):
    err = failing("exits", tmp_path)
    assert err.rank == 1 and str(err).startswith("rank 1 of 2 exited with code 3 with no result and no exception")


def test_a_failed_launch_removes_its_temporary_files_unless_asked_to_keep_them(tmp_path, monkeypatch):
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where launch's mkdtemp makes its folder
    for keep in (False, True):
        with pytest.raises(LaunchError) as info:
            launch("fault_targets:exits", 2, {}, timeout_s=TIMEOUT_S, progress="none", keep_files=keep)
        left = sorted(tmp_path.glob("toolkit-*"))
        if keep:
            assert len(left) == 1 and f"(the ranks' files: {left[0]})" in str(info.value)
            assert (left[0] / "launch.log").exists()
        else:
            assert not left and "launch(..., keep_files=True) keeps them" in str(info.value)


def test_a_result_json_cannot_hold_names_the_rank_the_key_and_the_type(tmp_path):
    err = failing("returns_a_set", tmp_path)
    assert err.rank == 1
    assert str(err).startswith("rank 1 of 2 failed with TypeError: the function's result is not JSON-able: "
                               "result['curve']['points'] is a set ({1, 2})"), str(err)


def test_out_of_memory_is_named_whatever_the_exception_class(tmp_path):
    err = failing("out_of_memory", tmp_path)
    assert err.rank == 1 and str(err).startswith("rank 1 of 2 ran out of memory ("), str(err)
    assert "RuntimeError" in str(err)  # torch's allocator raises RuntimeError, not MemoryError


@pytest.mark.parametrize("fn, what", [("nvme_disk_full", r"nvme-optimizer: write of [\d,]+ bytes in "),
                                      ("spill_disk_full", r"activation-spill: reserving 1,048,576 bytes in ")])
def test_a_full_disk_under_offload_names_the_path_and_the_bytes(tmp_path, fn, what):
    disk = tmp_path / "disk"
    disk.mkdir()
    err = failing(fn, tmp_path, dir=str(disk))
    first = str(err).splitlines()[0]
    assert err.rank == 1 and first.startswith("rank 1 of 2 failed with OffloadIOError"), first
    assert re.search(what + re.escape(str(disk)) + " failed: File too large", first), first


def test_a_config_validate_passed_that_fails_at_run_time(tmp_path):
    with pytest.raises(ValueError, match="rows must be a positive int, got 0"):
        launch("fault_targets:reshape_rows", 2, {"rows": 0}, progress="none", out_dir=tmp_path / "out")
    err = failing("reshape_rows", tmp_path, rows=5)
    assert str(err).startswith(f"rank {err.rank} of 2 failed with RuntimeError: shape '[5, -1]' is invalid for input "
                               "of size 12"), str(err)
    assert "view(cfg[\"rows\"], -1)" in err.traceback


@pytest.mark.parametrize("make", [lambda p: p / "a-file" / "out", lambda p: p / "a-file"])
def test_an_out_dir_that_cannot_be_written_is_refused_before_launch(tmp_path, make):
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ValueError, match="out_dir=.* cannot be written"):
        launch("fault_targets:all_reduce", 2, {"value": 1}, progress="none", out_dir=make(tmp_path))
    assert not launch_processes(tmp_path)


# ---- the caller ----------------------------------------------------------------------------------------------
def test_the_caller_killed_leaves_no_rank(tmp_path):
    proc = hanging(tmp_path)
    proc.kill()  # a restarted kernel, a killed papermill job
    proc.communicate()
    assert not wait_gone(tmp_path / "out", LEFT_WAIT_S)
    log = (tmp_path / "out" / "launch.log").read_text()
    assert f"the process that called launch (pid {proc.pid}) is gone: exiting" in log


def test_sigint_to_the_caller_raises_keyboard_interrupt_and_leaves_no_rank(tmp_path):
    proc = hanging(tmp_path)
    proc.send_signal(signal.SIGINT)  # JupyterLab's stop button
    _, err = proc.communicate(timeout=60)
    assert "KeyboardInterrupt" in err
    assert not wait_gone(tmp_path / "out", LEFT_WAIT_S)


def test_a_frozen_caller_ranks_end_at_the_deadline_with_their_stacks(tmp_path):
    timeout_s = 20  # how long this case takes: the ranks outlive nothing
    proc = caller(tmp_path, "hangs", timeout_s)
    end = time.monotonic() + 60
    while not (tmp_path / "out" / "launch.log").exists():  # torchrun's agent is started
        assert proc.poll() is None and time.monotonic() < end, proc.communicate()
        time.sleep(0.1)
    proc.send_signal(signal.SIGSTOP)  # alive, but it will never kill its ranks
    try:
        spec = json.loads((tmp_path / "out" / "spec.json").read_text())
        assert not wait_gone(tmp_path / "out", spec["deadline"] - time.time() + LEFT_WAIT_S)
    finally:
        proc.kill()
        proc.communicate()
    hung = [r for r in (0, 1) if (tmp_path / "out" / f"hanging{r}").exists()]
    assert hung, "no rank got to hang before the deadline (the machine is too loaded for this case)"
    for r in hung:  # each dumped its stack on its way out
        assert "in hangs" in (tmp_path / "out" / f"rank{r}.stack.txt").read_text()


def test_two_launches_at_once_from_two_processes(tmp_path):
    procs = [caller(tmp_path / str(v), "all_reduce", 2 * TIMEOUT_S, value=v) for v in (10, 20)]
    outs = [p.communicate(timeout=4 * TIMEOUT_S) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert [json.loads(out.splitlines()[-1]) for out, _ in outs] == [[{"sum": 21.0}] * 2, [{"sum": 41.0}] * 2]
    for v in (10, 20):
        assert not launch_processes(tmp_path / str(v))


# ---- reading torchrun's report (no processes) ---------------------------------------------------------------
REPORT = """W1202 00:31:43.638000 5573 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 5593 closing signal SIGTERM
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
Failures:
[1]:
  time      : 2026-12-02_00:31:43
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 5593)  (SIGTERM)
  traceback : Signal 15 (SIGTERM) received by PID 5593
------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-02_00:31:43
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 5594)  (SIGKILL)
  traceback : Signal 9 (SIGKILL) received by PID 5594
"""


def test_torchrun_report_gives_exit_statuses_the_stopped_ranks_and_its_root_cause():
    from toolkit.runtime.caller_watch import torchrun_report
    assert torchrun_report(REPORT) == ({0: -15, 1: -9}, {0}, 1)
    one_rank = "subprocess.CalledProcessError: Command '['python', '-m', 'x']' died with <Signals.SIGKILL: 9>."
    assert torchrun_report(one_rank) == ({0: -9}, set(), None)
    exit3 = "subprocess.CalledProcessError: Command '['python', '-m', 'x']' returned non-zero exit status 3."
    assert torchrun_report(exit3) == ({0: 3}, set(), None)


def test_a_silent_death_outranks_an_exception_torchrun_saw_first_and_a_rank_that_never_started_is_not_blamed(
        tmp_path):
    from toolkit.runtime.caller_watch import failure
    for r in (0, 1):
        (tmp_path / f"rank{r}.stack.txt").write_text("")  # both started
    (tmp_path / "rank0.error.json").write_text(json.dumps(
        {"rank": 0, "time": 1.0, "type": "RuntimeError", "message": "Connection closed by peer", "cause": None,
         "traceback": "..."}))
    # both exits seen in one poll, in the same second: torchrun's report blames the lower rank
    (tmp_path / "launch.log").write_text("""Failures:
[1]:
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 5594)  (SIGKILL)
Root Cause (first observed failure):
[0]:
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 5593)
""")
    err = failure(tmp_path, 2, 1)
    assert err.rank == 1 and str(err).startswith("rank 1 of 2 was killed by SIGKILL"), str(err)
    assert "consequences on the other ranks:\n  rank 0 failed with RuntimeError: Connection closed by peer" in str(err)
    for f in tmp_path.iterdir():
        f.unlink()
    (tmp_path / "launch.log").write_text("torch.distributed.DistNetworkError: The server socket has failed to bind.")
    err = failure(tmp_path, 2, 1)
    assert err.rank is None and str(err).startswith("launch exited with code 1; ranks without a result: [0, 1]")


def test_an_exception_outranks_a_rank_that_ended_with_nothing_known_unless_it_echoes_a_lost_peer(tmp_path):
    """Torch 2.8: rank 0 raised; rank 1, stopped in a way that torch's report does not name, left no result, no
    exception and no exit status. The exception is the root cause. Had rank 0 only lost its peer, rank 1 would be."""
    from toolkit.runtime.caller_watch import failure
    for message, root in (("'_Action' object has no attribute 'sub_actions'", 0), ("Connection closed by peer", 1)):
        for f in tmp_path.iterdir():
            f.unlink()
        for r in (0, 1):
            (tmp_path / f"rank{r}.stack.txt").write_text("")  # both started
        (tmp_path / "rank0.error.json").write_text(json.dumps(
            {"rank": 0, "time": 1.0, "type": "AttributeError", "message": message, "cause": None,
             "traceback": "..."}))
        (tmp_path / "launch.log").write_text("")
        err = failure(tmp_path, 2, 1)
        assert err.rank == root, str(err)
        if root == 0:
            assert str(err).startswith(f"rank 0 of 2 failed with AttributeError: {message}"), str(err)
            assert "rank 1 ended with no result and no exception" in str(err), str(err)


def test_torchruns_agent_killed_takes_every_rank_with_it(tmp_path):
    """The ranks' parent dies (the kernel's OOM killer may pick it): the kernel kills them (PR_SET_PDEATHSIG)."""
    out = tmp_path / "out"

    def kill_the_agent() -> None:
        end = time.monotonic() + 60
        while not all((out / f"hanging{r}").exists() for r in (0, 1)) and time.monotonic() < end:
            time.sleep(0.1)
        for p in psutil.process_iter(["cmdline", "ppid"]):  # the agent is launch's child; forked ranks share its
            cmd = " ".join(p.info["cmdline"] or [])           # command line, not its parent
            if "toolkit.runtime.launcher_process" in cmd and str(out) in cmd and p.info["ppid"] == os.getpid():
                p.kill()

    killer = threading.Thread(target=kill_the_agent)
    killer.start()
    with pytest.raises(LaunchError) as info:
        launch("fault_targets:hangs", 2, {}, timeout_s=TIMEOUT_S, progress="none", out_dir=out)
    killer.join()
    assert str(info.value).startswith("the launcher process (accelerate launch, torchrun's agent) was killed by "
                                      "SIGKILL (signal 9), and every rank with it"), str(info.value)
    assert not wait_gone(out, LEFT_WAIT_S)
