"""Every example script and every python block of the README runs as written, from a fresh directory."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted(p.name for p in (ROOT / "examples").glob("*.py") if p.name != "tiny_models.py")


def readme_blocks() -> list[tuple[str, str]]:
    """(file name, code) of each python block; a block starting with ``# name.py`` is that file."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    out = []
    for i, code in enumerate(blocks):
        first = code.splitlines()[0].strip() if code.strip() else ""
        match = re.fullmatch(r"#\s*([\w.-]+\.py)\b.*", first)
        out.append((match.group(1) if match else f"block{i}.py", code))
    return out


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_readme_python_blocks_run_as_written(tmp_path):
    blocks = readme_blocks()
    assert len(blocks) >= 3 and any(name == "my_module.py" for name, _ in blocks)
    for name, code in blocks:
        (tmp_path / name).write_text(code)
    for name, _ in blocks:  # in order, each as a script in the fresh directory (a module just defines things)
        out = _run([name], tmp_path)
        assert out.returncode == 0, f"README block {name} failed:\n{out.stdout}\n{out.stderr}"


@pytest.mark.slow
@pytest.mark.parametrize("name", EXAMPLES)
def test_example_runs(name, tmp_path):
    out = _run([str(ROOT / "examples" / name)], tmp_path)
    assert out.returncode == 0, f"examples/{name} failed:\n{out.stdout}\n{out.stderr}"
