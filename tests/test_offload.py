"""Pipeline-aware activation offload: bitwise-equal gradients, lower resident peak, prefetch, views once,
parameters never moved, the per-rank budget, the copies timed on an emulated host link (and torch's save_on_cpu
there), bad inputs; and the lesson on p=2 real ranks under 1F1B, on an emulated cluster."""
import gc
import types
import weakref

import pytest
import torch
import torch.nn as nn

from toolkit import launch
from toolkit.lessons import l08_activation_offload
from toolkit.memory.offload import (ALL_KINDS, ActivationOffloader, SaveOnCPU, in_flight, long_lived, per_rank_budget,
                                    resolve_policy, schedule_order)
from toolkit.pipeline.schedule import Action, one_f_one_b
from toolkit.models import GPT, lm_loss, preset
from toolkit.runtime.bench import verdict
from toolkit.runtime.cluster import cluster
from toolkit.runtime import portable
from toolkit.runtime.emulator import Emulator

ORDER = [("F", (0, 0, 0)), ("F", (0, 1, 0)), ("B", (0, 0, 0)), ("B", (0, 1, 0))]  # GPipe on one rank: 2 in flight


def _run(policy: str | None, prefetch: bool = True, budget_bytes: int | None = None):
    """Two micro-batches of the tiny GPT: both forwards, then both backwards. Returns grads and the offloader."""
    torch.manual_seed(0)
    model = GPT(preset("smoke"))
    x = torch.randint(0, 256, (2, 2, 32))
    off = (ActivationOffloader({0: model}, ORDER, policy=policy, prefetch=prefetch, budget_bytes=budget_bytes)
           if policy else None)
    losses = []
    for mb in range(2):
        with off.forward((0, mb, 0)) if off else torch.enable_grad():
            losses.append(lm_loss(model(x[mb]), x[mb]))
    for mb in range(2):
        if off:
            off.backward_begin((0, mb, 0))
        losses[mb].backward()
        if off:
            off.backward_end((0, mb, 0))
    if off:
        off.remove()
    return [p.grad.clone() for p in model.parameters()], off


def test_gradients_bitwise_equal_and_resident_peak_drops():
    ref, _ = _run(None)
    _, base = _run("none")
    for policy in ("all", "attention", "mlp", "core"):
        grads, off = _run(policy)
        assert all(torch.equal(a, b) for a, b in zip(grads, ref)), policy
        stats = off.stats  # a copy is wasted when a module outside the policy saves the same storage later
        assert stats["offloaded_bytes"] == stats["reloaded_bytes"] + stats["wasted_copy_bytes"] > 0
        assert (stats["wasted_copy_bytes"] > 0) == (policy == "core")  # core's output is proj's input
        assert off.meter.max_by_category["act"] < base.meter.max_by_category["act"]
        assert off.resident_bytes() == 0  # everything saved was released after the backwards
    _, full = _run("all")
    assert full.meter.max_by_category["act"] <= 0.5 * base.meter.max_by_category["act"]
    assert full.stats["late_reloads"] == 0  # prefetch had every group back before it was needed


def test_without_prefetch_the_backward_waits_for_reloads():
    grads, off = _run("all", prefetch=False)
    ref, _ = _run(None)
    assert all(torch.equal(a, b) for a, b in zip(grads, ref))
    assert off.stats["late_reloads"] == off.stats["on_demand_reloads"] > 0  # no emulator: late = not issued ahead


