"""Lesson 12 in the source's own setting at its true shapes (a model, in the notebook's process).

The blog's setting: Llama-13B, GBS 2048, PP8 x 8 DP·CP ranks (64 GPUs), full recompute, its GitHub set; dynamic
CP against static CP with packing, 195.88 -> 289.32 TFLOPS/GPU (1.48x). Here::

    lengths     the corpus's real document lengths at full scale (``corpus_lengths(..., scale=1)``: Python's
                stdlib, code, the closest thing here to the blog's GitHub set), ``setup.gbs`` of them, truncated
                to 8 ranks x ``setup.cap`` tokens (the blog does not say its longest sequence: our assumption)
    plans       ``dcp_sim.plans_for`` on them: the lesson's own scheduler decides, from the values, static CP
                (the size the longest sequence needs) packed in data order and longest first, Megatron's rules,
                the toolkit's
    one layer   ``ring_attention.shard_layer`` (the block the lesson runs: ring attention inside) at Llama-13B's
                widths in bf16, one sequence alone on torch's fake process group of cp ranks
                (``shapes.estimate``: every ATen op and ring attention's fused blocks timed on the preset's GPU,
                each send at its true bytes on its link), forward and forward + backward, per CP size at three
                lengths
    a group     its sequences' layers added op by op: each op's FLOPs, bytes and growing sizes are a quadratic
                in the sequence length L (attention ∝ L², the rest ∝ L), so three traces give every L exactly,
                and a packed group is one op over all its sequences (its rows the sum, its widths the layer's);
                each op timed again at the packed shape, each ring send at the group's bytes
    overlap     a send runs beside the ops from its issue to the end of the next ring attention block, then is
                waited for (the ring posts the next block's K/V, or a block's dK/dV, before computing one block):
                a span takes the longer of its ops and its sends (sends in flight together share the link); a
                send no block follows (the last dK/dV going home) is exposed
    a stage     layers/pp layers: F = F_layer x layers/pp, B = (B_layer + F_layer) x layers/pp (full recompute)
    the step    ``dcp_sim.step_time(times_of=...)``: each micro-batch's slowest group, 1F1B over pp stages
                (``toolkit.pipeline.simulate``); speed-ups over static CP, re-timed across the sensitivity band

Assumptions the source leaves open: the hardware (``HW``, the h100-ib400 preset: NVLink within the 8 ranks of a
stage); the longest sequence (8 x cap); the lesson's GPT block stands for Llama's (LayerNorm and a GELU MLP of
width 1.5 x 13824, two matrices with SwiGLU's three matrices' FLOPs). Left out, for every plan alike: the
embedding and output layer, the DP gradient reduction, the scheduler's own time, memory.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import lru_cache

import torch
import torch.distributed as dist

from toolkit.context import dcp_sim
from toolkit.context import ring_attention as ra
from toolkit.context.dynamic_cp import Group, Plan
from toolkit.models.gpt import Block, GPTConfig
from toolkit.runtime import collectives
from toolkit.runtime.cluster import Cluster, cluster
from toolkit.runtime.efficiency import Kernel, kernel_seconds
from toolkit.runtime.shapes import Estimate, default_dtype, estimate

HW = "h100-ib400"
"""The preset the source's setting is traced on (the blog names no hardware)."""
SOURCE = {"static": 195.88, "dynamic": 289.32}
"""The blog's TFLOPS/GPU on its GitHub set: packing-only static CP, dynamic CP."""
SHAPE = dcp_sim.LLAMA_13B


