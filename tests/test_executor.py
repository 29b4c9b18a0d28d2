"""The executor on real processes: every schedule's loss and gradients equal the single-process model."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

from toolkit import launch
from toolkit.models import GPT, lm_loss, preset
from toolkit.pipeline import (Action, PipelineExecutor, dualpipev, make_schedule, one_f_one_b, torch_order_missing,
                              zb_h1)
from toolkit.pipeline.executor import ActivationMeter, WeightGradStore, split_weight_grads
from toolkit.pipeline.harness import PipelineSetup, gpt_micro_batches, gpt_stages
from toolkit.pipeline.torch_compare import runtime_missing

OURS = ["gpipe", "1f1b", "interleaved", "zb-h1", "dualpipev", "1f1b-recompute-inline", "1f1b-recompute-bubble"]
# torch's orders run by our executor, and torch's own runtime on the same model and data, where this torch has
# them (toolkit.runtime.compat: orders torch >= 2.8, runtime >= 2.7, DualPipeV >= 2.9)
TORCH_ORDERS = [n for n in ("torch:zbv", "torch:dualpipev") if torch_order_missing(n.split(":")[1]) is None]
TORCH_IMPL = [n for n in ("torch-impl:1f1b", "torch-impl:dualpipev") if runtime_missing(n.split(":")[1]) is None]
TOL = 1e-5


@pytest.fixture(scope="module")
def two_ranks():
    return launch("pipeline_selfcheck", 2, {"schedules": OURS + TORCH_ORDERS + TORCH_IMPL, "m": 4},
                  timeout_s=300, progress="none")


@pytest.fixture(scope="module")
def three_ranks():
    with warnings.catch_warnings():  # 3 ranks on a 2-core machine share cores; results are unaffected
        warnings.simplefilter("ignore", UserWarning)
        return launch("pipeline_selfcheck", 3,
                      {"schedules": ["1f1b", "interleaved", "zb-h1", "dualpipev", "1f1b-recompute-bubble"], "m": 6},
                      timeout_s=300, progress="none")


def _check(results):
    for name in results[0]:
        diffs = [r[name]["grad_diff"] for r in results]
        losses = [r[name]["loss"] for r in results if r[name]["loss"] is not None]
        assert max(diffs) <= TOL, (name, diffs)
        assert len(losses) == 1 and losses[0] == pytest.approx(results[0][name]["ref_loss"], abs=TOL), (name, losses)


def test_every_schedule_matches_the_single_process_model_on_2_ranks(two_ranks):
    assert set(two_ranks[0]) == set(OURS + TORCH_ORDERS + TORCH_IMPL)
    _check(two_ranks)


def test_every_schedule_matches_the_single_process_model_on_3_ranks(three_ranks):
    _check(three_ranks)


def test_recompute_holds_fewer_activation_bytes(two_ranks):
    rank0 = two_ranks[0]  # rank 0 of 1F1B holds 2 micro-batches; keep = 1 halves that
    assert rank0["1f1b-recompute-bubble"]["peak_act_bytes"] < rank0["1f1b"]["peak_act_bytes"]
    assert rank0["1f1b-recompute-inline"]["peak_act_bytes"] < rank0["1f1b"]["peak_act_bytes"]


def test_single_rank_schedules_run_without_processes():
    """p = 1: every stage is local, so the executor runs in this process (handoffs only)."""
    setup = PipelineSetup.build("smoke", n_layer=4, m=2, micro_batch=2, seed=0)
    inputs, targets, base, reference, ref_loss = setup.inputs, setup.targets, setup.base, setup.reference, setup.ref_loss
    cfg = setup.model_cfg
    for schedule in (dualpipev(1, 2), zb_h1(1, 2), one_f_one_b(1, 2, "bubble", keep=1)):
        model = copy.deepcopy(base)
        executor = PipelineExecutor(schedule, 0, gpt_stages(model, schedule, 0), lm_loss, (2, cfg.seq_len, cfg.d_model))
        assert executor.step(inputs, targets) == pytest.approx(ref_loss, abs=TOL)
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert torch.equal(p.grad, q.grad), (schedule.name, name)


def test_weight_grad_store_defers_exactly_the_linear_weights():
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    split = split_weight_grads(copy.deepcopy(plain))
    x = torch.randn(3, 4, requires_grad=True)
    plain(x).square().sum().backward()
    x2 = x.detach().requires_grad_()
    store = WeightGradStore()  # one per executor
    with store.splitting():  # this forward's backward will be an I
        y = split(x2)
    with store.deferring():
        y.square().sum().backward()
    store.flush((0, 0, 0))
    assert split[0].weight.grad is None and split[1].weight.grad is not None  # LayerNorm's grad is not deferred
    assert torch.allclose(x2.grad, x.grad)
    store.pop((0, 0, 0))
    for p, q in zip(split.parameters(), plain.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6) and p.grad.grad_fn is None


def test_activation_meter_counts_each_storage_once():
    meter = ActivationMeter(params=[])
    x = torch.randn(4, 8)
    meter.hold((0, 0, 0), [x, x[1:], x.t()])  # three views of one storage
    assert meter.live == x.numel() * 4
    meter.hold((0, 1, 0), [x])  # another key holding it: still one storage
    meter.release((0, 0, 0))
    assert meter.live == x.numel() * 4
    meter.release((0, 1, 0))
    assert meter.live == 0 and meter.peak == x.numel() * 4


def test_executor_rejects_stages_the_schedule_does_not_put_here():
    schedule = make_schedule("1f1b", 2, 2)
    with pytest.raises(ValueError, match="schedule puts \\[0\\] here"):
        PipelineExecutor(schedule, 0, {1: torch.nn.Identity()}, lm_loss, (1, 1, 1))


def test_lesson_03_bad_input_names_the_parameter():
    from toolkit.lessons import l03_dualpipev as l03
    with pytest.raises(ValueError, match="m=3 micro-batches is too few: dualpipev needs m >= 2 × world_size = 4"):
        l03.validate({"preset": "smoke", "m": 3}, 2)
    with pytest.raises(ValueError, match=r"n_layer=6 must be divisible by the 4 pipeline stages of dualpipev on world_size=2"):
        l03.validate({"preset": "smoke", "n_layer": 6}, 2)
    with pytest.raises(ValueError, match="m=5 must be divisible by world_size=2"):
        l03.validate({"preset": "smoke", "m": 5}, 2)
    with pytest.raises(ValueError, match="every item of schedules='zb-h2' is not allowed"):
        l03.validate({"preset": "smoke", "schedules": ["zb-h2"]}, 2)
    with pytest.raises(ValueError, match="preset='tiny'"):
        l03.validate({"preset": "tiny"}, 2)
    with pytest.raises(ValueError, match="micro_batch must be >= 1"):
        l03.validate({"preset": "smoke", "micro_batch": 0}, 2)


def test_hooks_run_for_every_op_including_i_w_r_and_both_halves_of_an_fb():
    """A list of hooks: each one sees every op (none is skipped silently), the first hook is the outermost
    (list order going in, reverse order coming out), and an op nothing runs is refused."""
    import contextlib

    from toolkit.pipeline import Action, ExecutorHook, Recompute, Schedule, linear_layout

    seen = []

    class Spy(ExecutorHook):
        def __init__(self, name):
            self.name = name

        def step_begin(self, inputs, targets):
            seen.append((self.name, "step_begin", ""))

        @contextlib.contextmanager
        def forward_context(self, a):
            seen.append((self.name, "enter", str(a)))
            yield
            seen.append((self.name, "exit", str(a)))

        def before_backward(self, a):
            seen.append((self.name, "before_backward", str(a)))

        def after_backward(self, a):
            seen.append((self.name, "after_backward", str(a)))

        def after_op(self, a):
            seen.append((self.name, "after_op", str(a)))

        def after_action(self, action):
            seen.append((self.name, "after_action", str(action)))

        def step_end(self, loss):
            seen.append((self.name, "step_end", ""))
            return loss

    def pair(first: tuple, second: tuple) -> bool:
        """``first`` is seen, and ``second`` right after it."""
        i = seen.index(first)
        return seen[i + 1] == second

    cfg = preset("smoke", n_layer=2)
    inputs, targets = gpt_micro_batches(2, 1, cfg.seq_len)
    with_r = Schedule("gpipe-r", [[Action("F", 0, 0), Action("F", 0, 1), Action("R", 0, 0), Action("B", 0, 0),
                                   Action("B", 0, 1)]], linear_layout(1), 2, checkpointed=frozenset({(0, 0, 0)})).check()
    for schedule in (dualpipev(1, 2), with_r):
        seen.clear()
        torch.manual_seed(0)
        model = GPT(cfg)
        hooks = ([Recompute()] if schedule.checkpointed else []) + [Spy("outer"), Spy("inner")]
        ex = PipelineExecutor(schedule, 0, gpt_stages(model, schedule, 0), lm_loss, (1, cfg.seq_len, cfg.d_model),
                              hooks=hooks)
        ex.step(inputs, targets)
        parts = [p for a in schedule.ranks[0] for p in a.parts]
        assert {op for op in "FBIWR" if any(p.op == op for p in parts)} == (
            {"F", "B", "I", "W"} if schedule.name == "dualpipev" else {"F", "B", "R"})
        assert seen[:2] == [("outer", "step_begin", ""), ("inner", "step_begin", "")]
        assert seen[-2:] == [("inner", "step_end", ""), ("outer", "step_end", "")]
        for p in parts:
            assert pair(("inner", "after_op", str(p)), ("outer", "after_op", str(p))), p
            if p.op in ("F", "R"):
                assert pair(("outer", "enter", str(p)), ("inner", "enter", str(p))), p
                assert pair(("inner", "exit", str(p)), ("outer", "exit", str(p))), p
            if p.op in ("B", "I"):
                assert pair(("outer", "before_backward", str(p)), ("inner", "before_backward", str(p))), p
                assert pair(("inner", "before_backward", str(p)), ("inner", "after_backward", str(p))), p
                assert pair(("inner", "after_backward", str(p)), ("outer", "after_backward", str(p))), p
        for who in ("outer", "inner"):
            assert [x[2] for x in seen if x[:2] == (who, "after_action")] == [str(a) for a in schedule.ranks[0]]
        assert any(a.op == "FB" for a in schedule.ranks[0]) == (schedule.name == "dualpipev")
    unknown = Schedule("custom", [[Action("F", 0, 0), Action("X", 0, 0), Action("B", 0, 0)]], linear_layout(1), 1)
    with pytest.raises(ValueError, match="nothing runs ops \\['X'\\]"):
        PipelineExecutor(unknown, 0, {0: torch.nn.Identity()}, lm_loss, (1, 1, 1))
    with pytest.raises(ValueError, match="checkpoints forwards: pass hooks=\\[Recompute\\(\\)\\]"):
        PipelineExecutor(with_r, 0, {0: torch.nn.Identity()}, lm_loss, (1, 1, 1))
    with pytest.raises(ValueError, match="Recompute runs op 'R', which is already run"):
        PipelineExecutor(with_r, 0, {0: torch.nn.Identity()}, lm_loss, (1, 1, 1), hooks=[Recompute(), Recompute()])


# -- DualPipeV's F&B: overlapped for real ---------------------------------------------------------------
FB_M = 6


def fb_modes(ctx, cfg):
    """Rank program: DualPipeV with its F&B overlapped, with the halves back to back, and unpaired (traced)."""
    from toolkit.pipeline.harness import grads_bitwise_equal
    setup = PipelineSetup.build("smoke", n_layer=4, m=cfg["m"], micro_batch=1, device=ctx.device)
    p, out, models = ctx.world_size, {}, {}
    for name, schedule, overlap in (("overlapped", dualpipev(p, cfg["m"]), True),
                                    ("sequential", dualpipev(p, cfg["m"]), False),
                                    ("unpaired", dualpipev(p, cfg["m"], pair=False), True)):
        model, ex = setup.executor(schedule, ctx.rank, fb_overlap=overlap, trace=True)
        ex.step(setup.inputs, setup.targets)
        models[name] = model
        out[name] = {"trace": ex.trace, "grad_diff": setup.grad_diff(model, schedule, ctx.rank)}
    mine = setup.stages(models["overlapped"], dualpipev(p, cfg["m"]), ctx.rank).values()
    out["bitwise_equal_to_overlapped"] = {name: grads_bitwise_equal(models["overlapped"], models[name], mine)
                                          for name in ("sequential", "unpaired")}
    return out


@pytest.fixture(scope="module")
def fb_runs():
    return launch("tests.test_executor:fb_modes", 2, {"m": FB_M}, timeout_s=300, progress="none")


def test_fb_overlap_keeps_gradients_bitwise_those_of_one_process(fb_runs):
    for r in fb_runs:
        assert all(r[name]["grad_diff"] == 0.0 for name in ("overlapped", "sequential", "unpaired")), r
        assert r["bitwise_equal_to_overlapped"] == {"sequential": True, "unpaired": True}


def test_fb_overlap_mechanism(fb_runs):
    """In an overlapped F&B the B half's gradient is in flight while the F half computes (posted before F,
    waited for only after F), and F's output leaves before B computes; back to back, both inputs are awaited
    before F. Checked on the order of posts, waits, ops and sends, not on time."""
    schedule, checked = dualpipev(2, FB_M), 0
    for rank, r in enumerate(fb_runs):
        for mode in ("overlapped", "sequential"):
            trace = r[mode]["trace"]
            pos = {tuple(entry): i for i, entry in enumerate(trace)}  # (what, message or op)
            for a in schedule.ranks[rank]:
                if a.op != "FB":
                    continue
                f, b = a.sub
                (f_in,), (b_in,) = schedule.recvs(f) or [None], schedule.recvs(b) or [None]
                if f_in is None or b_in is None:
                    continue  # a pair with a local input has nothing to overlap on that side
                assert pos[("post", str(b_in))] < pos[("op", str(f))]  # B's gradient is in flight during F
                if mode == "overlapped":
                    assert pos[("op", str(f))] < pos[("wait", str(b_in))] < pos[("op", str(b))]
                    if schedule.sends(f):  # F's activation leaves before B computes
                        out_msg = Action("RECV_F", f.stage + 1, f.mb, f.chunk)
                        assert pos[("send", str(out_msg))] < pos[("op", str(b))]
                else:
                    assert pos[("wait", str(b_in))] < pos[("op", str(f))]
                checked += 1
    assert checked >= 4  # both ranks have pairs with two remote inputs
