"""Test-session settings shared by tests/ and the nbval run over notebooks/.

- Notebooks run at the smoke preset with plain progress lines (the kernel inherits this env).
- Triton runs in its interpreter (there is no CPU backend).
- With ``pytest-xdist --dist loadgroup`` each notebook's nbval cells stay together on one worker (they share
  one kernel), while different notebooks, and the papermill run of each notebook, spread over the workers.
"""
import os

import pytest

os.environ.setdefault("TOOLKIT_PRESET", "smoke")
os.environ.setdefault("TOOLKIT_PLAIN_PROGRESS", "1")
# Triton kernels run on CPU only in its interpreter, and the switch is read when triton is first imported:
# set it before any test module (or the toolkit it imports) loads triton
os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which turns the marks into scheduling groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        path = str(item.fspath)
        if path.endswith(".ipynb"):
            item.add_marker(pytest.mark.xdist_group(f"nbval:{os.path.basename(path)}"))
            item.add_marker(pytest.mark.notebook)
        elif "tests/test_notebooks.py" in path.replace(os.sep, "/"):
            item.add_marker(pytest.mark.xdist_group(f"papermill:{item.name}"))
        else:
            item.add_marker(pytest.mark.xdist_group(f"file:{path}"))  # keep module-scoped fixtures shared
