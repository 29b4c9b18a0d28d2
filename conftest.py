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
"""
import os

os.environ.setdefault("TOOLKIT_PRESET", "smoke")
os.environ.setdefault("TOOLKIT_PLAIN_PROGRESS", "1")
os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    by_nbval = {item.path.name for item in items if item.path.suffix == ".ipynb"}
    twice = [item for item in items if getattr(item, "originalname", None) == "test_notebook_runs_at_smoke_preset"
             and item.callspec.params["notebook"].name in by_nbval
             and item.callspec.params["notebook"].stem not in item.module.TRIED]
    if twice:
        config.hook.pytest_deselected(items=twice)
        items[:] = [item for item in items if item not in twice]