def test_a_budget_sends_the_first_groups_of_each_forward_while_they_fit():
    """budget_bytes: groups leave in forward order (the longest-lived first) while the forward's bytes fit; the
    first that does not fit stays, and so does every later one. Gradients stay bitwise equal."""
    ref, _ = _run(None)
    _, full = _run("all")
    per_forward = full.stats["offloaded_bytes"] // 2  # ORDER keeps no last group: both forwards send everything
    budget = per_forward // 2
    grads, off = _run("all", budget_bytes=budget)
    assert all(torch.equal(a, b) for a, b in zip(grads, ref))
    assert 0 < off.stats["offloaded_bytes"] <= 2 * budget
    assert full.meter.max_by_category["act"] < off.meter.max_by_category["act"]
    # one forward, inspected before its backward: what left is a prefix of its groups, and the next did not fit
    torch.manual_seed(0)
    model = GPT(preset("smoke"))
    x = torch.randint(0, 256, (2, 32))
    off = ActivationOffloader({0: model}, ORDER, policy="all", budget_bytes=budget)
    with off.forward((0, 1, 0)):
        lm_loss(model(x), x)
    groups = [g for _, g in sorted(off._live[(0, 1, 0)].items()) if any(s.offloadable for s in g.stored)]
    left = [any(s.host is not None for s in g.stored) for g in groups]
    assert left == sorted(left, reverse=True) and any(left) and not all(left)
    sent = sum(s.nbytes for g in groups for s in g.stored if s.host is not None)
    assert sent == off.stats["offloaded_bytes"] <= budget
    assert sent + sum(s.nbytes for s in groups[left.index(False)].stored if s.offloadable) > budget
    off.remove()
    _, nothing = _run("all", budget_bytes=0)
    assert nothing.stats["offloaded_bytes"] == 0


def test_per_rank_budget_follows_what_each_rank_holds_under_1f1b():
    s = one_f_one_b(4, 8)
    assert [in_flight(schedule_order(s, r)) for r in range(4)] == [4, 3, 2, 1]  # rank r holds p - r
    assert [per_rank_budget(1200, schedule_order(s, r)) for r in range(4)] == [900, 800, 600, 0]
    assert in_flight(ORDER) == 2 and per_rank_budget(1201, ORDER) == 601


def test_on_an_emulated_cluster_copies_take_the_host_link_and_late_reloads_are_waits(monkeypatch):
    """Copies timed as α + bytes/β of the host link, floats at the target's 2 bytes (the CPU holds 4). This clock
    runs no compute (no ComputeTimer installed): nothing can hide a copy, so every reload's first wait moves the
    stream and is late, by its copy's exposed time."""
    emu = Emulator(cluster("h100-ib400"), 0, 1)
    monkeypatch.setattr(portable, "current", lambda: emu)
    ref, _ = _run(None)
    grads, off = _run("all")
    assert all(torch.equal(a, b) for a, b in zip(grads, ref))
    d2h, h2d = ([c for c in emu.comms if c["link"] == q] for q in ("d2h", "h2d"))
    assert sum(c["bytes"] for c in d2h) == off.stats["offloaded_bytes"] / 2
    assert sum(c["bytes"] for c in h2d) == off.stats["reloaded_bytes"] / 2
    for c in d2h + h2d:
        assert c["local_end"] - c["start"] == pytest.approx(emu.cluster.host.seconds(c["bytes"]))
    assert off.stats["on_demand_reloads"] == 0 and off.stats["late_reloads"] == len(h2d) > 0
    assert off.stats["reload_wait_s"] == pytest.approx(sum(c["exposed"] for c in h2d))
    assert off.stats["reload_wait_s"] > 0


def test_save_on_cpu_on_an_emulated_cluster_copies_every_saved_tensor_on_the_stream(monkeypatch):
    """torch's save_on_cpu moves nothing on a CPU; on the emulated cluster each saved tensor (the weight too) is a
    D2H in pack and an H2D in unpack that the stream waits for: with no compute on this clock, the step is the sum
    of the copies."""
    lin = nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        torch.tanh(lin(x)).sum()
    emu = Emulator(cluster("h100-ib400"), 0, 1)
    monkeypatch.setattr(portable, "current", lambda: emu)
    hook = SaveOnCPU()
    hook.executor = types.SimpleNamespace(device=torch.device("cpu"))
    with hook.forward_context(Action("F", 0, 0)):
        loss = torch.tanh(lin(x)).sum()
    loss.backward()
    d2h, h2d = ([c["bytes"] for c in emu.comms if c["link"] == q] for q in ("d2h", "h2d"))
    assert d2h == [2 * n for n in saved] and sorted(h2d) == sorted(d2h)
    assert emu.now() == pytest.approx(sum(emu.cluster.host.seconds(b) for b in d2h + h2d))


