"""What ``launch`` accepts: lesson names, "module:function" from the caller's directory, function objects (shipped
as source from a notebook or script), and the clear errors for what the ranks could not run."""
from __future__ import annotations

import linecache
import runpy
import sys
import textwrap
import types
from pathlib import Path

import pytest

from toolkit import LaunchError, launch
from toolkit.runtime import target as targets

SCRIPT = '''
import math
import torch
from toolkit.runtime.config import Param as P

N = 3
SIZES = {"a": [1, 2], "b": (3.5, None)}

def helper(x):
    return x * N + len(SIZES)

class Scale(torch.nn.Module):
    def __init__(self, k: float = N):
        super().__init__()
        self.k = k
    def forward(self, x):
        return x * self.k * math.sqrt(4.0)

def experiment(ctx, cfg):
    layer = Scale()
    out = [helper(v) for v in layer(torch.ones(2)).tolist()]
    return {"out": out, "param": P.__name__, "rank": ctx.rank}
'''


def _script(tmp_path, text: str, name: str = "script.py") -> dict:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return runpy.run_path(str(path), run_name="__main__")  # what `python script.py` defines


def _run_shipped(spec: dict, ctx=None, cfg=None):
    fn = targets.load(spec)
    return fn(ctx or types.SimpleNamespace(rank=0), cfg or {})


def test_a_script_function_is_shipped_with_what_it_uses(tmp_path):
    scope = _script(tmp_path, SCRIPT)
    target = targets.resolve(scope["experiment"])
    assert target.spec["kind"] == "source" and target.label == "function experiment"
    assert sorted(target.shipped) == ["Scale", "helper"]
    assert "import torch" in target.spec["source"] and "N = 3" in target.spec["source"]
    assert "from toolkit.runtime.config import Param as P" in target.spec["source"]
    assert _run_shipped(target.spec) == scope["experiment"](types.SimpleNamespace(rank=0), {})


def test_a_class_from_a_notebook_cell_is_found_in_the_cell_source():
    """Python < 3.13 has no source for a class defined in a notebook cell; its methods point at the cell."""
    cell = "class Twice:\n    def __call__(self, x):\n        return 2 * x\n\ndef exp(ctx, cfg):\n    return Twice()(21)\n"
    filename = "/tmp/ipykernel_0/123456789.py"  # IPython registers every cell in linecache like this
    linecache.cache[filename] = (len(cell), None, cell.splitlines(True), filename)
    scope = {"__name__": "__main__"}
    exec(compile(cell, filename, "exec"), scope)
    target = targets.resolve(scope["exp"])
    assert target.shipped == ["Twice"] and _run_shipped(target.spec) == 42


@pytest.mark.parametrize("text, match", [
    ("model = __import__('torch').nn.Linear(2, 2)\ndef experiment(ctx, cfg):\n    return model.weight.sum()\n",
     "uses 'model', a Linear defined in the notebook or script"),
    ("def experiment(ctx, cfg):\n    return helper()\nhelper = lambda: 1\n", "uses 'helper', a lambda"),
    ("def outer():\n    y = 1\n    def experiment(ctx, cfg):\n        return y\n    return experiment\n"
     "experiment = outer()\n", "closes over \\['y'\\]"),
    ("def experiment(ctx):\n    return 1\n", "must take \\(ctx, cfg\\)"),
    ("experiment = lambda ctx, cfg: 1\n", "is a lambda"),
])
def test_what_cannot_be_shipped_is_named(tmp_path, text, match):
    scope = _script(tmp_path, text)
    with pytest.raises(ValueError, match=match):
        launch(scope["experiment"], 2)


def test_module_functions_are_imported_by_name_on_the_ranks():
    from toolkit.lessons import selftest
    target = targets.resolve(selftest.fail)
    assert target.spec == {"kind": "import", "module": "toolkit.lessons.selftest", "function": "fail"}
    assert targets.resolve("selftest:fail").spec == target.spec  # a short name is looked up in toolkit.lessons


