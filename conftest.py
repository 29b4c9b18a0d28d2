"""Test-session settings shared by tests/ and the nbval run over notebooks/.

- Notebooks run at the smoke preset with plain progress lines (the kernel inherits this env).
- Triton runs in its interpreter (there is no CPU backend); the switch is read when triton is first
  imported, so it is set here, before any test module (or the toolkit it imports) loads triton.
- ``pytest-xdist --dist loadfile`` keeps each notebook's nbval cells on one worker (they share one kernel).
- No notebook runs twice with the same parameters: where nbval runs a notebook in this session (``pytest
  --nbval-lax tests notebooks``, what ``make test`` does) and tests/test_notebooks.py would run it at the same
  defaults (it has no Try item in ``TRIED``), the papermill run is deselected. nbval's run executes every cell (an
  exception or a failed assert fails it) and compares the checked outputs. A lesson's papermill run takes its Try
  item's knobs, a different run, and stays.
- One launch per distinct lesson job: the session installs the launch cache as ``launch``'s hook
  (``TOOLKIT_LAUNCH_HOOK``) and ``TOOLKIT_LAUNCH_CACHE`` names its folder (every xdist worker and notebook kernel
  inherits both), so a test module's fixture and a notebook that launch the same lesson (or the same emulator
  check) with the same resolved configuration share one real launch (``toolkit.runtime.caller_cache``).
- What a learner reads: every cell nbval runs also passes ``tests/reading.py``'s checks (a headline shown once,
  paragraphs of at most 120 words, listings of at most 40 lines, no "null" in a table, one time unit per figure).
- One launcher imported once for the session (``toolkit.runtime.server_process``), started by the session's first
  process; every launch whose environment matches forks it (tests that change the environment start their own).
  The session's last line says how many it served.
"""
import contextlib
import os
import shutil
import tempfile

import pytest

os.environ.setdefault("TOOLKIT_PRESET", "smoke")
os.environ.setdefault("TOOLKIT_PLAIN_PROGRESS", "1")
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOOLKIT_LAUNCH_HOOK", "toolkit.runtime.caller_cache:reuse")
_OWN_CACHE = None
if "TOOLKIT_LAUNCH_CACHE" not in os.environ:  # the session's first process (xdist's controller) makes it
    _OWN_CACHE = os.environ["TOOLKIT_LAUNCH_CACHE"] = tempfile.mkdtemp(prefix="toolkit-launch-cache-")
_SERVER, _SERVER_KEY = contextlib.ExitStack(), pytest.StashKey()


def pytest_configure(config):
    if _OWN_CACHE:  # before xdist starts its workers: they inherit TOOLKIT_LAUNCH_SERVER
        from toolkit.runtime.caller_start import serving
        config.stash[_SERVER_KEY] = _SERVER.enter_context(serving())


def pytest_terminal_summary(terminalreporter, config):
    if _SERVER_KEY in config.stash:
        terminalreporter.write_line(f"launch server: {config.stash[_SERVER_KEY].summary()}")


def pytest_unconfigure(config):
    _SERVER.close()
    if _OWN_CACHE:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """nbval's runs (every notebook at its defaults, emulated clusters included): each cell that ran also passes
    ``tests/reading.py``'s checks of what a learner reads (a headline shown once, paragraphs, listings, tables,
    units)."""
    result = yield
    outputs = getattr(item, "test_outputs", None)
    if outputs is not None and item.path.suffix == ".ipynb":
        problems = _reading().cell_problems(item.cell.source, outputs)
        if problems:
            raise AssertionError("what a learner reads in this cell:\n" + "\n".join(problems))
    return result


def _reading():
    import importlib.util
    import sys
    if "reading" not in sys.modules:
        spec = importlib.util.spec_from_file_location("reading", os.path.join(os.path.dirname(__file__), "tests",
                                                                             "reading.py"))
        sys.modules["reading"] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules["reading"]


def pytest_collection_modifyitems(config, items):
    by_nbval = {item.path.name for item in items if item.path.suffix == ".ipynb"}
    twice = [item for item in items if getattr(item, "originalname", None) == "test_notebook_runs_at_smoke_preset"
             and item.callspec.params["notebook"].name in by_nbval
             and item.callspec.params["notebook"].stem not in item.module.TRIED]
    if twice:
        config.hook.pytest_deselected(items=twice)
        items[:] = [item for item in items if item not in twice]