def test_a_saved_tensor_never_unpacked_leaves_when_its_backward_ends():
    """A storage saved twice but unpacked once (the other node's backward never runs) is freed by
    ``backward_end``, not whenever Python's cycle collector happens to run (a peak that moved between runs)."""
    key = (0, 0, 0)
    gc.disable()
    try:
        off = ActivationOffloader({0: nn.Linear(2, 2)}, [("F", key), ("B", key)], policy="all")
        with off.forward(key):
            h = torch.randn(256, requires_grad=True) * 2  # an activation: [256]
            loss = h.sin().sum()  # saves h
            unused = h.cos()  # saves h again; this branch never reaches the loss
        storage = weakref.ref(h.untyped_storage())
        del h, unused
        off.backward_begin(key)
        loss.backward()
        off.backward_end(key)
        del loss
        assert storage() is None
        assert off.resident_bytes() == 0
    finally:
        gc.enable()


def test_parameters_are_never_offloaded_and_views_count_once():
    class QKV(nn.Module):  # saves three views of one storage, and its weight
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 24))

        def forward(self, x):
            qkv = x @ self.w  # [4, 24]: one storage of 384 B
            q, k, v = qkv.split(8, dim=-1)
            return (q * k * v).sum()

    class Stage(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.Module()
            self.attn.core = QKV()

        def forward(self, x):
            return self.attn.core(x)

    stage = Stage()
    order = [("F", (0, 0, 0)), ("F", (0, 1, 0)), ("B", (0, 0, 0)), ("B", (0, 1, 0))]
    off = ActivationOffloader({0: stage}, order, policy="core")
    x = torch.randn(4, 8)  # not a leaf that requires grad: offloadable
    key = (0, 1, 0)  # its backward is not the next one: nothing is kept back
    with off.forward(key):
        loss = stage(x)
    saved = [s for g in off._live[key].values() for s in g.stored]
    # x (128 B, saved by the matmul for dW), qkv (384 B, saved as q, k and v: once) and q*k (128 B)
    assert sorted(s.nbytes for s in saved) == [128, 128, 384]
    assert all(s.host is not None and s.device is None for s in saved)  # all left; the weight stayed
    assert off.stats["offloaded_bytes"] == 128 + 128 + 384
    assert off.meter.max_by_category["act"] == 128 + 128 + 384
    off.backward_begin(key)
    loss.backward()
    off.backward_end(key)
    grad = stage.attn.core.w.grad.clone()
    stage.attn.core.w.grad = None
    stage(x).backward()
    assert torch.equal(grad, stage.attn.core.w.grad)


def test_group_whose_backward_is_next_keeps_its_last_group():
    torch.manual_seed(0)
    model = GPT(preset("smoke"))
    order = [("F", (0, 0, 0)), ("B", (0, 0, 0))]  # the last stage of 1F1B: each F is followed by its own B
    off = ActivationOffloader({0: model}, order, policy="all")
    x = torch.randint(0, 256, (2, 32))
    with off.forward((0, 0, 0)):
        loss = lm_loss(model(x), x)
    groups = off._live[(0, 0, 0)]
    last = groups[max(groups)]
    assert off.stats["kept_last"] == 1 and all(s.device is not None for s in last.stored)
    assert all(s.device is None for i, g in groups.items() if i < max(groups) for s in g.stored if s.offloadable)
    off.backward_begin((0, 0, 0))
    loss.backward()
    off.backward_end((0, 0, 0))
    assert off.stats["late_reloads"] == 0
    off.remove()
    # when another backward comes first, the last group (the loss, saved outside every module: "other") leaves too
    off = ActivationOffloader({0: model}, ORDER, policy="all")
    with off.forward((0, 1, 0)):
        loss = lm_loss(model(x), x)
    groups = off._live[(0, 1, 0)]
    last = groups[max(groups)]
    assert off.stats["kept_last"] == 0 and all(s.device is None for s in last.stored if s.offloadable)
    assert any(s.offloadable for s in last.stored)
    off.remove()


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match=r"unknown modules \['attention_core'\]"):
        resolve_policy(["qkv", "attention_core"])
    with pytest.raises(ValueError, match="allowed"):
        resolve_policy("everything")
    assert resolve_policy("attention") == {"qkv", "core", "proj"} and resolve_policy("all") == set(ALL_KINDS)
    model = GPT(preset("smoke"))
    with pytest.raises(ValueError, match=r"\(0, 7, 0\).*does not run"):
        ActivationOffloader({0: model}, ORDER, groups=[(0, 7, 0)])
    off = ActivationOffloader({0: model}, ORDER)
    with pytest.raises(ValueError, match=r"F\(1, 0, 0\).*not in this rank's schedule"):
        with off.forward((1, 0, 0)):
            pass
    off.remove()
    with pytest.raises(ValueError, match="every item of policies='flash' is not allowed"):
        l08_activation_offload.validate({"preset": "smoke", "policies": ["all", "flash"]}, 2)
    with pytest.raises(ValueError, match="skip_within must be >= 0"):
        l08_activation_offload.validate({"preset": "smoke", "skip_within": -1}, 2)
    with pytest.raises(ValueError, match="skip_within must be an int >= 0"):
        long_lived(ORDER, -1)
    with pytest.raises(ValueError, match="m=1"):
        l08_activation_offload.validate({"preset": "smoke", "m": 1}, 2)
    with pytest.raises(ValueError, match="n_layer=3"):
        l08_activation_offload.validate({"preset": "smoke", "n_layer": 3}, 2)
    with pytest.raises(ValueError, match="needs at least 2 ranks"):
        l08_activation_offload.validate({"preset": "smoke"}, 1)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="budget_bytes must be None"):
            ActivationOffloader({0: model}, ORDER, budget_bytes=bad)
    with pytest.raises(ValueError, match="chunk_bytes must be an int >= 0"):
        per_rank_budget(-1, ORDER)
    with pytest.raises(ValueError, match="stands_for='gpt-5' is not allowed"):
        l08_activation_offload.validate({"preset": "smoke", "stands_for": "gpt-5"}, 2)


