"""benchmarks/gpu_check.sh: says so and exits 0 without a GPU; one failing row (or module) makes it exit 1."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check  # noqa: E402


def test_without_a_gpu_it_says_so_and_exits_0():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHON=sys.executable)
    out = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh")], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "no CUDA GPU visible" in out.stdout and "kernels" in out.stdout


def test_every_check_module_imports_without_a_gpu_and_has_check():
    paths = gpu_check.discover()
    assert {"kernels", "memory_tracker", "offload", "lesson_full"} <= {p.stem for p in paths}
    for path in paths:
        assert callable(gpu_check.load(path).check), path


def test_a_failing_row_a_raising_module_or_a_malformed_row_fails_the_run(tmp_path, capsys):
    (tmp_path / "good.py").write_text('def check():\n    return [{"check": "fine", "ok": True, "value": "1"}]\n')
    assert gpu_check.report(gpu_check.run_module(tmp_path / "good.py"), 0.1) == 0
    (tmp_path / "bad.py").write_text('def check():\n    return [{"check": "off by one", "ok": False, "value": "2"}]\n')
    (tmp_path / "boom.py").write_text('def check():\n    raise RuntimeError("no kernel image")\n')
    (tmp_path / "odd.py").write_text('def check():\n    return [{"check": "x", "ok": "yes", "value": 3}]\n')
    (tmp_path / "none.py").write_text("X = 1\n")
    (tmp_path / "_helper.py").write_text("raise SystemExit('never imported')\n")
    assert [p.stem for p in gpu_check.discover(tmp_path)] == ["bad", "boom", "good", "none", "odd"]
    rows = [row for p in gpu_check.discover(tmp_path) for row in gpu_check.run_module(p)]
    assert [r["ok"] for r in rows] == [False, False, True, False, False]
    assert "RuntimeError: no kernel image" in rows[1]["value"] and "malformed" in rows[4]["check"]
    assert "no check() function" in rows[3]["value"]
    assert gpu_check.report(rows, 0.1) == 1
    printed = capsys.readouterr().out
    assert "FAIL" in printed and "4 FAILED" in printed and "off by one" in printed


def test_only_names_modules_that_exist(capsys):
    assert gpu_check.main(["--only", "no_such_check"]) == 2
    assert "no module ['no_such_check']" in capsys.readouterr().out
