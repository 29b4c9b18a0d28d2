"""The public API: ``import toolkit`` is light, every exported name resolves to its technique's object, every
entry documents shapes, ranks and an example that compiles, and the API page is written offline."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import toolkit
from toolkit import api

ROOT = Path(__file__).resolve().parents[1]


def test_import_toolkit_imports_nothing_heavy():
    code = "import sys, toolkit; print(sorted(m for m in ('torch', 'numpy', 'plotly') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


@pytest.mark.parametrize("entry", api.ENTRIES, ids=lambda e: e.name)
def test_every_entry_resolves_and_is_documented(entry):
    obj = getattr(toolkit, entry.name)
    module, _, attr = entry.where.partition(":")
    assert obj is getattr(sys.modules[module], attr) and entry.name in toolkit.__all__
    assert entry.area in api.AREAS and entry.what and entry.shapes and entry.ranks
    assert 2 <= len(entry.example.splitlines()) <= 4
    compile(entry.example, entry.name, "exec")
    assert entry.name in api.describe(entry.name)


def test_every_technique_area_is_covered():
    names = {e.name for e in api.ENTRIES}
    for needed in ("launch", "Context", "CommLedger", "MemoryTracker", "Timeline", "measure", "compare", "resolve",
                   "ZeroDataParallel", "ColumnParallelLinear", "RowParallelLinear", "make_schedule", "simulate",
                   "PipelineExecutor", "pipeline_stages", "quantize_blockwise", "all_to_all_quantized",
                   "reduce_scatter_tlq", "EDGCHook", "ShardedDP", "ReuseAdamW", "ActivationOffloader", "s_pass"):
        assert needed in names


def test_unknown_names_are_refused():
    with pytest.raises(AttributeError, match="no attribute 'NoSuchThing'"):
        toolkit.NoSuchThing  # noqa: B018
    with pytest.raises(ValueError, match="not in the public API"):
        api.describe("NoSuchThing")


def test_api_page_is_written_and_self_contained(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "api_page.py"), "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    page = (tmp_path / "html" / "api.html").read_text()
    assert all(f"id='{e.name.lower().replace('_', '-')}'" in page for e in api.ENTRIES)
    assert not re.search(r"""(src|href)\s*=\s*["']?https?://""", page), "the page must not fetch anything"
    assert "<script" not in page