def test_module_names_resolve_from_the_working_directory_first(tmp_path, monkeypatch):
    (tmp_path / "my_selftest_mod.py").write_text("def run(ctx, cfg):\n    return {}\n\ndef two(ctx):\n    pass\n")
    (tmp_path / "broken_mod.py").write_text("raise RuntimeError('needs a GPU')\n")
    monkeypatch.chdir(tmp_path)
    assert targets.resolve("my_selftest_mod").spec["module"] == "my_selftest_mod"
    with pytest.raises(ValueError, match="my_selftest_mod:two must take \\(ctx, cfg\\)"):
        targets.resolve("my_selftest_mod:two")
    with pytest.raises(ValueError, match="module 'broken_mod' failed to import: RuntimeError: needs a GPU"):
        launch("broken_mod:run", 2)
    with pytest.raises(ValueError, match="no module 'nowhere_mod'.*lessons that exist"):
        launch("nowhere_mod:run", 2)
    assert str(tmp_path) not in sys.path  # the lookup leaves the caller's sys.path as it was


def test_a_module_that_fails_only_on_the_ranks_reports_the_rank_traceback(tmp_path, monkeypatch):
    (tmp_path / "rank_only_mod.py").write_text(
        "import os\nif os.environ.get('RANK') == '1':\n    raise ImportError('rank 1 cannot import this')\n\n"
        "def run(ctx, cfg):\n    return {'rank': ctx.rank}\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(LaunchError) as info:
        launch("rank_only_mod", 2, progress="none", timeout_s=120)
    assert info.value.rank == 1 and "rank 1 cannot import this" in str(info.value)
    assert "rank_only_mod.py" in info.value.traceback


def test_phases_give_one_bar_with_a_stable_total(capsys):
    """A real run with declared phases: the plain lines climb to 100 % through the phases in order."""
    res = launch("toolkit.lessons.selftest:phased", 2, {"steps": 3}, progress="plain", timeout_s=120,
                 phases=[("warm", 1), ("work", 3)])
    assert [r["rank"] for r in res] == [0, 1]
    assert "phase 'undeclared' is not declared; PHASES declares ['warm', 'work']" == res[0]["undeclared"]
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("[launch]")]
    assert "phases: warm (1), work (3)" in lines[0] and lines[-1].endswith("s") and "done in" in lines[-1]
    percents = [int(ln.split(": ", 1)[1].split("%")[0]) for ln in lines[1:-1]]
    assert percents == sorted(percents) and any("work (2/2)" in ln for ln in lines)


FULL_EARLY = 0.05
"""The bar may reach 100 % at most this share of the run before rank 0's end (returning the result takes
milliseconds; the cases found sat full for 14 % and 28 % of the run)."""


def bar_problems(trace: list) -> list[str]:
    """What a learner would see wrong in a launch's bar (``RankResults.progress``): a report that stands before one
    already shown (a count that started again, a total that shrank: the bar stays put while its label counts), or
    100 % reached well before the run ended (rank 0's ``"end"`` report, ``Context.finish``). Empty: it climbs once."""
    if not trace or not trace[-1][1].get("end"):
        return ["the bar never read rank 0's end report"]
    problems, top = [], 0.0
    for fraction, state, _ in trace:
        if fraction < top - 1e-9:
            problems.append(f"back from {top:.0%} to {fraction:.0%} at {state['message']!r} "
                            f"({state.get('done'):g}/{state.get('total'):g})")
        top = max(top, fraction)
    end = trace[-1][1]["t"]
    full, at = next((s["t"], s["message"]) for f, s, _ in trace if f >= 1 - 1e-9)
    if end - full > FULL_EARLY * end:
        problems.append(f"100 % at {full:.1f} s ({at!r}) of a run that ended at {end:.1f} s")
    return problems


def test_bar_problems_finds_a_count_that_starts_again_and_a_bar_full_too_early():
    def trace(*reports):
        return [[f, {"message": m, "done": d, "total": n, "t": t, **({"end": True} if m == "finished" else {})}, t]
                for f, m, d, n, t in reports]
    climbs = trace((0.5, "a", 1, 2, 1.0), (1.0, "a", 2, 2, 9.9), (1.0, "finished", 1, 1, 10.0))
    assert bar_problems(climbs) == []
    again = trace((1.0, "timing", 12, 12, 8.0), (0.08, "checked 1f1b", 1, 12, 8.5), (1.0, "finished", 1, 1, 10.0))
    assert bar_problems(again) == ["back from 100% to 8% at 'checked 1f1b' (1/12)",
                                   "100 % at 8.0 s ('timing') of a run that ended at 10.0 s"]
    silent = trace((0.67, "timing", 0, 3, 5.0), (1.0, "timing", 1, 1, 7.0), (1.0, "finished", 1, 1, 10.0))
    assert bar_problems(silent) == ["100 % at 7.0 s ('timing') of a run that ended at 10.0 s"]
    assert bar_problems(climbs[:-1]) == ["the bar never read rank 0's end report"]


