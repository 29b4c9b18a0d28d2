"""The toolkit on the oldest torch it supports (2.7): no torch.distributed name added later is called.

An older torch on PyPI is a CUDA build with several GB of CUDA libraries (2.6.0 and 2.7.1 were installed and run
by hand once: README, "Which torch"), too much to install on every run, so every rank plays the floor instead:
it removes from ``torch.distributed`` what releases after 2.7 added (``POST_FLOOR``, taken from the releases' sources, not
from ``toolkit.runtime.compat``), then runs the toolkit's public APIs: a 2-rank MoE dispatcher round trip,
ZeRO-1 and ZeRO-3 steps, and lesson 03 (DualPipeV), whose comparison with torch's DualPipeV must be left out,
saying why, instead of crashing. A toolkit call to a removed name raises AttributeError in that rank and the
launch fails; the second test shows that it does, with a deliberate call.
"""
from __future__ import annotations

import importlib
import inspect
import sys
import types

import pytest
import torch
import torch.distributed as dist

from toolkit import launch
from toolkit.runtime import LaunchError, compat

# what torch added after the floor, where the toolkit could reach it, and the release that added it
POST_FLOOR = {
    ("torch.distributed", "all_gather_single"): "2.13",
    ("torch.distributed", "reduce_scatter_single"): "2.13",
    ("torch.distributed.pipelining", "ScheduleDualPipeV"): "2.9",
    ("torch.distributed.pipelining.schedules", "ScheduleDualPipeV"): "2.9",
}
POST_FLOOR_MODULES = {"torch.distributed.pipelining._schedule_visualizer": "2.8"}


def remove_post_floor_names() -> dict[str, object]:
    """Delete ``POST_FLOOR`` from this process's torch (only the public namespaces: torch's own internals keep
    calling what they call) and make ``POST_FLOOR_MODULES`` unimportable; returns what was removed, by name."""
    removed = {}
    for module, name in POST_FLOOR:
        namespace = sys.modules.get(module) or importlib.import_module(module)
        if hasattr(namespace, name):
            removed[f"{module}.{name}"] = getattr(namespace, name)
            delattr(namespace, name)
    for module in POST_FLOOR_MODULES:
        try:
            removed[module] = importlib.import_module(module)
        except ImportError:  # this torch predates it: nothing to remove
            continue
        parent, _, name = module.rpartition(".")
        if hasattr(sys.modules[parent], name):
            delattr(sys.modules[parent], name)
        sys.modules[module] = None  # an import of it now raises ImportError, as on torch < 2.8
    return removed


def stale_bindings(removed: dict[str, object]) -> list[str]:
    """Module globals of the toolkit still bound to a removed object (``from torch.distributed import X`` at
    import time would dodge the removal): there must be none."""
    objects = {id(obj) for obj in removed.values()} | {id(inspect.unwrap(obj)) for obj in removed.values()
                                                       if callable(obj)}
    return sorted(f"{name}.{key}" for name, mod in list(sys.modules.items())
                  if name.startswith("toolkit") and isinstance(mod, types.ModuleType)
                  for key, value in vars(mod).items() if id(value) in objects)


def dispatcher_round_trip(ctx) -> dict:
    """Tokens to the ranks owning their two experts and back through identity experts: gate weights ½ + ½,
    so every token comes back as it left."""
    from toolkit.moe import TokenDispatcher, run_experts
    E, K, T = 4, 2, 6 + ctx.rank
    disp = TokenDispatcher(E, K)
    ids = torch.stack([torch.arange(T) % E, (torch.arange(T) + 1 + ctx.rank) % E], 1)
    weights = torch.full((T, K), 0.5)
    x = torch.randn(T, 8, generator=torch.Generator().manual_seed(ctx.rank))
    plan = disp.plan(ids, weights, x)
    y = disp.combine(run_experts([torch.nn.Identity()] * disp.local, disp.dispatch(x, plan), plan.recv_counts), plan)
    return {"round_trip_equal": bool(torch.allclose(y, x, rtol=0, atol=1e-6)), "recv_counts": plan.recv_counts}


def zero_steps(ctx) -> dict:
    """One ZeRO-1 and one ZeRO-3 step (prefetching) from the same weights on the same data: bitwise the same
    parameters, and the ledger's bytes of each equal to its closed form."""
    from toolkit.data import batches
    from toolkit.models import GPT, preset
    from toolkit.parallel.zero import ZeroDataParallel

    x, y = next(batches(2, 16, 1, seed=5, rank=ctx.rank, world=ctx.world_size))
    params, bytes_ok = {}, {}
    for stage in (1, 3):
        torch.manual_seed(0)
        zdp = ZeroDataParallel(GPT(preset("smoke", n_layer=1, seq_len=16)), stage=stage)
        with ctx.ledger.tag(f"zero{stage}"):
            zdp(x, y).backward()
            zdp.step()
        expected = zdp.closed_forms()["bytes"]
        bytes_ok[stage] = {op: ctx.ledger.total("sent_bytes", tag=f"zero{stage}", op=op) == sent
                           for op, sent in expected.items()}
        params[stage] = torch.cat([s.detach().reshape(-1) for s in zdp.shards])
    return {"bitwise_equal": bool(torch.equal(params[1], params[3])), "bytes_equal_closed_forms": bytes_ok}


