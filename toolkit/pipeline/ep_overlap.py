"""Expert-parallel all-to-alls hidden inside DualPipeV's F&B pairs: one half's tokens travel while the other computes.

DualPipe pairs the forward of one micro-batch with the backward of another on the same rank (an ``FB`` action).
Under expert parallelism every MoE layer of either half waits twice for an all-to-all (dispatch and combine; in
the backward, their mirror images). ``EPOverlap`` runs the two halves of every pair as two generators
(``toolkit.moe.overlap``: a forward yields at each all-to-all it issues, the backward of a cut forward likewise)
and switches between them at every transfer, so one half computes while the other's tokens are on the wire::

    plain F&B    F: attn ··dispatch·· experts ··combine·· attn ...  B: ...··combine⁻¹·· experts⁻¹ ··dispatch⁻¹··
    EPOverlap    F: attn  dispatch→          experts  combine→         attn ...
                 B:          combine⁻¹→  experts⁻¹         dispatch⁻¹→      attn⁻¹ ...
                 (· = waiting; each half waits for its own transfer only when it resumes)

A pair's backward runs segment by segment, so the forward of its micro-batch must have been *cut* at every
all-to-all (``toolkit.moe.overlap.Cut``): the forwards of the micro-batches whose backward is the second half of
a pair run as cut forwards (through ``stage_fn``); every other op runs as the executor runs it. Each half does
the plain executor's ops on the plain executor's values, so losses and gradients are bitwise those of DualPipeV
without the overlap. The ranks of an expert-parallel group run the same schedule, so they issue their all-to-alls
in the same order. The hook takes over whole pairs: hooks that act around each op (offload's copies,
recomputation, vocabulary passes) cannot see inside them, and ``bind`` refuses them.
"""
from __future__ import annotations

import contextlib
import time

import torch

from toolkit.moe.overlap import Cut, Tracer, micro_batch_backward, micro_batch_forward, moe_layers, run_interleaved

from .executor import ExecutorHook, key_of
from .schedule import Action


class EPOverlap(ExecutorHook):
    """Runs every F&B pair of an expert-parallel MoE pipeline with its all-to-alls overlapped (module docstring)."""

    def __init__(self):
        self.cuts: dict[tuple, Cut] = {}
        self.tracer = Tracer("fb")

    def bind(self, executor) -> None:
        super().bind(executor)
        others = [type(h).__name__ for h in executor.hooks if h is not self]
        if others:
            raise ValueError(f"EPOverlap runs every F&B pair itself, so the hooks {others}, which act around each op, "
                             "would not see inside the pairs; use it alone")
        if executor.loss_fn is None:
            raise ValueError("EPOverlap computes the last stage's loss with the executor's loss_fn; got None")
        pairs = [a for a in executor.schedule.ranks[executor.rank] if a.sub]
        split = [str(a) for a in pairs if a.sub[1].op != "B"]
        if split:
            raise ValueError(f"EPOverlap pairs a forward with a full backward (B); these pairs have another second "
                             f"half: {split}")
        for module in executor.modules.values():
            moe_layers(module)  # every block must dispatch to its experts by all-to-all
        self.cut_keys = {key_of(a.sub[1]) for a in pairs}

    def ops(self):
        return {"FB": self.run_pair}

    def step_begin(self, inputs, targets) -> None:
        self.cuts = {}

    def stage_fn(self, a: Action, fn):
        """The forward of a micro-batch whose backward is a pair's second half: cut at every all-to-all."""
        if key_of(a) not in self.cut_keys:
            return fn
        return lambda x: self._run([self._forward(a, x)])[0]

    def _forward(self, a: Action, x: torch.Tensor):
        """Forward ``a`` as a generator (cut when a pair runs its backward), with the executor's loss on the last
        stage: ``loss_fn(logits, target) / m``, the plain executor's ops."""
        ex, finish = self.executor, None
        if a.stage == ex.last:
            target, m = ex.targets[a.mb], ex.schedule.m
            finish = lambda logits: ex.loss_fn(logits, target) / m  # noqa: E731
        cut = self.cuts.setdefault(key_of(a), Cut()) if key_of(a) in self.cut_keys else None
        return micro_batch_forward(ex.modules[a.stage], x, None, a.mb, self.tracer, cut=cut, finish=finish)

    def _run(self, generators: list) -> list:
        """``run_interleaved`` with the dispatchers' trace hooks put back afterwards (the generators set them)."""
        dispatchers = [moe.dispatcher for module in self.executor.modules.values() for _, moe in moe_layers(module)]
        traces = [d.trace for d in dispatchers]
        try:
            return run_interleaved(generators)
        finally:
            for d, trace in zip(dispatchers, traces):
                d.trace = trace

    def run_pair(self, action: Action) -> None:
        """Both halves of F&B ``action``, interleaved at every all-to-all. As the executor's overlapped F&B does,
        the backward waits for its gradient only when it starts (after the forward's first segment) and the
        forward's output leaves as soon as the forward ends, while the backward goes on."""
        ex = self.executor
        f, b = action.parts
        ex.wait_inputs(f)
        tl = ex.timeline
        start, vstart = (time.perf_counter(), tl.vnow()) if tl is not None else (None, None)
        with ex.splitting(f), ex.recording(key_of(f)):  # what the executor runs a forward in
            self._run([self._forward_half(f), self._backward_half(b)])
        if tl is not None:  # one span for the pair: its halves have no separate times
            tl.add("FB", start - tl.origin, tl.now(), vstart=vstart, vend=tl.vnow(), label=str(action),
                   stage=f.stage, mb=f.mb, chunk=f.chunk, pair="F&B", overlap="EP")

    def _forward_half(self, f: Action):
        ex = self.executor
        x = ex.forward_input(f)
        out = yield from self._forward(f, x)
        ex.forward_output(f, x, out)

    def _backward_half(self, b: Action):
        ex = self.executor
        ex.wait_inputs(b)
        x, _, out_grad = ex.backward_input(b)
        yield from micro_batch_backward(self.cuts.pop(key_of(b)), b.mb, self.tracer, out_grad)
        ex.backward_output(b, x)


__all__ = ["EPOverlap"]