def _recorded_launch(what, cfg, **kwargs) -> tuple[list[float], list[dict]]:
    """Launch for real; for every report of rank 0 the bar read, the fraction of the run that report stands for
    (before the bar's own never-move-back), and the report (``RankResults.progress``)."""
    trace = launch(what, 2, cfg, progress="plain", timeout_s=300, **kwargs).progress
    assert not bar_problems(trace) or "parts" in cfg, bar_problems(trace)
    return [f for f, _, _ in trace], [s for _, s, _ in trace]


def _full_only_at_the_end(fractions: list[float], states: list[dict], last_phase: int, last_piece: str) -> None:
    """100 % only in the last phase, from the last piece reporting its own end (or rank 0's end report)."""
    for f, s in zip(fractions, states):
        if f >= 1 and not s.get("end"):
            assert s["phase"] == last_phase and s["message"].startswith(last_piece) and s["done"] == s["total"], s


def test_nested_progress_is_one_monotone_bar():
    """Phases, parts, and compare's own rounds inside each part: every report the bar reads stands further
    along than the one before, and none reaches 100 % before the last phase ends."""
    phases = [("setup", 1), ("work", 3)]
    fractions, states = _recorded_launch("toolkit.lessons.selftest:nested", {"n": 3}, phases=phases)
    assert len(fractions) >= 3 * 3 and fractions == sorted(fractions), fractions
    _full_only_at_the_end(fractions, states, last_phase=1, last_piece="piece 2")
    assert any("piece 2 · rounds" in s["message"] for s in states) and states[-1]["end"]
    # the same run with the pieces reporting progress(i, n) and compare's rounds their own counts: the check bites
    fractions, _ = _recorded_launch("toolkit.lessons.selftest:nested", {"n": 3, "parts": False}, phases=phases)
    assert fractions != sorted(fractions) and max(fractions[:-1]) == 1.0


@pytest.mark.slow
def test_the_pipeline_benchmark_bar_climbs_once_through_every_schedule():
    """benchmarks/bench_pipeline.py, the case that read 0/5, then 100 % inside the first schedule: each
    schedule is one slice of the bar, filled by the harness's checked and timed steps."""
    cfg = {"preset": "smoke", "n_layer": 4, "m": 4, "micro_batch": 2, "rounds": 2, "warmup": 1, "steps": 1,
           "schedules": ["gpipe", "1f1b"]}
    fractions, states = _recorded_launch("benchmarks.bench_pipeline:rank_main", cfg)
    # a rank reports at most every 0.2 s: on an idle machine this run makes three reports (start, each schedule)
    assert len(fractions) >= 3 and fractions == sorted(fractions), fractions
    _full_only_at_the_end(fractions, states, last_phase=0, last_piece="1f1b")
    first = [f for f, s in zip(fractions, states) if s["message"].startswith("gpipe")]
    assert first and max(first) <= 0.5  # the first of two schedules stays within its half


@pytest.mark.parametrize("lesson, world_size", [("l03_dualpipev", 2), ("l13_vocab_parallel", 4)])
def test_a_lessons_bar_climbs_once_through_its_emulated_section(lesson, world_size):
    """Lessons 03 and 13 sat at 100 % for 14 % and 28 % of a default run while their emulated-cluster section
    ran (03's label counting again from "1/12 checked 1f1b"): that section now has its slice. The notebooks'
    smoke launch (their cluster, the same code path as default; the session cache shares it with nbval's run and
    tests/test_vocab_parallel.py), its bar as recorded."""
    results = launch(lesson, world_size, {"preset": "smoke"}, cluster="h100-ib400", timeout_s=600, progress="none")
    assert results[0]["emulated"] is not None  # the emulated section ran
    assert not bar_problems(results.progress), bar_problems(results.progress)
    assert any(s["message"].startswith("emulated cluster") for _, s, _ in results.progress)