@pytest.fixture(scope="module")
def pipeline():
    # the notebook's smoke run, which the suite's launch cache shares with nbval's
    return launch("l08_activation_offload", 2, {"preset": "smoke"}, timeout_s=300, progress="none",
                  cluster="h100-ib400")


def test_1f1b_on_two_ranks_gradients_bitwise_equal_and_peak_halved(pipeline):
    for r in pipeline:
        rows = {row["variant"]: row for row in r["rows"]}
        assert all(row["grads_bitwise_equal"] for row in r["rows"])
        assert rows["all"]["resident_reduction"] >= 0.5  # target: at least 50% lower with every module offloaded
        assert 0 < rows["attention"]["resident_reduction"] < rows["all"]["resident_reduction"]
        assert rows["all"]["on_demand_reloads"] == 0  # every reload issued ahead
        assert rows["none"]["offloaded_bytes"] == 0
        # proj saves only core's output storage: alone, nothing may leave (Megatron: attn_proj needs core_attn)
        assert rows["proj"]["offloaded_bytes"] == 0 and rows["proj"]["resident_reduction"] == 0
    assert pipeline[0]["order"] == ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"]
    assert pipeline[1]["order"] == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]


def test_long_lived_follows_the_lifetime_in_the_schedule():
    s = one_f_one_b(4, 8)
    # rank 3 runs each backward right after its forward: nothing lives longer than 1 action
    assert long_lived(schedule_order(s, 3), 1) == set()
    assert long_lived(schedule_order(s, 3), 0) == {(3, mb, 0) for mb in range(8)}
    # rank 0: F0 F1 F2 F3 B0 F4 B1 ...: every micro-batch lives 4+ actions
    assert long_lived(schedule_order(s, 0), 3) == {(0, mb, 0) for mb in range(8)}
    assert long_lived(schedule_order(s, 0), 4) == {(0, mb, 0) for mb in range(1, 7)}  # F0 -> B0, F7 -> B7: 4 apart
    sizes = [len(long_lived(schedule_order(s, r), 2)) for r in range(4)]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-1] == 0  # later ranks offload less


