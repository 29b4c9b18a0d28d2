"""The launch server (``toolkit.runtime.server_process``): launches forked from one pre-imported launcher compute
what a fresh launcher's compute, report a failure and a hang as a fresh one does, leave nothing behind (also when
their caller is killed), and are declined (the caller starts its own launcher) when the caller's environment is
not the one the server imported under; a notebook's kernel forked from a kernel server runs as a fresh one. Each
test runs its own server; the processes a server forked are its descendants."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from toolkit import LaunchError, LaunchTimeout, launch
from toolkit.runtime import server_process
from toolkit.runtime.caller_start import request, serving
from toolkit.runtime.server_process import SERVER_ENV, mismatch

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
    assert server.summary().startswith("1 served, 0 declined"), server.log.read_text()
    monkeypatch.delenv(SERVER_ENV)
    fresh = launch("toolkit.lessons.selftest:ddp_steps", 2, {}, threads=2, progress="none")
    assert [r["forked"] for r in served] == [True, True] and [r["threads"] for r in served] == [2, 2]
    assert [r["bits"] for r in served] == [r["bits"] for r in fresh]
    assert not descendants_after(server)


def test_a_served_launch_takes_its_callers_resource_limits(server, tmp_path):
    """A file-size limit set in the caller (``ulimit -f``) holds in its served ranks, as in a child of its own."""
    limit = 1_000_000  # bytes: above every file of the launch
    code = ("import resource, sys\nfrom toolkit import launch\n"
            f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))\n"
            "print(launch('fault_targets:fsize_limit', 2, {}, threads=2, progress='none', timeout_s=60))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parent)
    assert out.returncode == 0, out.stdout + out.stderr
    assert server.summary().startswith("1 served"), server.log.read_text()
    assert f"[{{'fsize': {limit}}}, {{'fsize': {limit}}}]" in out.stdout, out.stdout


def test_a_served_launch_names_a_killed_rank_and_leaves_nothing(server, tmp_path):
    with pytest.raises(LaunchError) as info:
        launch("fault_targets:killed", 2, {}, threads=2, timeout_s=TIMEOUT_S, progress="none",
               out_dir=tmp_path / "out")
    assert info.value.rank == 1 and str(info.value).startswith("rank 1 of 2 was killed by SIGKILL (signal 9)")
    assert server.summary().startswith("1 served"), server.log.read_text()
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
    assert server.summary() == ("0 served, 1 declined (started afresh); 1 as the "
                                "environment differs in TOOLKIT_SOME_SETTING"), server.log.read_text()


def test_what_a_kernel_sets_does_not_count_and_another_interpreter_limit_or_changed_sources_do():
    env = {"PATH": "/bin", "OMP_NUM_THREADS": "1"}
    kernel = dict(env, JPY_PARENT_PID="1", MPLBACKEND="inline", PYTEST_CURRENT_TEST="x", PLOTLY_RENDERER="json")

    def req(env, interpreter=None, sources="a", limits=None, program="toolkit.runtime.launcher_process"):
        return {"program": program, "env": env, "interpreter": interpreter or server_process.interpreter(),
                "sources": sources, "limits": limits or server_process.process_limits()}

    assert mismatch(req(kernel), "launcher", env, "a") == ""
    assert mismatch(req(dict(env, OMP_NUM_THREADS="2")), "launcher", env, "a") == (
        "the environment differs in OMP_NUM_THREADS")
    assert mismatch(req(env, sources="b"), "launcher", env, "a") == "the toolkit's sources changed"
    assert mismatch(req(env), "kernel", env, "a") == "this server forks ipykernel_launcher"
    assert mismatch(req(env, ["/usr/bin/python3", "-X", "dev"]), "launcher", env, "a") == (
        "another interpreter or its options (/usr/bin/python3 -X dev)")
    limits = server_process.process_limits()
    soft, hard = limits["rlimits"]["RLIMIT_NOFILE"]
    above = dict(limits, rlimits=dict(limits["rlimits"], RLIMIT_NOFILE=(soft, hard + 1)))
    assert mismatch(req(env, limits=above), "launcher", env, "a") == (
        "a resource limit above the server's: RLIMIT_NOFILE")
    assert mismatch(req(env, limits=dict(limits, nice=limits["nice"] - 1)), "launcher", env, "a") == (
        "a higher scheduling priority than the server's")
    assert mismatch(req(env, limits=dict(limits, cpus=limits["cpus"] + [10_000])), "launcher", env, "a") == (
        "CPUs the server may not run on")
    assert server_process.sources() == server_process.sources()


def test_no_server_at_the_path_starts_a_fresh_launcher(monkeypatch, tmp_path):
    monkeypatch.setenv(SERVER_ENV, str(tmp_path / "nobody-listens"))
    cmd = [sys.executable, "-m", "toolkit.runtime.launcher_process"]
    assert request(str(tmp_path / "nobody-listens"), cmd, {}, tmp_path / "log") is None
    res = launch("toolkit.lessons.selftest", 2, {}, progress="none")
    assert [r["sum"] for r in res] == [3.0, 3.0]


def test_the_caller_killed_ends_its_served_launch(server, tmp_path):
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})\n"
            "from toolkit import launch\n"
            f"launch('fault_targets:hangs', 2, {{}}, threads=2, timeout_s=120, progress='none', "
            f"out_dir={str(tmp_path / 'out')!r})\n")
    caller = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    end = time.monotonic() + 60
    while not all((tmp_path / "out" / f"hanging{r}").exists() for r in (0, 1)):
        assert caller.poll() is None and time.monotonic() < end, caller.communicate()
        time.sleep(0.1)
    assert server.summary().startswith("1 served"), server.log.read_text()
    caller.kill()  # a killed papermill job: its end of the connection closes
    caller.communicate()
    assert not descendants_after(server)


def test_a_notebook_runs_in_a_served_kernel_as_in_a_fresh_one(tmp_path, monkeypatch):
    """The kernel server (``tools/run_all.py``'s): the cell sees the notebook's folder, the caller's environment and
    torch's thread count of a fresh kernel; the kernel's interpreter and options are the kernelspec's."""
    import nbformat
    from jupyter_client.kernelspec import KernelSpecManager

    spec = importlib.util.spec_from_file_location("nb_tool", Path(__file__).resolve().parents[1] / "tools" / "nb.py")
    nb_tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(nb_tool)
    notebook = tmp_path / "probe.ipynb"
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("import os, torch\n"
                                          "print(os.getcwd(), os.environ['PROBE'], torch.get_num_threads())")]
    nbformat.write(nb, notebook)
    monkeypatch.setenv("PROBE", "seen")

    def printed(out) -> str:
        return nbformat.read(out, as_version=4).cells[0].outputs[0]["text"]

    argv = KernelSpecManager().get_kernel_spec("python3").argv
    with serving(role="kernel", interpreter=argv[:argv.index("-m")]) as kernels:
        assert kernels.ready, kernels.log.read_text()
        nb_tool.execute(notebook, tmp_path / "served.ipynb", kernel_name="python3")
        assert kernels.summary() == "1 served, 0 declined (started afresh)", kernels.log.read_text()
        assert not descendants_after(kernels)
    nb_tool.execute(notebook, tmp_path / "fresh.ipynb", kernel_name="python3")
    assert printed(tmp_path / "served.ipynb") == printed(tmp_path / "fresh.ipynb")
    assert printed(tmp_path / "served.ipynb").startswith(f"{tmp_path} seen ")