def test_the_bar_total_is_the_sum_of_the_weights_and_never_moves_back():
    import io

    from toolkit.runtime.caller_progress import Progress
    out = io.StringIO()
    bar = Progress("demo", "plain", [["setup", 1], ["train", 3]], out=out)
    bar.update({"phase": 1, "done": 1, "total": 3, "message": "step 1"})
    assert bar.fraction == pytest.approx(0.5)  # (1 + 3 * 1/3) / 4
    bar.update({"phase": 0, "done": 0, "total": 0, "message": ""})  # a late or out-of-order report
    assert bar.fraction == pytest.approx(0.5)
    bar.update({"phase": 1, "done": 3, "total": 3, "message": "step 3"})
    assert bar.fraction == pytest.approx(1.0)
    text = out.getvalue()
    assert "phases: setup (1), train (3)" in text and " 50% train (2/2) 1/3 step 1" in text
    one = Progress("demo", "plain", None, out=io.StringIO())  # no PHASES: the run is one phase
    one.update({"phase": 0, "done": 2, "total": 8, "message": "x"})
    assert one.fraction == pytest.approx(0.25)
    one.update({"phase": 0, "fraction": 0.6, "done": 1, "total": 3, "message": "part · x"})  # a nested report
    assert one.fraction == pytest.approx(0.6)


def test_a_silent_stretch_still_gets_a_line(tmp_path):
    import io

    from toolkit.runtime.caller_progress import Progress
    out = io.StringIO()
    bar = Progress("demo", "plain", [["setup", 1], ["train", 3]], out=out)
    bar.HEARTBEAT_S = 0.0  # every poll without news is past it
    bar.poll(tmp_path)  # nothing reported yet
    bar.update({"phase": 1, "fraction": 0.5, "done": 2, "total": 4, "message": "step 2"})
    bar.poll(tmp_path)
    lines = out.getvalue().splitlines()
    assert "  0% starting the ranks (" in lines[1] and lines[1].endswith("s, still working)")
    assert " 62% train (2/2) 2/4 step 2 (" in lines[-1] and lines[-1].endswith("s, still working)")


def test_the_widget_bar_has_a_fixed_maximum():
    from toolkit.runtime.caller_progress import Progress
    bar = Progress("demo", "widget", [["setup", 1], ["train", 3]])
    assert bar.mode == "widget" and bar.bar.max == Progress.WIDTH
    bar.update({"phase": 1, "done": 2, "total": 3, "message": "step 2"})
    assert bar.bar.max == Progress.WIDTH and bar.bar.value == 750 and bar.bar.description == "75%"
    assert "train (2/2) 2/3 step 2" in bar.label.value
    bar.close("done")
    assert bar.bar.value == Progress.WIDTH and bar.bar.bar_style == "success"