def test_offload_by_lifetime_per_rank(pipeline):
    """all-long-lived: bitwise-equal gradients; the last rank copies nothing, rank 0 what 'all' copies."""
    rows = [{row["variant"]: row for row in r["rows"]} for r in pipeline]
    for by in rows:
        assert by["all-long-lived"]["grads_bitwise_equal"] and by["all-long-lived"]["on_demand_reloads"] == 0
    assert rows[-1]["all-long-lived"]["offloaded_bytes"] == 0 < rows[-1]["all"]["offloaded_bytes"]
    assert rows[-1]["all-long-lived"]["resident_peak"] == rows[-1]["none"]["resident_peak"]
    assert rows[0]["all-long-lived"]["offloaded_bytes"] == rows[0]["all"]["offloaded_bytes"] > 0
    assert pipeline[0]["long_lived"] == list(range(4)) and pipeline[-1]["long_lived"] == []
    assert all("bench" in by["all"] and "bench" in by["all-long-lived"] for by in rows)  # timed side by side


def test_per_rank_budget_in_the_lesson(pipeline):
    """all-budget: rank 0 (2 forwards held) sheds half of each forward, the last rank (1) nothing; bitwise."""
    rows = [{row["variant"]: row for row in r["rows"]} for r in pipeline]
    assert [r["in_flight"] for r in pipeline] == [2, 1]
    for r, by in zip(pipeline, rows):
        assert r["budget_bytes"] == r["chunk_bytes"] - r["chunk_bytes"] // r["in_flight"]
        assert by["all-budget"]["grads_bitwise_equal"] and by["all-budget"]["on_demand_reloads"] == 0
        assert by["all-budget"]["offloaded_bytes"] <= r["budget_bytes"] * r["m"]
    assert 0 < rows[0]["all-budget"]["offloaded_bytes"] < rows[0]["all"]["offloaded_bytes"]
    assert rows[0]["all"]["resident_peak"] < rows[0]["all-budget"]["resident_peak"] < rows[0]["none"]["resident_peak"]
    assert rows[1]["all-budget"]["offloaded_bytes"] == 0


def test_emulated_cost_of_offloading(pipeline):
    """On the emulated cluster (virtual time, deterministic): every timed variant at both shapes; a copy engine
    carries exactly the offloader's bytes (at bf16, matched: times the byte scale); copies never speed a step up;
    torch's save_on_cpu, on the compute stream, is slower than no offload."""
    E = pipeline[0]["emulated"]
    assert E["stands_for"] == "llama2-7b" and E["scales"]["bytes"] > 1
    for view, scale in (("toy", 1.0), ("matched", E["scales"]["bytes"])):
        for r in pipeline:
            runs = r["emulated"][view]
            assert set(runs) == set(l08_activation_offload.TIMED)
            assert runs["none"]["link_bytes"] == {"d2h": 0, "h2d": 0} and runs["none"]["late_reloads"] == 0
            for v in ("all", "all-budget", "attention"):
                assert runs[v]["link_bytes"]["d2h"] == pytest.approx(runs[v]["offloaded_bytes"] / 2 * scale)
                assert runs[v]["link_bytes"]["h2d"] == pytest.approx(runs[v]["link_bytes"]["d2h"])
        bench = {v: [r["emulated"][view][v]["bench"] for r in pipeline] for v in l08_activation_offload.TIMED}
        for v in ("all", "all-budget", "attention", "save_on_cpu"):
            assert not verdict(bench["none"], bench[v]).faster, (view, v)
        assert verdict(bench["none"], bench["save_on_cpu"]).slower