def block_config(shape=SHAPE) -> GPTConfig:
    """The lesson's GPT block at ``shape``'s widths: its heads, and a GELU MLP of 1.5 x the SwiGLU width (the
    same FLOPs: two matrices for three)."""
    return GPTConfig(vocab_size=shape.vocab, seq_len=8, n_layer=1, n_head=shape.heads, d_model=shape.hidden,
                     d_ff=3 * shape.ffn // 2)


@dataclass
class LayerTraces:
    """One layer traced for one CP size at three lengths (``traced``): forward + backward each, and how many of
    its kernels and sends are the forward's."""

    cp: int
    lengths: tuple[int, int, int]
    traces: tuple[Estimate, Estimate, Estimate]
    forward_kernels: int
    forward_sends: int

    def weights(self, lengths: list[int]) -> tuple[float, float, float]:
        """Σ over ``lengths`` of the Lagrange weights of the three traced lengths: a quantity quadratic in L,
        summed over the sequences, is Σ_i weight_i x its value at traced length i."""
        a, b, c = self.lengths
        w = [0.0, 0.0, 0.0]
        for x in lengths:
            w[0] += (x - b) * (x - c) / ((a - b) * (a - c))
            w[1] += (x - a) * (x - c) / ((b - a) * (b - c))
            w[2] += (x - a) * (x - b) / ((c - a) * (c - b))
        return w[0], w[1], w[2]


def _trace(cp: int, length: int, hw: Cluster, backward: bool) -> Estimate:
    """``shard_layer`` on one sequence of ``length`` tokens (a multiple of 2·cp) cut over cp ranks, bf16."""
    layout = ra.CPLayout([length], cp)

    def build():
        with default_dtype(torch.bfloat16):
            block = Block(block_config())
            return block, torch.empty(layout.tokens_per_rank, SHAPE.hidden, requires_grad=True)

    def step(block, x):
        with default_dtype(torch.bfloat16):
            out = ra.shard_layer(block, x, layout, dist.group.WORLD if cp > 1 else None)
            if backward:
                out.backward(torch.empty_like(out))

    return estimate(build, step, hw, world_size=cp)


@lru_cache(maxsize=16)
def traced(cp: int) -> LayerTraces:
    """The layer at cp = ``cp`` traced at three lengths (and once forward only, for the split). What is kept of
    the traces does not depend on the preset (each op's FLOPs, bytes and dims; each send's bytes and group):
    ``layer_seconds`` times them on the cluster it is given."""
    hw = cluster(HW)
    lengths = tuple(2 * cp * n for n in (512, 1024, 2048))
    traces = tuple(_trace(cp, n, hw, backward=True) for n in lengths)
    fwd = _trace(cp, lengths[0], hw, backward=False)
    names = {tuple(name for name, _, _ in t.kernels) for t in traces}
    if len(names) != 1 or len({len(t.comms) for t in traces}) != 1 or \
            [n for n, _, _ in fwd.kernels] != list(next(iter(names)))[:len(fwd.kernels)]:
        raise RuntimeError(f"cp={cp}: the layer's ops differ between lengths {lengths}: cannot add them")
    return LayerTraces(cp, lengths, traces, len(fwd.kernels), len(fwd.comms))


@lru_cache(maxsize=1 << 14)
def packed_layer(cp: int, lengths: tuple[int, ...]) -> tuple[list[Kernel], list[dict]]:
    """One layer of a CP group of ``cp`` ranks holding the sequences of ``lengths``, packed (the module docstring:
    each op added over the sequences, at the packed shape): its kernels, and its sends (each a trace's record
    with the group's ``sent_bytes``). The same on every cluster, so kept for the band's re-timings."""
    lt = traced(cp)
    w = lt.weights(list(lengths))
    many = len(lengths) > 1
    kernels = []
    for ops in zip(*(t.kernels for t in lt.traces)):
        k = [op[1] for op in ops]
        dims = tuple(_dim(tuple(x.dims[i] for x in k), w, many, k[0].kind, i) for i in range(len(k[0].dims)))
        kernels.append(Kernel(k[0].kind, sum(wi * x.flops for wi, x in zip(w, k)),
                              sum(wi * x.bytes for wi, x in zip(w, k)), dims))
    sends = [{**cs[0], "sent_bytes": sum(wi * c["sent_bytes"] for wi, c in zip(w, cs))}
             for cs in zip(*(t.comms for t in lt.traces))]
    return kernels, sends


def layer_seconds(cp: int, lengths: list[int], hw: Cluster) -> dict[str, float]:
    """Forward and backward seconds of one layer of a CP group (``packed_layer``) on ``hw``: each kernel on its
    GPU, each send on the link its group spans, the sends beside the ring's blocks (``_overlapped``)."""
    lt, (packed, sent) = traced(cp), packed_layer(cp, tuple(sorted(lengths)))
    g = hw.gpu
    kernels = [kernel_seconds(k, g.bf16_flops, g.hbm_bytes_per_s, g.sms, g.efficiency) for k in packed]
    sends = [(c["at"], collectives.seconds(hw, c["op"], c["group"], c["world"], c["sent_bytes"])[0]) for c in sent]
    nf, ns = lt.forward_kernels, lt.forward_sends
    blocks = [name.startswith("ring attention block") for name, _, _ in lt.traces[0].kernels]
    return {"F": _overlapped(kernels[:nf], blocks[:nf], sends[:ns], 0),
            "B": _overlapped(kernels[nf:], blocks[nf:], sends[ns:], nf),
            "kernels_F": sum(kernels[:nf]), "kernels_B": sum(kernels[nf:])}


def _dim(values: tuple, w: tuple, many: bool, kind: str, i: int):
    """One entry of a packed op's dims: a flag as traced (attention's causal flag: set for a packed block, whose
    mask also cuts between sequences), a width as traced (the same at every length), a size that grows with
    L summed over the sequences."""
    if isinstance(values[0], bool):
        return values[0] or (many and kind == "attention" and i == 3)
    if values[0] == values[1] == values[2]:
        return values[0]
    return max(1, round(sum(wi * v for wi, v in zip(w, values))))


def _overlapped(kernels: list[float], blocks: list[bool], sends: list[tuple[int, float]], offset: int) -> float:
    """Seconds of ops with sends among them (``sends``: (index of the op it is issued before, seconds), indices
    from ``offset``; ``blocks``: which ops are ring attention blocks). Each send is waited for after the first block
    at or after its issue; the sends waited for at one block run beside the ops from the first one's issue to that
    block (a span: the longer of the ops and the sends, which share the link); the ops outside spans run alone::

        forward   post KV ─ [block s] ─ wait          span: max(block, hop)
        backward  post dKV(s-1), KV(s) ─ [block s] ─ wait both, add dK/dV   span: max(block, both hops)
    """
    spans: dict[int, list] = {}  # the block a send is waited at -> [first issue, seconds of its sends]
    exposed = 0.0
    for at, seconds in sends:
        i = at - offset
        end = next((j for j in range(i, len(kernels)) if blocks[j]), None)
        if end is None:
            exposed += seconds  # nothing left to hide it
            continue
        span = spans.setdefault(end, [i, 0.0])
        span[0], span[1] = min(span[0], i), span[1] + seconds
    total, done = exposed, 0
    for end, (start, comm) in sorted(spans.items()):
        total += sum(kernels[done:start]) + max(sum(kernels[start:end + 1]), comm)
        done = end + 1
    return total + sum(kernels[done:])


def group_stage(group: Group, lengths: list[int], hw: Cluster, layers: int, recompute: bool) -> dict[str, float]:
    """A group's stage times, ``dcp_sim.group_times``' keys: ``layers`` layers, with full recompute the forward
    again in the backward; ``compute`` the kernels back to back, ``exposed_comm`` the rest."""
    t = layer_seconds(group.size, [lengths[s] for s in group.samples], hw)
    again = 1 if recompute else 0
    fwd, bwd = layers * t["F"], layers * (t["B"] + again * t["F"])
    compute = layers * ((1 + again) * t["kernels_F"] + t["kernels_B"])
    return {"F": fwd, "B": bwd, "compute": compute, "exposed_comm": fwd + bwd - compute}


def step(plans: dict[str, Plan], setup: dcp_sim.Setup, hw: Cluster) -> dict[str, dict]:
    """Each plan's simulated step (``dcp_sim.step_time`` with the traced group times)."""
    layers = SHAPE.layers // setup.pp
    memo: dict = {}

    def times_of(g: Group, lengths: list[int]) -> dict:
        key = (g.size, tuple(sorted(lengths[s] for s in g.samples)))
        if key not in memo:
            memo[key] = group_stage(g, lengths, hw, layers, setup.recompute)
        return memo[key]

    return {k: dcp_sim.step_time(p, SHAPE, hw, setup.pp, setup.recompute, times_of=times_of)
            for k, p in plans.items()}


def true_shapes(lengths: list[int] | None = None, setup: dcp_sim.Setup = dcp_sim.Setup(), hw: str | Cluster = HW,
                plans: dict[str, Plan] | None = None) -> dict:
    """Static CP against dynamic CP in the blog's setting (``setup``: PP8 x 8, cap, GBS, full recompute) on ``hw``,
    every layer traced at Llama-13B's true shapes (the module docstring). ``lengths``: the global batch (default
    the corpus's document lengths at full scale, ``setup.gbs`` of them, truncated to dcp x cap); ``plans``:
    ``dcp_sim.plans_for``'s (made here when None).

    Returns the lengths' summary, each plan's ``runs`` (step, its parts, micro-batches, model TFLOPS/GPU with
    ``dcp_sim.model_flops``' convention), ``speedup`` (static's step / each plan's) and ``sensitivity``
    (``report.band`` reads it): the speed-ups with every op and send re-timed on the preset's band
    (``hw.perturbed``: the traced ops and the plans do not depend on it)."""
    from toolkit.runtime.emulator_report import over_band
    hw = cluster(hw)
    if lengths is None:
        lengths = dcp_sim.corpus_lengths(setup.gbs, setup.dcp * setup.cap)
    plans = plans or dcp_sim.plans_for(lengths, setup, hw=hw)
    flops = dcp_sim.model_flops(lengths, SHAPE)
    gpus = setup.pp * setup.dcp
    steps = over_band(lambda c: step(plans, setup, c), hw)  # each plan's step on hw and on each perturbed one
    runs = steps["value"]
    for k, r in runs.items():
        r.update(tflops_per_gpu=flops / r["step_s"] / gpus / 1e12, micro_batches=len(plans[k].micro_batches),
                 cp_sizes=dcp_sim._histogram(plans[k].cp_sizes().values()))
    speedup = lambda rs: {k: rs["static"]["step_s"] / r["step_s"] for k, r in rs.items()}  # noqa: E731
    return {"cluster": hw.name, "gpu": hw.gpu.name, "setup": asdict(setup),
            "sequences": len(lengths), "tokens": sum(lengths), "longest": max(lengths),
            "static_cp": plans["static"].micro_batches[0].groups[0].size, "gpus": gpus, "runs": runs,
            "speedup": speedup(runs), "sensitivity": {**steps, "value": speedup(runs),
                                                      "band": {n: speedup(v) for n, v in steps["band"].items()}}}
