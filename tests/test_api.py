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


def test_pipeline_stages_cut_any_layers_for_any_schedule():
    import torch.nn as nn

    from toolkit import dualpipev, make_schedule, pipeline_stages
    from toolkit.pipeline.stages import split_layers
    layers = nn.Sequential(*[nn.Linear(4, 4) for _ in range(10)])
    assert [len(s) for s in split_layers(layers, 4)] == [3, 3, 2, 2]
    v = pipeline_stages(layers, dualpipev(2, 8), rank=0)  # the V: stages 0 and 3 on rank 0
    assert sorted(v) == [0, 3] and v[0][0] is layers[0] and v[3][-1] is layers[9]
    assert sorted(pipeline_stages(list(layers), make_schedule("1f1b", 2, 4), rank=1)) == [1]
    with pytest.raises(ValueError, match="10 layers cannot fill 12 stages"):
        split_layers(layers, 12)
    with pytest.raises(ValueError, match="sizes=\\[5, 4\\] must be 2 positive ints summing to the 10 layers"):
        split_layers(layers, 2, sizes=[5, 4])
    with pytest.raises(ValueError, match="layers must be nn.Module"):
        split_layers([nn.Linear(2, 2), "relu"], 2)


def test_edgc_hook_checks_its_config():
    from toolkit import EDGCConfig, EDGCHook
    with pytest.raises(ValueError, match="warmup must be >= 2 for the DDP hook"):
        EDGCHook(EDGCConfig(warmup=1))
    with pytest.raises(ValueError, match="need r_min <= r_init <= r_max"):
        EDGCHook(EDGCConfig(r_init=40, r_max=16))
