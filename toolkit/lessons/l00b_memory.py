"""Lesson 00b, per rank: the memory and communication practices of the source article's 13B case study
("ZeRO-3 + CPU offload + NVMe swap"), each measured on real processes.
Sections (each returns plain numbers under its own key; ``memory_offload`` holds the first three, ``memory_comm``
the last two):
    offload       the toolkit's ZeRO stage ``stage`` with AdamW state in memory, in host memory (``cpu``: master +
                  moments + gradient shards, update on the host; ``stream``: moments streamed to the device per
                  shard), on disk (``nvme``; ``nvme_params`` also the parameter shards), FSDP2 with and without
                  ``CPUOffloadPolicy``: bitwise equality, bytes by category and place, bytes moved, step time; with
                  ``launch(..., cluster=)`` the ZeRO variants' steps with their copies on the host link and their
                  I/O on the disk (virtual time), at the toy's shapes and matched to ``stands_for``, beside the
                  planner's closed form
    nvme_buffers  the disk offload's optimizer step for a grid of buffer_count x buffer_size: exposed I/O,
                  AdamW time, I/O calls, resident host bytes
    spill         the article's MappedCheckpoint measured, and DiskSpill: checkpointed segments' saved
                  tensors in a file-backed mapping, grads vs plain checkpointing
    side_channel  per-micro-batch top-k predictions gathered on rank 0: blocking all_gather vs a gloo side
                  channel waited at the end of the step, on micro-batches of unequal length; the training
                  thread's time in communication counts the gradient all-reduce in both modes
    buckets       DDP bucket sizes swept: step time on gloo and, with ``launch(..., cluster=)``, the step and the
                  all-reduce exposed after backward on the emulated cluster's virtual clock, at the toy's shapes and
                  matched to ``stands_for``'s gradient and backward, beside the closed form of the same link
"""
from __future__ import annotations

import tempfile
import time

from toolkit.lessons import memory_comm, memory_offload
from toolkit.memory import nvme
from toolkit.models import preset
from toolkit.models.catalog import MODELS
from toolkit.runtime.config import Param, common, require_ranks, resolve

SECTIONS = ("offload", "nvme_buffers", "spill", "side_channel", "buckets")

PARAMS = {**common("model", "batch", "steps", "m", "warmup", "bench_steps", "rounds"),
          "sections": Param(list, "sections to run", of=str, choices=SECTIONS),
          "stage": Param(int, "ZeRO stage the offload runs on", choices=(1, 2, 3)),
          "nvme_path": Param(str, "directory the disk offload and activation spill write to (None: the system "
                                  "temporary directory)", nullable=True),
          "buffer_count": Param(int, "disk offload: staging buffers in flight (1 = no read-ahead)", ge=1),
          "buffer_size": Param(int, "disk offload: fp32 elements per staging buffer (a multiple of 1024)", ge=1),
          "sweep_count": Param(list, "nvme_buffers: buffer_count values swept", of=int, ge=1),
          "sweep_size": Param(list, "nvme_buffers: buffer_size values swept (multiples of 1024)", of=int, ge=1),
          "topk": Param(int, "side channel: top-k predictions per position sent to rank 0", ge=1),
          "bucket_mb": Param(list, "DDP bucket_cap_mb values swept", of=float, gt=0),
          "bucket_layers": Param(int, "transformer blocks of the model in the bucket sweep (more blocks: gradients "
                                      "spread over more of backward)", ge=1),
          "stands_for": Param(str, "the real model whose gradient and backward the emulated cluster times the bucket "
                                   "sweep's and the offload's as (the workload-matched mode)", choices=tuple(MODELS))}