def test_the_session_cache_shares_one_launch_of_an_identical_lesson_job(tmp_path, monkeypatch):
    """The suite's launch hook (conftest: TOOLKIT_LAUNCH_HOOK, TOOLKIT_LAUNCH_CACHE): a lesson's run with the same
    resolved cfg, ranks, backend, seed, cluster and environment returns the stored results; anything else, or a
    launch whose files were asked for, or a target that is not one of the course's programs (a lesson's run, the
    emulator's checks), runs."""
    from toolkit.runtime.caller_cache import reuse
    from toolkit.runtime.launch import Job, RankResults
    monkeypatch.setenv("TOOLKIT_LAUNCH_CACHE", str(tmp_path))
    done = RankResults([{"rank": 0, "loss": 1.5}, {"rank": 1}])
    done.wall_s, done.log, done.progress = 3.0, "log", [[1.0, {"end": True, "t": 2.5}, 2.9]]
    runs = []

    def run():
        runs.append(1)
        return done

    def job(what="l11_seq1f1b", **changes):
        fields = dict(cfg={"preset": "smoke", "m": 4}, world_size=4, backend="gloo", seed=0, threads=1, cluster=None,
                      accelerate_args=None, keep=False, progress="none")
        target = targets.resolve(what)
        return Job(target.spec, target.label, **{**fields, **changes})

    def served(**changes) -> bool:
        """Whether the hook answered from the cache (else it ran the launch)."""
        before = len(runs)
        reuse(job(**changes), run)
        return len(runs) == before

    assert not served()
    again = reuse(job(), run)
    assert len(runs) == 1 and list(again) == list(done) and (again.wall_s, again.log) == (3.0, "log")
    assert again.progress == done.progress  # how its bar moved comes along
    for changes in ({"cfg": {"preset": "smoke", "m": 8}}, {"world_size": 2}, {"seed": 1},
                    {"cluster": {"name": "h100-ib400"}}, {"keep": True}):
        assert not served(**changes), changes
    assert not served(what="toolkit.lessons.selftest:hang") and not served(what="toolkit.lessons.selftest:hang")
    check = "toolkit.lessons.emulator_check:pipeline"  # the course's emulator checks are shared
    assert not served(what=check) and served(what=check)
    monkeypatch.chdir(tmp_path)  # a notebook runs in notebooks/, a test in the repository's root: one launch
    assert served()
    assert not served(cfg={"preset": "smoke", "nvme_path": "spill/here"})
    monkeypatch.chdir(Path(__file__).parent)  # ... unless a cfg value may be a path relative to the caller's folder
    assert not served(cfg={"preset": "smoke", "nvme_path": "spill/here"})
    monkeypatch.setenv("TOOLKIT_BF16_COMPUTE", "fp32")  # what a rank may read changes the key
    assert not served()
    monkeypatch.delenv("TOOLKIT_BF16_COMPUTE")
    assert (tmp_path / "hits.log").read_text().count("l11_seq1f1b x4 (gloo)") == 2
    monkeypatch.delenv("TOOLKIT_LAUNCH_CACHE")
    assert not served() and not served()  # no cache without its folder


def test_launch_asks_the_installed_hook_and_nothing_else(monkeypatch):
    """``launch`` knows the suite's cache only as a hook (TOOLKIT_LAUNCH_HOOK): without one every launch runs; with
    one, the hook decides, given the resolved job and the function that starts its processes."""
    import importlib
    launch_module = importlib.import_module("toolkit.runtime.launch")  # the module, not the function
    monkeypatch.setattr(launch_module, "run_job", lambda *args: ["ran"])
    monkeypatch.delenv("TOOLKIT_LAUNCH_HOOK", raising=False)
    assert launch("toolkit.lessons.selftest", 2, progress="none") == ["ran"]
    hook = types.SimpleNamespace(answer=lambda job, run: [job.title, *run()])
    monkeypatch.setitem(sys.modules, "a_launch_hook", hook)
    monkeypatch.setenv("TOOLKIT_LAUNCH_HOOK", "a_launch_hook:answer")
    assert launch("toolkit.lessons.selftest", 2, progress="none", backend="gloo") == ["selftest x2 (gloo)", "ran"]


def test_a_launch_keeps_a_jupyter_kernel_busy_after_a_control_request(monkeypatch):
    """JupyterLab asks for a subshell (control channel) when the bar's widget opens its first comm; ipykernel's idle
    status for that request made JupyterLab and /api/kernels say "Idle" for the rest of the cell. Inside
    kernel_stays_busy a control idle is followed by busy for the running cell; outside it nothing changes
    (tests/test_browser.py checks it in JupyterLab)."""
    import IPython

    from toolkit.runtime.caller_progress import kernel_stays_busy

    class Kernel:
        def __init__(self):
            self.sent = []

        def _publish_status(self, status, channel, parent=None):
            self.sent.append((status, channel, parent))

        def get_parent(self, channel="shell"):
            return {"msg_type": "execute_request"}

    kernel = Kernel()
    monkeypatch.setattr(IPython, "get_ipython", lambda: types.SimpleNamespace(kernel=kernel))
    with kernel_stays_busy():
        kernel._publish_status("busy", "control")
        kernel._publish_status("idle", "control")
        kernel._publish_status("idle", "shell")  # another shell request's idle is left alone
    kernel._publish_status("idle", "control")  # restored after the launch
    cell = {"msg_type": "execute_request"}
    assert kernel.sent == [("busy", "control", None), ("idle", "control", None), ("busy", "shell", cell),
                           ("idle", "shell", None), ("idle", "control", None)]
    assert "_publish_status" not in vars(kernel)
