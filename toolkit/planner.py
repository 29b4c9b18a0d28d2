"""A memory and communication model for choosing DP / TP / PP / ZeRO — a cost model, not a measurement.

Per GPU, for a dense decoder with Ψ parameters, L layers, hidden h, a heads, sequence s,
micro-batch b, m micro-batches per step, on N = dp·tp·pp GPUs (bytes, bf16 compute, fp32 Adam)::

    weights      2Ψ/(tp·pp)          / dp if ZeRO-3
    grads        2Ψ/(tp·pp)          / dp if ZeRO-2 or 3
    optimizer   12Ψ/(tp·pp)          / dp if ZeRO-1, 2 or 3      (fp32 master + m + v)
    activations  s·b·h·(8 + 24/tp) per layer: Korthikanti et al. 2022's tensor-parallel row, s·b·h·(10 + 24/tp
                 + 5·a·s/(h·tp)), for the project's GPT: no dropout masks (−2), SDPA's flash attention (no a·s²
                 scores), no sequence parallelism (LayerNorm and residual tensors whole on every TP rank);
                 ``planner_check.activation_bytes`` traces the layer to check it;
                 x L/pp layers x pp in-flight micro-batches on the first stage of 1F1B
                 (2·s·b·h per layer with full recompute)
    buffers      ZeRO-3's working set (``Zero3Buffers``, DeepSpeed's names and defaults), 0 otherwise:
                 gathered  min(U + prefetch_bucket_size, max_live_parameters) x 2 bytes, U = one layer's
                           parameters / tp (the unit being computed, and the ones fetched ahead of use)
                 gradients reduce_bucket_size x 2 bytes (the contiguous bucket the unit's full gradients are
                           copied into before their reduce-scatter)
                 With the optimizer offloaded (cpu, nvme) ZeRO-3 keeps its gradient partitions on the host
                 (DeepSpeed's ``grad_partitions_flat_buffer`` lives on the offload device): device grads 0.

    time = compute / (1 - bubble) + exposed communication
      compute   = m x one micro-batch's kernels on one GPU: its L/pp layers at tp-way TP, forward and backward
                  (and the forward again with full recompute), each GEMM, attention and elementwise kernel at the
                  GPU's achieved rate (``toolkit.models.catalog.train_seconds``, ``toolkit.runtime.efficiency``)
      bubble    = (pp-1)/(m+pp-1)                           (1F1B)
      TP comm   = 4 collectives of s·b·h·2 bytes per layer per micro-batch (sequence parallel: an all-gather
                  and a reduce-scatter each way), NCCL's time on the TP group's link
      DP comm   = gradient all-reduce 2(dp-1)/dp · 2Ψ/(tp·pp) bytes (ZeRO-3: x1.5), NCCL's time on the links
                  the DP group spans; a fraction ``dp_overlap`` hides behind backward
      PP comm   = 2·m·s·b·h·2 bytes per stage boundary, latency-bound, ignored in time

``validate_memory_model`` checks the parameter/gradient/optimizer formulas against the bytes
measured by the ZeRO run of lesson 00 (fp32 weights there: 4+4+8 bytes per parameter).

Offload (lesson 00b). ``memory_per_gpu(..., offload_optimizer=, offload_params=)`` moves bytes off the
device; ``offload_per_gpu`` says where they go (the optimizer's fp32 master, if any, is
``bytes_optim - 8``; m and v are 8)::

    offload_optimizer   device optimizer         host                                disk
    none                bytes_optim·Ψ'           -                                   -
    cpu                 0                        (bytes_optim - 8 or 4)·Ψ' master    -
                                                 + 8Ψ' m,v + 4Ψ' fp32 grad shard
    stream              (bytes_optim - 8)·Ψ'     8Ψ' m,v (2 units' m,v on the        -
                        (+ 2 units x 8 bytes                 device during the step)
                         during the step)
    nvme                0                        staging: count x size x 16 bytes    (bytes_optim - 8)·Ψ' + 8Ψ'
    offload_params=nvme (ZeRO-3): device weights 0, disk + bytes_weight·Ψ', host + count x largest unit shard

    Ψ' = Ψ/(tp·pp·dp): the optimizer's shard (ZeRO >= 1).

``offload_memory`` is the same model unit by unit, exact for this toolkit's ``ZeroDataParallel`` with
``toolkit.memory.optim_offload.OffloadAdamW`` / ``toolkit.memory.nvme.DiskAdamW`` (fp32: 4-byte weights
and grads, each unit padded to a multiple of the ranks, each disk region to 4 KiB blocks); with ``cpu`` at
ZeRO 2 or 3 it also puts the gradient shards on the host, as ZeRO-Offload does (they leave the device as
backward produces them; ``memory_per_gpu`` counts them on the host at ZeRO 3 only, on the device at ZeRO 2);
``validate_offload_model`` compares it with the bytes lesson 00b measures, device and host.

The hardware is a ``toolkit.runtime.cluster.Cluster`` (a preset, or one with parts replaced): its GPU (peaks,
achieved efficiency, memory), its links (NCCL's protocols; a group of at most ``gpus_per_node`` GPUs stays
inside a node), its host link (PCIe) and its disk: the same figures the emulated cluster times a run with. The
model's workload is a ``toolkit.models.catalog.ModelSpec``. What the model assumes about the software rather
than the hardware (the hidden share of the DP all-reduce, a host CPU's Adam throughput) is ``Assumptions``.
"""
from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