def on_the_floor(ctx, cfg: dict) -> dict:
    """Rank program: remove the post-floor names, then run the toolkit's public APIs on 2 ranks."""
    removed = remove_post_floor_names()
    if cfg.get("deliberate_new_name"):  # a shim that calls the 2.13 name, as the dispatcher once did
        compat.all_gather_single = lambda out, inp, group=None, async_op=False: dist.all_gather_single(
            out, inp, group=group, async_op=async_op)
    from toolkit.lessons import l03_dualpipev as l03
    out = {"removed": sorted(removed), "dispatcher": dispatcher_round_trip(ctx), "zero": zero_steps(ctx),
           "missing": {f: compat.missing(f) for f in compat.FEATURES}}
    lesson = l03.run(ctx, l03.validate({"preset": "smoke", "schedules": ["1f1b"], "rounds": 1}, ctx.world_size))
    out["l03"] = {"torch_missing": lesson["torch_missing"], "torch_order_identical": lesson["torch_order_identical"],
                  "impls": sorted({r["impl"] for r in lesson["runs"]}),
                  "grad_diff": max(r["grad_diff"] for r in lesson["runs"])}
    out["stale_bindings"] = stale_bindings(removed)
    return out


@pytest.fixture(scope="module")
def floor():
    return launch("tests.test_compat:on_the_floor", 2, {}, timeout_s=300, progress="none")


def test_the_toolkit_runs_without_the_names_torch_added_after_the_floor(floor):
    post_floor = sorted([f"{m}.{n}" for m, n in POST_FLOOR] + list(POST_FLOOR_MODULES))
    for rank in floor:  # an older torch lacks some of them already: what it has was removed
        assert set(rank["removed"]) <= set(post_floor)
        assert rank["removed"] == post_floor or compat.missing("single_collectives") is not None
        assert rank["stale_bindings"] == []
        assert rank["dispatcher"]["round_trip_equal"]
        assert rank["zero"]["bitwise_equal"] and all(all(ok.values()) for ok in
                                                      rank["zero"]["bytes_equal_closed_forms"].values())
        missing = rank["missing"]
        assert "torch >= 2.13" in missing["single_collectives"] and "torch >= 2.8" in missing["schedule_ops"]
        assert "torch >= 2.9" in missing["dualpipev"]
        l03 = rank["l03"]  # torch's DualPipeV left out, saying why; ours checked against the single process
        assert "ScheduleDualPipeV: it needs torch >= 2.9" in l03["torch_missing"]["runtime"]
        assert "schedule orders" in l03["torch_missing"]["order"] and l03["torch_order_identical"] is None
        assert l03["impls"] == ["ours"] and l03["grad_diff"] <= 1e-5


def test_a_call_to_a_removed_name_fails_the_launch():
    """The same run with a shim that calls ``dist.all_gather_single`` (the dispatcher's call before the shim):
    the rank's AttributeError names it."""
    with pytest.raises(LaunchError, match="AttributeError: module 'torch.distributed' has no attribute "
                                          "'all_gather_single'"):
        launch("tests.test_compat:on_the_floor", 2, {"deliberate_new_name": True}, timeout_s=300, progress="none")


def test_the_shims_take_the_name_this_torch_has(monkeypatch):
    calls = []
    monkeypatch.setattr(dist, "all_gather_into_tensor", lambda *a, **k: calls.append("all_gather_into_tensor"))
    monkeypatch.setattr(dist, "reduce_scatter_tensor", lambda *a, **k: calls.append("reduce_scatter_tensor"))
    monkeypatch.delattr(dist, "all_gather_single", raising=False)
    monkeypatch.delattr(dist, "reduce_scatter_single", raising=False)
    compat.all_gather_single(torch.empty(4), torch.empty(2))
    compat.reduce_scatter_single(torch.empty(2), torch.empty(4))
    assert calls == ["all_gather_into_tensor", "reduce_scatter_tensor"]
    monkeypatch.setattr(dist, "all_gather_single", lambda *a, **k: calls.append("all_gather_single"), raising=False)
    compat.all_gather_single(torch.empty(4), torch.empty(2))
    assert calls[-1] == "all_gather_single"


def test_missing_features_name_the_release_and_unknown_ones_are_refused():
    with pytest.raises(ValueError, match="feature='dualpipe' is not known; allowed"):
        compat.missing("dualpipe")
    assert {since for since, _ in compat.FEATURES.values()} == {"2.8", "2.9", "2.13"}