PRESETS = {
    "smoke": {"model": "smoke", "batch": 2, "steps": 2, "m": 3, "warmup": 1, "bench_steps": 2, "rounds": 3,
              "sections": list(SECTIONS), "stage": 3, "nvme_path": None, "buffer_count": 2, "buffer_size": 2048,
              "sweep_count": [1, 4], "sweep_size": [1024, 8192], "topk": 4,
              "bucket_mb": [0.001, 0.03, 0.08, 1.0], "bucket_layers": 6, "stands_for": "llama2-7b"},
    "default": {"model": "default", "batch": 2, "steps": 2, "m": 4, "warmup": 1, "bench_steps": 2, "rounds": 2,
                "sections": list(SECTIONS), "stage": 3, "nvme_path": None, "buffer_count": 4, "buffer_size": 16384,
                "sweep_count": [1, 4], "sweep_size": [4096, 32768, 262144], "topk": 5,
                "bucket_mb": [0.005, 0.1, 0.5, 1.0, 25.0], "bucket_layers": 4, "stands_for": "llama2-7b"},
    "full": {"model": "full", "batch": 4, "steps": 5, "m": 8, "warmup": 2, "bench_steps": 5, "rounds": 5,
             "sections": list(SECTIONS), "stage": 3, "nvme_path": None, "buffer_count": 5, "buffer_size": 1 << 20,
             "sweep_count": [1, 2, 5], "sweep_size": [1 << 14, 1 << 18, 1 << 22], "topk": 5,
             "bucket_mb": [0.1, 1.0, 5.0, 25.0, 100.0, 400.0], "bucket_layers": 12, "stands_for": "llama2-7b"},
}


SECTION_WEIGHTS = {"offload": 6.0, "nvme_buffers": 1.0, "spill": 0.3, "side_channel": 1.0, "buckets": 2.5}


def PHASES(cfg: dict) -> list[tuple[str, float]]:  # noqa: N802 - the launcher's name for the progress phases
    """One progress phase per section, weighted by its CPU time at the default preset."""
    return [(name, SECTION_WEIGHTS[name]) for name in cfg["sections"]]


# ---- before any process starts -----------------------------------------------------------------------

def disk_bytes_needed(cfg: dict, world_size: int) -> int:
    """Bytes every rank's files reserve together in ``nvme_path`` (optimizer files, activation spill bound)."""
    shards = memory_offload.shard_numels(cfg["model"], world_size)
    need = 0
    if "offload" in cfg["sections"]:
        need += nvme.file_bytes(shards, False) + (nvme.file_bytes(shards, True) if cfg["stage"] == 3 else 0)
    if "nvme_buffers" in cfg["sections"]:
        need += nvme.file_bytes(shards, False)
    if "spill" in cfg["sections"]:
        mc = preset(cfg["model"])  # block inputs + embed/head/loss saves: a generous bound
        need += 8 * cfg["batch"] * mc.seq_len * (mc.d_model * (mc.n_layer + 4) + 2 * mc.vocab_size) + (1 << 16)
    return need * world_size


def validate(cfg: dict, world_size: int) -> dict:
    cfg = resolve(cfg, PRESETS, PARAMS)
    require_ranks(world_size, 2, "data parallelism, side channels and DDP")
    if cfg["steps"] < 2:
        raise ValueError(f"steps={cfg['steps']}: must be >= 2 (memory is taken after a backward that follows an "
                         "optimizer step, when the optimizer state exists)")
    nvme.check_buffers(cfg["buffer_count"], cfg["buffer_size"])
    for size in cfg["sweep_size"]:
        nvme.check_buffers(1, size, name_size="sweep_size")
    if cfg["nvme_path"] is None:
        cfg["nvme_path"] = tempfile.gettempdir()
    if {"offload", "nvme_buffers", "spill"} & set(cfg["sections"]):
        nvme.check_directory(cfg["nvme_path"], disk_bytes_needed(cfg, world_size))
    return cfg


def run(ctx, cfg: dict) -> dict:
    out = {"rank": ctx.rank, "world_size": ctx.world_size, "model": vars(preset(cfg["model"])),
           "device": ctx.device.type}
    steps = {"offload": memory_offload.offload, "nvme_buffers": memory_offload.nvme_buffers,
             "spill": memory_offload.spill, "side_channel": memory_comm.side_channel, "buckets": memory_comm.buckets}
    out["section_cpu_s"], out["section_wall_s"] = {}, {}
    for name in cfg["sections"]:
        ctx.phase(name)
        cpu, wall = time.process_time(), time.perf_counter()
        with ctx.ledger.tag(name):
            out[name] = steps[name](ctx, cfg)
        out["section_cpu_s"][name] = time.process_time() - cpu  # this rank's CPU time (all its threads)
        out["section_wall_s"][name] = time.perf_counter() - wall
    return out