from toolkit.models.catalog import Workload, train_seconds  # noqa: F401 (Workload: the planner's input)
from toolkit.runtime import collectives
from toolkit.runtime.cluster import Cluster, cluster as make_cluster


@dataclass(frozen=True)
class Zero3Buffers:
    """ZeRO-3's device working set beyond the shards, in elements: DeepSpeed's names and defaults
    (``deepspeed.runtime.zero.config.DeepSpeedZeroConfig``); the config of the “distributed optimization in
    practice” article sets none of them."""
    prefetch_bucket_size: float = 5e7
    """``stage3_prefetch_bucket_size``: parameters gathered ahead of their use."""
    max_live_parameters: float = 1e9
    """``stage3_max_live_parameters``: gathered parameters resident at once, at most."""
    reduce_bucket_size: float = 5e8
    """``reduce_bucket_size``: the contiguous gradient bucket (``contiguous_gradients``, allocated whole)."""


def layer_params(w: "Workload", tp: int = 1) -> float:
    """One transformer layer's parameters on a rank of a TP group (``ModelSpec.layer_params``)."""
    return w.model.layer_params() / tp


def zero3_buffers(w: "Workload", tp: int, bytes_weight: int = 2, bytes_grad: int = 2,
                  buffers: Zero3Buffers = Zero3Buffers()) -> dict[str, float]:
    """Device bytes of ZeRO-3's working set (module docstring, "buffers"): ``gathered`` parameters (the layer
    being computed and the ones prefetched) and the ``reduce_bucket`` of full gradients."""
    gathered = min(layer_params(w, tp) + buffers.prefetch_bucket_size, buffers.max_live_parameters)
    return {"gathered": gathered * bytes_weight, "reduce_bucket": buffers.reduce_bucket_size * bytes_grad}


@dataclass(frozen=True)
class Assumptions:
    """What the step-time model assumes about the software, not the hardware (that is a ``Cluster``, whose GPU's
    ``efficiency`` times the kernels)."""
    dp_overlap: float = 0.7
    """Fraction of the DP all-reduce hidden behind backward."""
    cpu_adam_bytes_per_s: float = 10e9
    """Optimizer-state bytes a host CPU's Adam streams per second, per GPU's share of the host (offload)."""

    def __post_init__(self):
        checks = {"dp_overlap": (lambda v: 0 <= v <= 1, "in [0, 1]"),
                  "cpu_adam_bytes_per_s": (lambda v: 0 < v < math.inf, "> 0 and finite")}
        for name, (ok, allowed) in checks.items():
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not ok(v):
                raise ValueError(f"Assumptions {name}={v!r} is not allowed; allowed: a number {allowed}")


OFFLOAD_OPTIMIZER = ("none", "cpu", "stream", "nvme")
OFFLOAD_PARAMS = ("none", "nvme")


