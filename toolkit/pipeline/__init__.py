"""Pipeline parallelism: schedules as data, a simulator, a real executor, and torch's implementation beside it.

::

    schedule.py   Action, Schedule, generators (gpipe, one_f_one_b, interleaved_1f1b, zb_h1, dualpipev,
                  from_torch) ─┬─► simulate.py    op costs -> timelines, bubble, step time, memory
                               ├─► executor.py    real p2p run on p processes -> loss, grads, timeline, bytes
                               └─► torch_compare  torch.distributed.pipelining on the same stages
    harness.py    the tiny GPT as a pipeline, set up once (PipelineSetup), checked and timed runs of schedules
    extensions of the executor, each an ExecutorHook passed in its list of hooks:
    recompute.py  checkpointed forward + recompute queue (recompute in the bubble; the R op)
    seq1f1b.py    Seq1F1B: sequence chunks (its schedule, and the SequenceChunks hook)
    vocab_parallel.py, vocab_passes.py   vocabulary parallelism: the maths, schedule and simulation; the
                  VocabPasses hook that runs the S and T passes and the input layer
    dp_separate.py  the data-parallel all-reduce issued per stage as soon as its gradients are final

Quick look, no processes needed::

    from toolkit.pipeline import make_schedule, simulate, Costs
    s = make_schedule("dualpipev", p=4, m=8)
    print(s.table())
    print(simulate(s, Costs(F=1, B=2, W=1, FB=2.5)).summary())
"""
from .executor import ActivationMeter, ExecutorHook, PipelineExecutor, WeightGradStore, split_weight_grads
from .recompute import Recompute, RecomputeQueue
from .schedule import (SCHEDULES, TORCH_NAMES, Action, Needs, Schedule, check_layout, dualpipev, fb, from_torch, gpipe,
                       fits, interleaved_1f1b, interleaved_layout, linear_layout, make_schedule, needs, one_f_one_b,
                       register, schedule_options, torch_order, torch_order_missing, v_layout, with_recompute, zb_h1)
from .simulate import Costs, SimResult, closed_form_bubble, simulate

__all__ = ["Action", "Schedule", "SCHEDULES", "TORCH_NAMES", "make_schedule", "fb", "gpipe",
           "one_f_one_b", "interleaved_1f1b", "zb_h1", "dualpipev", "from_torch", "torch_order", "torch_order_missing",
           "schedule_options", "Needs", "needs", "check_layout", "fits", "register",
           "linear_layout",
           "interleaved_layout", "v_layout", "Costs", "SimResult", "simulate", "closed_form_bubble",
           "with_recompute", "PipelineExecutor", "ExecutorHook", "WeightGradStore", "ActivationMeter",
           "split_weight_grads", "Recompute", "RecomputeQueue"]