def _check_offload(zero: int, offload_optimizer: str, offload_params: str) -> None:
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero={zero} is not allowed; allowed: 0, 1, 2, 3")
    if offload_optimizer not in OFFLOAD_OPTIMIZER:
        raise ValueError(f"offload_optimizer={offload_optimizer!r} is not allowed; allowed: {OFFLOAD_OPTIMIZER}")
    if offload_params not in OFFLOAD_PARAMS:
        raise ValueError(f"offload_params={offload_params!r} is not allowed; allowed: {OFFLOAD_PARAMS}")
    if offload_params != "none" and zero != 3:
        raise ValueError(f"offload_params={offload_params!r} needs zero=3 (sharded parameters), got zero={zero}")


def memory_per_gpu(w: Workload, dp: int, tp: int, pp: int, zero: int, bytes_weight: int = 2, bytes_grad: int = 2,
                   bytes_optim: int = 12, offload_optimizer: str = "none", offload_params: str = "none",
                   buffers: Zero3Buffers = Zero3Buffers()) -> dict[str, float]:
    """Device bytes per GPU by category (see the module docstring); offloaded bytes are in ``offload_per_gpu``.
    ``buffers``: ZeRO-3's working set (counted when ``zero == 3``)."""
    _check_offload(zero, offload_optimizer, offload_params)
    shard = w.params / (tp * pp)
    act_layer = w.seq_len * w.micro_batch * w.hidden * (2 if w.recompute else 8 + 24 / tp)
    optim = {"none": bytes_optim, "cpu": 0, "stream": bytes_optim - 8, "nvme": 0}[offload_optimizer]
    grads_on_host = zero == 3 and offload_optimizer in ("cpu", "nvme")
    work = sum(zero3_buffers(w, tp, bytes_weight, bytes_grad, buffers).values()) if zero == 3 else 0.0
    return {"weights": 0.0 if offload_params == "nvme" else bytes_weight * shard / (dp if zero >= 3 else 1),
            "grads": 0.0 if grads_on_host else bytes_grad * shard / (dp if zero >= 2 else 1),
            "optimizer": optim * shard / (dp if zero >= 1 else 1),
            "buffers": work,
            "activations": act_layer * (w.layers / pp) * pp}


def offload_per_gpu(w: Workload, dp: int, tp: int, pp: int, zero: int, bytes_weight: int = 2,
                    bytes_optim: int = 12, offload_optimizer: str = "none", offload_params: str = "none",
                    buffer_count: int = 5, buffer_size: int = 10**8) -> dict[str, float]:
    """Host and disk bytes per GPU that the offload options add (see the module docstring).

    Keys: ``host`` (pinned host memory), ``disk`` (NVMe), ``device_step`` (extra device bytes while the
    optimizer step runs: ``stream`` mode's two units of moments, taken as one layer's parameters each).
    """
    _check_offload(zero, offload_optimizer, offload_params)
    opt_shard = w.params / (tp * pp) / (dp if zero >= 1 else 1)
    unit = layer_params(w, tp) / (dp if zero >= 1 else 1)  # one transformer layer's parameters, sharded
    master = max(bytes_optim - 8, 4 if offload_optimizer == "cpu" else 0)
    host = {"none": 0.0, "cpu": (master + 8 + 4) * opt_shard, "stream": 8 * opt_shard,
            "nvme": buffer_count * buffer_size * 16.0}[offload_optimizer]
    disk = (bytes_optim * opt_shard) if offload_optimizer == "nvme" else 0.0
    if offload_params == "nvme":
        disk += bytes_weight * w.params / (tp * pp * dp)
        host += buffer_count * unit * bytes_weight
    return {"host": host, "disk": disk, "device_step": 2 * 8 * unit if offload_optimizer == "stream" else 0.0}


def offload_memory(unit_numels: list[int], dp: int, stage: int, offload_optimizer: str = "none",
                   offload_params: str = "none", buffer_count: int = 2, buffer_size: int = 1 << 16) -> dict:
    """Bytes one rank of this toolkit's fp32 ZeRO holds right after backward, by place and category.

    ``unit_numels``: parameters of each ZeRO unit (embedding, each block, head), unsharded. Returns
    ``{"device": {"params", "grads", "optim"}, "host": {...}, "disk": {...}, "device_step_optim": int}``
    where ``host`` has ``optim`` (m, v), ``master`` and ``grads`` (``cpu``), or ``staging`` (``nvme``), and
    ``device_step_optim`` is what the device holds for the optimizer while the step runs (stream's slots).
    """
    _check_offload(stage, offload_optimizer, offload_params)
    shards = [u if stage == 0 else -(-u // dp) for u in unit_numels]
    padded = [u if stage == 0 else s * dp for u, s in zip(unit_numels, shards)]
    s, full = 4 * sum(shards), 4 * sum(padded)
    # cpu (ZeRO-Offload): each gradient shard goes to the host as backward produces it; ZeRO-1 keeps its full
    # local gradient on the device until the step reduces it
    grads = s if stage >= 2 else full
    device = {"params": 0 if offload_params == "nvme" else (s if stage == 3 else full),
              "grads": 0 if offload_optimizer == "cpu" and stage != 1 else grads,
              "optim": 2 * s if offload_optimizer == "none" else 0}
    host, disk, step = {}, {}, 0
    if offload_optimizer == "cpu":
        host = {"optim": 2 * s, "master": s, "grads": s}
    elif offload_optimizer == "stream":
        host, step = {"optim": 2 * s}, 2 * 2 * 4 * max(shards)
    elif offload_optimizer == "nvme":
        block = 1024
        regions = sum(-(-n // block) * block for n in shards) * 4
        host = {"staging": buffer_count * buffer_size * 16
                + (buffer_count * 4 * max(shards) if offload_params == "nvme" else 0)}
        disk = {"file": regions * (3 if offload_params == "nvme" else 2)}
    return {"device": device, "host": host, "disk": disk, "device_step_optim": step}


def validate_offload_model(unit_numels: list[int], dp: int, stage: int, measured: dict[str, dict],
                           buffer_count: int, buffer_size: int) -> list[dict]:
    """One row per (variant, place, category): the model's bytes, the measured ones, their ratio.

    ``measured`` maps a variant (``zero``, ``cpu``, ``stream``, ``nvme``, ``nvme_params``) to the bytes
    lesson 00b measured after backward: ``{"device": {...}, "host": {...}, "disk": {...}}``.
    """
    modes = {"zero": ("none", "none"), "cpu": ("cpu", "none"), "stream": ("stream", "none"),
             "nvme": ("nvme", "none"), "nvme_params": ("nvme", "nvme")}
    rows = []
    for variant, got in measured.items():
        if variant not in modes:
            continue
        want = offload_memory(unit_numels, dp, stage, *modes[variant], buffer_count=buffer_count,
                              buffer_size=buffer_size)
        for place in ("device", "host", "disk"):
            for cat in sorted(set(want[place]) | set(got.get(place, {}))):
                m, g = want[place].get(cat, 0), got.get(place, {}).get(cat, 0)
                rows.append({"variant": variant, "place": place, "category": cat, "model_bytes": m,
                             "measured_bytes": g, "ratio": g / m if m else (1.0 if g == 0 else None)})
    return rows


def step_time(w: Workload, hw: Cluster, dp: int, tp: int, pp: int, zero: int,
              assume: Assumptions = Assumptions()) -> dict[str, float]:
    """Seconds per optimizer step on dp·tp·pp GPUs of ``hw``, split into compute (each GPU's kernels at the
    GPU's achieved rates: ``catalog.train_seconds``), bubble, exposed TP and exposed DP communication (NCCL's
    times on the links the groups span)."""
    micro_batches = max(w.global_batch // (dp * w.micro_batch), 1)
    per_micro = train_seconds(w.model, hw.gpu, w.micro_batch, w.seq_len, tp, pp, w.recompute)["total"]
    compute = micro_batches * per_micro
    bubble = (pp - 1) / (micro_batches + pp - 1)
    act = w.seq_len * w.micro_batch * w.hidden * 2  # one activation, bf16
    calls = 4 * (w.layers / pp) * micro_batches  # an all-gather and a reduce-scatter per layer, each way
    tp_comm = calls * collectives.group_seconds(hw, "all_gather", tp, (tp - 1) / tp * act) if tp > 1 else 0.0
    grad = 2 * w.params / (tp * pp) * (1.5 if zero == 3 else 1.0)
    dp_comm = collectives.group_seconds(hw, "all_reduce", dp, 2 * (dp - 1) / dp * grad, tp * pp) * (1 - assume.dp_overlap)
    busy = compute + tp_comm
    return {"compute": compute, "bubble": busy / (1 - bubble) - busy, "tp_comm": tp_comm, "dp_comm": dp_comm,
            "total": busy / (1 - bubble) + dp_comm, "micro_batches": micro_batches}


def _hardware(hw: Cluster | str, gpus: int) -> Cluster:
    """``hw`` checked (a preset name becomes its ``Cluster``), and ``gpus`` an int >= 1."""
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"gpus={gpus!r} is not allowed; allowed: an int >= 1")
    return make_cluster(hw)


def plan(w: Workload, hw: Cluster | str, gpus: int, assume: Assumptions = Assumptions()) -> list[dict]:
    """Every (dp, tp, pp, zero) on ``gpus`` GPUs of ``hw`` (a ``Cluster`` or a preset name) that fits, fastest
    first; configurations that do not fit come last."""
    hw = _hardware(hw, gpus)
    rows = []
    for tp in (t for t in (1, 2, 4, 8, 16) if t <= gpus and w.heads % t == 0):
        for pp in (p for p in (1, 2, 4, 8, 16, 32) if p <= w.layers and w.layers % p == 0):
            if gpus % (tp * pp):
                continue
            dp = gpus // (tp * pp)
            if w.global_batch % (dp * w.micro_batch):
                continue
            for zero in (0, 1, 2, 3):
                mem = memory_per_gpu(w, dp, tp, pp, zero)  # offload options: see offload_per_gpu
                t = step_time(w, hw, dp, tp, pp, zero, assume)
                total_gb = sum(mem.values()) / 1e9
                rows.append({"dp": dp, "tp": tp, "pp": pp, "zero": zero, "memory_gb": total_gb,
                             "fits": total_gb <= hw.gpu.memory_bytes / 1e9 * 0.9, "step_s": t["total"],
                             "tokens_per_s": w.global_batch * w.seq_len / t["total"],
                             **{f"mem_{k}_gb": v / 1e9 for k, v in mem.items()},
                             **{f"t_{k}_s": v for k, v in t.items() if k != "total"}})
    return sorted(rows, key=lambda r: (not r["fits"], r["step_s"]))


def validate_memory_model(n_params: int, dp: int, measured: dict[str, dict[str, int]]) -> list[dict]:
    """Compare the model's bytes (fp32 weights and grads, AdamW m+v: 4/4/8 bytes) with measured bytes per rank.

    ``measured`` maps a variant name (``ddp``, ``zero1``, ``zero2``, ``zero3``) to bytes by category
    (``params``, ``grads``, ``optim``). Padding of flat shards makes the measurement slightly larger.
    """
    w = Workload(params=n_params)
    rows = []
    for variant, got in measured.items():
        zero = 0 if variant == "ddp" else int(variant[-1])
        want = memory_per_gpu(w, dp, 1, 1, zero, bytes_weight=4, bytes_grad=4, bytes_optim=8)
        for ours, theirs in (("weights", "params"), ("grads", "grads"), ("optimizer", "optim")):
            rows.append({"variant": variant, "category": ours, "model_bytes": want[ours],
                         "measured_bytes": got.get(theirs, 0),
                         "ratio": got.get(theirs, 0) / want[ours] if want[ours] else None})
    return rows


# ---- choosing a configuration: layout, micro-batches, schedule, checkpointing, offload ----------------------------
def offload_terms(w: Workload, dp: int, tp: int, pp: int, zero: int, offload: str, hw: Cluster,
                  assume: Assumptions = Assumptions()) -> dict[str, float]:
    """Seconds of each part of the optimizer offload's step: gradients down and bf16 weights up over the host
    link (``pcie``, ``hw.host``), the Adam step on the host (``host_adam``: 16 B/param of state touched, at
    ``assume.cpu_adam_bytes_per_s``), and for ``nvme`` the optimizer state (16 B/param) read from and written to
    ``hw.disk`` (``nvme_read``, ``nvme_write``). Empty for ``offload == "none"``."""
    if offload == "none":
        return {}
    shard = w.params / (tp * pp) / (dp if zero >= 1 else 1)
    terms = {"pcie": (2 + 2) * shard / hw.host.bytes_per_s, "host_adam": 16 * shard / assume.cpu_adam_bytes_per_s}
    if offload == "nvme":
        terms.update(nvme_read=16 * shard / hw.disk.read_bytes_per_s, nvme_write=16 * shard / hw.disk.write_bytes_per_s)
    return terms


def offload_time(w: Workload, dp: int, tp: int, pp: int, zero: int, offload: str, hw: Cluster,
                 assume: Assumptions = Assumptions()) -> float:
    """Seconds per step the optimizer offload adds, not overlapped (an upper bound): the sum of
    ``offload_terms``. Pipelined over sub-groups (DeepSpeed's swapper) it takes at least their longest."""
    return sum(offload_terms(w, dp, tp, pp, zero, offload, hw, assume).values())


@functools.lru_cache(maxsize=None)
def schedule_bubble(name: str, pp: int, m: int) -> tuple[float, float]:
    """(bubble fraction, micro-batches of activations rank 0 holds at its peak) of pipeline schedule ``name`` on
    ``pp`` ranks with ``m`` micro-batches, from the pipeline simulator (``toolkit.pipeline.simulate``; unit costs
    F = 1, B = 2, W = 1 per rank, split over its stage chunks). ``pp == 1``: no bubble, one micro-batch held."""
    if pp == 1:
        return 0.0, 1.0
    from toolkit.pipeline.schedule import make_schedule
    from toolkit.pipeline.simulate import Costs, simulate
    sched = make_schedule(name, pp, m)
    spr = sched.stages_per_rank
    sim = simulate(sched, Costs(F=1 / spr, B=2 / spr, W=1 / spr))
    return sim.bubble_fraction, max(sim.peak_mb)


def configuration_time(w: Workload, hw: Cluster | str, dp: int, tp: int, pp: int, zero: int, schedule: str = "1f1b",
                       offload: str = "none", assume: Assumptions = Assumptions()) -> dict[str, float]:
    """The step-time model of one configuration, as ``choose`` prices it: ``step_time``'s compute and TP time
    stretched by ``schedule``'s simulated bubble (``schedule_bubble``), plus its exposed DP communication and the
    optimizer offload's time (``offload_time``). Seconds by term, ``total``, and the bubble fraction."""
    hw = make_cluster(hw)
    t = step_time(w, hw, dp, tp, pp, zero, assume)
    bubble = schedule_bubble(schedule, pp, int(t["micro_batches"]))[0]
    busy = t["compute"] + t["tp_comm"]
    extra = offload_time(w, dp, tp, pp, zero, offload, hw, assume)
    return {"compute": t["compute"], "bubble": busy / (1 - bubble) - busy, "tp_comm": t["tp_comm"],
            "dp_comm": t["dp_comm"], "offload": extra, "total": busy / (1 - bubble) + t["dp_comm"] + extra,
            "bubble_fraction": bubble}


def choose(w: Workload, hw: Cluster | str, gpus: int, micro_batches=(1, 2, 4), schedules=("1f1b", "dualpipev"),
           recompute=(False, True), offload=("none", "cpu", "nvme"), zero_stages=(0, 1, 2, 3),
           headroom: float = 0.9, assume: Assumptions = Assumptions()) -> list[dict]:
    """Every (dp, tp, pp, ZeRO stage, micro-batch size, pipeline schedule, full recompute, optimizer offload) that
    ``gpus`` GPUs of ``hw`` (a ``Cluster`` or a preset name) can run, with the model's memory per GPU and step
    time (``configuration_time``); the ones that fit first, fastest first.

    The pipeline simulator supplies what the closed forms assume (``schedule_bubble``): the bubble of the
    schedule at this pp and number of micro-batches and the micro-batches of activations rank 0 holds at its
    peak (1F1B: pp; DualPipeV: more). A model, not a measurement: label what it prints as such.
    """
    from dataclasses import replace

    from toolkit.pipeline import schedule  # each schedule says what layouts it can run
    hw = _hardware(hw, gpus)
    rows = []
    for tp in (t for t in (1, 2, 4, 8) if t <= hw.gpus_per_node and w.heads % t == 0):
        for pp in (p for p in (1, 2, 4, 8, 16) if w.layers % p == 0):
            if gpus % (tp * pp):
                continue
            dp = gpus // (tp * pp)
            for mb in micro_batches:
                if w.global_batch % (dp * mb):
                    continue
                m = w.global_batch // (dp * mb)
                for name in (schedules if pp > 1 else ("none",)):
                    if pp > 1 and not schedule.fits(name, pp, m, w.layers):
                        continue
                    bubble, peak_mb = schedule_bubble(name, pp, m)
                    for rc, zero, off in itertools.product(recompute, zero_stages, offload):
                        wl = replace(w, micro_batch=mb, recompute=rc)
                        t = configuration_time(wl, hw, dp, tp, pp, zero, name, off, assume)
                        mem = memory_per_gpu(wl, dp, tp, pp, zero, offload_optimizer=off)
                        mem["activations"] *= peak_mb / pp  # the formula assumes pp micro-batches held
                        gb = sum(mem.values()) / 1e9
                        rows.append({
                            "dp": dp, "tp": tp, "pp": pp, "zero": zero, "micro_batch": mb, "m": m,
                            "schedule": name, "recompute": rc, "offload": off, "memory_gb": gb,
                            "fits": gb <= hw.gpu.memory_bytes / 1e9 * headroom, "step_s": t["total"],
                            "tokens_per_s": w.global_batch * w.seq_len / t["total"], "bubble": bubble,
                            "peak_mb": peak_mb, "t_compute_s": t["compute"], "t_bubble_s": t["bubble"],
                            "t_tp_comm_s": t["tp_comm"], "t_dp_comm_s": t["dp_comm"], "t_offload_s": t["offload"],
                            **{f"mem_{k}_gb": v / 1e9 for k, v in mem.items()}})
    return sorted(rows, key=lambda r: (not r["fits"], r["step_s"], r["memory_gb"]))


def label(row: dict) -> str:
    """``dp 3 · tp 8 · pp 1 · ZeRO-1 · b 1 · 1f1b · recompute · offload cpu`` for a ``choose`` row."""
    parts = [f"dp {row['dp']}", f"tp {row['tp']}", f"pp {row['pp']}", f"ZeRO-{row['zero']}", f"b {row['micro_batch']}"]
    if row["pp"] > 1:
        parts.append(f"{row['schedule']} (m {row['m']})")
    parts.append("full recompute" if row["recompute"] else "no recompute")
    parts.append(f"offload {row['offload']}")
    return " · ".join(parts)


def explain(rows: list[dict], hw: Cluster | str, headroom: float = 0.9) -> list[str]:
    """Why ``rows[0]`` (``choose``'s answer on ``hw``), in sentences built from the model's numbers: what it costs,
    what the faster configurations lack, and for each knob the best configuration that sets it otherwise."""
    best, memory_gb = rows[0], make_cluster(hw).gpu.memory_bytes / 1e9
    if not best["fits"]:
        return [f"nothing fits in {headroom:.0%} of {memory_gb:g} GB; the smallest needs "
                f"{min(r['memory_gb'] for r in rows):.1f} GB"]
    cap = memory_gb * headroom
    out = [f"{label(best)}: {best['memory_gb']:.1f} GB of the {cap:.0f} GB allowed ({headroom:.0%} of "
           f"{memory_gb:g} GB), {best['step_s']:.2f} s per step = compute {best['t_compute_s']:.2f} + bubble "
           f"{best['t_bubble_s']:.2f} + TP {best['t_tp_comm_s']:.2f} + exposed DP {best['t_dp_comm_s']:.2f} + "
           f"offload {best['t_offload_s']:.2f} s"]
    faster = [r for r in rows if not r["fits"] and r["step_s"] < best["step_s"]]
    if faster:
        f = min(faster, key=lambda r: r["step_s"])
        out.append(f"faster configurations do not fit: the fastest, {label(f)}, needs {f['memory_gb']:.1f} GB "
                   f"for {f['step_s']:.2f} s")
    for key in ("pp", "tp", "zero", "micro_batch", "schedule", "recompute", "offload"):
        alternatives: dict = {}
        for r in rows:  # sorted: the first row with a value is the best configuration that has it
            if r[key] != best[key]:
                alternatives.setdefault(r[key], r)
        for value, alt in alternatives.items():
            verdict = (f"{alt['step_s']:.2f} s ({alt['step_s'] / best['step_s'] - 1:+.1%}), {alt['memory_gb']:.1f} GB"
                       if alt["fits"] else f"does not fit ({alt['memory_gb']:.1f} GB)")
            out.append(f"{key} {value} instead of {best[key]}: at best {verdict}")
    return out
