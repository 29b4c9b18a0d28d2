"""Lesson 00b, per rank: the memory and communication practices of the source article's 13B case study
("ZeRO-3 + CPU offload + NVMe swap"), each measured on real processes.

Sections (each returns plain numbers under its own key):
    offload       the toolkit's ZeRO stage ``stage`` with AdamW state in memory, in host memory (``cpu``: master +
                  moments, update on the host; ``stream``: moments streamed to the device per shard), on disk
                  (``nvme``; ``nvme_params`` also the parameter shards), FSDP2 with and without
                  ``CPUOffloadPolicy``: bitwise equality, bytes by category and place, bytes moved, step time
    nvme_buffers  the disk offload's optimizer step for a grid of buffer_count x buffer_size: exposed I/O,
                  AdamW time, I/O calls, resident host bytes
    spill         the article's MappedCheckpoint measured, and DiskSpill: checkpointed segments' saved
                  tensors in a file-backed mapping, grads vs plain checkpointing
    side_channel  per-micro-batch top-k predictions gathered on rank 0: blocking all_gather vs a gloo side
                  channel waited at the end of the step, on micro-batches of unequal length; the training
                  thread's time in communication counts the gradient all-reduce in both modes
    buckets       DDP bucket sizes swept on an emulated link (and on the real one): exposed comm, step time
"""
from __future__ import annotations

import copy
import gc
import tempfile
import time

import torch
import torch.distributed as dist

from toolkit.comm.bucketing import LinkEmulator, steady_exposed
from toolkit.comm.side_channel import SideChannel, blocking_gather
from toolkit.data import batches
from toolkit.memory import nvme
from toolkit.memory.checkpointing import apply_checkpointing, saved_activation_bytes
from toolkit.memory.optim_offload import OffloadAdamW, adamw_
from toolkit.memory.spill import ALIGN, DiskSpill, article_custom_checkpoint_saved_bytes, inspect_article_snippet
from toolkit.models import GPT, lm_loss, preset
from toolkit.planner import offload_memory, validate_offload_model
from toolkit.parallel.zero import ZeroDataParallel, adamw, default_units, optimizer_state, storage_bytes
from toolkit.runtime.bench import compare
from toolkit.runtime.config import Param, common, require_ranks, resolve
from toolkit.runtime.memory import MemoryTracker

SECTIONS = ("offload", "nvme_buffers", "spill", "side_channel", "buckets")
OFFLOAD_VARIANTS = ("zero", "cpu", "stream", "nvme", "nvme_params", "fsdp2", "fsdp2_offload")

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
          "latency_ratio": Param(float, "emulated link: latency per all-reduce call / backward time", ge=0),
          "comm_ratio": Param(float, "emulated link: all-reduce time of the whole gradient / backward time", gt=0),
          "links": Param(list, "links the bucket sizes are swept on", of=str, choices=("emulated", "real"))}
PRESETS = {
    "smoke": {"model": "smoke", "batch": 2, "steps": 2, "m": 3, "warmup": 1, "bench_steps": 2, "rounds": 3,
              "sections": list(SECTIONS), "stage": 3, "nvme_path": None, "buffer_count": 2, "buffer_size": 2048,
              "sweep_count": [1, 4], "sweep_size": [1024, 8192], "topk": 4,
              "bucket_mb": [0.001, 0.03, 0.08, 1.0], "bucket_layers": 6, "latency_ratio": 0.03, "comm_ratio": 1.0,
              "links": ["emulated"]},
    "default": {"model": "default", "batch": 2, "steps": 2, "m": 4, "warmup": 1, "bench_steps": 2, "rounds": 2,
                "sections": list(SECTIONS), "stage": 3, "nvme_path": None, "buffer_count": 4, "buffer_size": 16384,
                "sweep_count": [1, 4], "sweep_size": [4096, 32768, 262144], "topk": 5,
                "bucket_mb": [0.005, 0.1, 0.5, 1.0, 25.0], "bucket_layers": 4, "latency_ratio": 0.03, "comm_ratio": 1.0,
                "links": ["emulated"]},
    "full": {"model": "full", "batch": 4, "steps": 5, "m": 8, "warmup": 2, "bench_steps": 5, "rounds": 5,
             "sections": list(SECTIONS), "stage": 3, "nvme_path": None, "buffer_count": 5, "buffer_size": 1 << 20,
             "sweep_count": [1, 2, 5], "sweep_size": [1 << 14, 1 << 18, 1 << 22], "topk": 5,
             "bucket_mb": [0.1, 1.0, 5.0, 25.0, 100.0, 400.0], "bucket_layers": 12, "latency_ratio": 0.03, "comm_ratio": 1.0,
             "links": ["real", "emulated"]},
}


SECTION_WEIGHTS = {"offload": 6.0, "nvme_buffers": 1.0, "spill": 0.3, "side_channel": 1.0, "buckets": 2.5}


def PHASES(cfg: dict) -> list[tuple[str, float]]:  # noqa: N802 - the launcher's name for the progress phases
    """One progress phase per section, weighted by its CPU time at the default preset."""
    return [(name, SECTION_WEIGHTS[name]) for name in cfg["sections"]]


# ---- before any process starts -----------------------------------------------------------------------

def unit_numels(model_name: str) -> list[int]:
    """Parameters of each ZeRO unit (embedding, blocks, head) of the preset's GPT (built on the meta device)."""
    with torch.device("meta"):
        model = GPT(preset(model_name))
    return [sum(p.numel() for p in u.parameters()) for u in default_units(model)]


def shard_numels(model_name: str, world_size: int, stage: int) -> list[int]:
    """Elements of each ZeRO unit's shard on one rank (padded to a multiple of the ranks, as ZeroDataParallel)."""
    return [-(-u // world_size) for u in unit_numels(model_name)]


def disk_bytes_needed(cfg: dict, world_size: int) -> int:
    """Bytes every rank's files reserve together in ``nvme_path`` (optimizer files, activation spill bound)."""
    shards = shard_numels(cfg["model"], world_size, cfg["stage"])
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


# ---- helpers -------------------------------------------------------------------------------------------

def _bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[k], b[k]) for k in b)


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in b)


class _Variant:
    """One way to hold the optimizer state: ``fwd_bwd``, ``step``, ``memory`` by place, ``moved``, params."""

    def __init__(self, name: str, base, stage: int, directory: str, buffer_count: int, buffer_size: int, group):
        self.name, self.zdp, self.moved_closed_form = name, None, None
        model = copy.deepcopy(base)
        if name.startswith("fsdp2"):
            from torch.distributed.device_mesh import DeviceMesh
            from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard
            device = next(model.parameters()).device
            policy = CPUOffloadPolicy(pin_memory=device.type == "cuda") if name == "fsdp2_offload" else OffloadPolicy()
            mesh = DeviceMesh.from_group(group, device.type)
            for unit in default_units(model):
                fully_shard(unit, mesh=mesh, offload_policy=policy)
            fully_shard(model, mesh=mesh, offload_policy=policy)
            self.model, self.optimizer = model, adamw(list(model.parameters()))
            return
        factory = {"zero": adamw, "cpu": lambda ps: OffloadAdamW(ps, mode="cpu"),
                   "stream": lambda ps: OffloadAdamW(ps, mode="stream"),
                   "nvme": lambda ps: nvme.DiskAdamW(ps, directory, buffer_count, buffer_size),
                   "nvme_params": lambda ps: nvme.DiskAdamW(ps, directory, buffer_count, buffer_size,
                                                            offload_params=True)}[name]
        self.zdp = ZeroDataParallel(model, factory, stage=stage, group=group)
        self.model, self.optimizer = self.zdp, self.zdp.optimizer
        self.params_on_disk = nvme.DiskParams(self.zdp, self.optimizer) if name == "nvme_params" else None

    def fwd_bwd(self, x, y) -> float:
        loss = self.model(x, y)
        loss.backward()
        return loss.item()

    def step(self) -> None:
        if self.zdp is not None:
            self.zdp.step()
        else:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        if self.zdp is not None:
            return self.zdp.full_parameters()
        return {n: p.full_tensor().detach().clone() for n, p in self.model.named_parameters()}

    def memory(self, device: torch.device) -> dict[str, dict[str, int]]:
        """Bytes at rest right now by place (device / host / disk) and category (params, grads, optim, ...)."""
        host_policy = self.name == "fsdp2_offload"  # FSDP2 keeps sharded params, grads and state on the CPU
        out = {"device": {"params": 0, "grads": 0, "optim": 0}, "host": {}, "disk": {}}
        if self.zdp is not None:
            dev = self.zdp.memory_by_category()
            out["device"] = dict(dev)
        else:
            params = list(self.model.parameters())
            cats = {"params": storage_bytes(params), "grads": storage_bytes([p.grad for p in params]),
                    "optim": storage_bytes(optimizer_state(self.optimizer))}
            place = "host" if host_policy or (device.type != "cpu" and params[0].to_local().device.type == "cpu") \
                else "device"
            out[place] = {**out.get(place, {}), **cats}
            if place == "host":
                out["device"] = {"params": 0, "grads": 0, "optim": 0}
        opt = self.optimizer
        if isinstance(opt, OffloadAdamW):
            out["host"] = {k: v for k, v in opt.host_bytes().items() if v}
        if isinstance(opt, nvme.DiskAdamW):
            out["host"] = {"staging": opt.host_bytes()}
            out["disk"] = {"file": opt.disk_bytes()}
        return out

    def moved_last_step(self) -> dict[str, int]:
        """Bytes moved between places in the last step (host<->device copies, disk reads and writes)."""
        opt = self.optimizer
        if isinstance(opt, OffloadAdamW):
            return dict(opt.moved_per_step[-1])
        if isinstance(opt, nvme.DiskAdamW):
            s = opt.stats[-1]
            out = {"d2h": s["d2h"], "h2d": s["h2d"], "disk_read": s["bytes_read"], "disk_written": s["bytes_written"]}
            if self.params_on_disk is not None:
                out["disk_read_params_fwd_bwd"] = self.params_on_disk.last_step_bytes
            return out
        return {}

    def close(self) -> None:
        if isinstance(self.optimizer, nvme.DiskAdamW):
            self.optimizer.close()


def offload(ctx, cfg: dict) -> dict:
    """Train the same steps with every variant; check, count and time them."""
    group = dist.group.WORLD
    torch.manual_seed(0)
    base = GPT(preset(cfg["model"])).to(ctx.device)
    mc = base.cfg
    data = list(batches(cfg["batch"], mc.seq_len, cfg["steps"], seed=5, rank=ctx.rank, world=ctx.world_size,
                        device=ctx.device))
    names = [v for v in OFFLOAD_VARIANTS if v != "nvme_params" or cfg["stage"] == 3]
    out = {"variants": names, "stage": cfg["stage"], "numel": sum(p.numel() for p in base.parameters()),
           "unit_numels": unit_numels(cfg["model"]), "buffer_count": cfg["buffer_count"],
           "buffer_size": cfg["buffer_size"], "loss": {}, "memory": {},
           "moved": {}, "bitwise_equal_to_zero": {}, "moments_bitwise_equal_to_zero": {}, "peak": {},
           "max_abs_diff_to_zero": {}, "step_time_s": {}, "disk": {}}
    trainers, reference, ref_state = {}, None, None
    for k, name in enumerate(names):
        ctx.progress(k, len(names) + 2, f"offload: {name}")
        tr = _Variant(name, base, cfg["stage"], cfg["nvme_path"], cfg["buffer_count"], cfg["buffer_size"], group)
        losses = []
        with ctx.ledger.tag(f"offload/{name}"):
            for i, (x, y) in enumerate(data[:cfg["steps"]]):
                if i < cfg["steps"] - 1:
                    losses.append(tr.fwd_bwd(x, y))
                    tr.step()
                    continue
                # the last step under the memory tracker: bytes at rest after its backward (optimizer state
                # exists from the first step on), and each category's peak over the whole step
                tracked = tr.zdp if tr.zdp is not None else tr.model
                with MemoryTracker(tracked, tr.optimizer, every_op=False) as mt:
                    register = getattr(tr.optimizer, "register", None)
                    register and register(mt)
                    losses.append(tr.fwd_bwd(x, y))
                    out["memory"][name] = tr.memory(ctx.device)
                    mt.mark("step")
                    tr.step()
            # on a CPU-only machine FSDP2's CPU-offloaded tensors are where its "device" tensors are: the
            # tracker cannot tell them apart, so that variant's peak is left out there
            cpu_blind = name == "fsdp2_offload" and ctx.device.type == "cpu"
            out["peak"][name] = None if cpu_blind else {
                "device_total": mt.peak["total"], "optim_max": mt.max_by_category["optim"],
                "host_max": mt.max_by_category["host"]}
            out["moved"][name] = tr.moved_last_step()
            params = tr.full_parameters()
        out["loss"][name] = losses
        if name == "zero":
            reference = params
            ref_state = [tr.optimizer.state[p] for p in tr.optimizer.param_groups[0]["params"]]
        elif not name.startswith("fsdp2"):
            out["bitwise_equal_to_zero"][name] = _bitwise(params, reference)
            out["moments_bitwise_equal_to_zero"][name] = _moments_equal(tr.optimizer, ref_state)
        out["max_abs_diff_to_zero"][name] = _max_diff(params, reference)
        if name == "fsdp2":
            fsdp_params = params
        if name == "fsdp2_offload":
            out["fsdp2_offload_bitwise_equal_to_fsdp2"] = _bitwise(params, fsdp_params)
            # on a CPU-only machine CPUOffloadPolicy's host is the device: it copies nothing, and the equality
            # above holds by construction; only on CUDA does it test the policy's copies
            out["fsdp2_offload_copies"] = ctx.device.type == "cuda"
        if isinstance(tr.optimizer, nvme.DiskAdamW):
            st = tr.optimizer.stats[-1]
            out["disk"][name] = {**st, "file_bytes": tr.optimizer.disk_bytes(),
                                 "allocated_bytes": tr.optimizer.store.allocated_bytes()}
        trainers[name] = tr
    # step time, all variants side by side (they keep training: the checks above are done)
    it = {name: iter(data * 1000) for name in names}

    def stepper(name):
        tr = trainers[name]

        def fn():
            x, y = next(it[name])
            tr.fwd_bwd(x, y)
            tr.step()
        return fn

    with ctx.ledger.tag("offload/timing"), ctx.part(len(names), len(names) + 2, "offload timing"):
        res = compare({name: stepper(name) for name in names}, warmup=cfg["warmup"], steps=cfg["bench_steps"],
                      rounds=cfg["rounds"], sync=ctx.barrier, on_round=ctx.progress)
    out["step_time_s"] = {name: r.mean_s for name, r in res.items()}
    for name in ("nvme", "nvme_params"):
        if name in trainers:
            s = trainers[name].optimizer.stats[-cfg["bench_steps"]:]
            out["disk"][name]["timed"] = {k: sum(x[k] for x in s) / len(s) for k in
                                          ("wait_read_s", "wait_write_s", "compute_s", "io_seconds")}
    for tr in trainers.values():
        tr.close()
    del trainers
    gc.collect()
    # stream's moments on the device while the step runs (its two slots), as the planner predicts them, and
    # what one AdamW update of the largest shard allocates besides (its temporaries), measured on its own:
    # stream's peak of device optimizer bytes should be exactly their sum
    out["planner_device_step_optim"] = {"stream": offload_memory(out["unit_numels"], ctx.world_size, cfg["stage"],
                                                                 "stream")["device_step_optim"]}
    out["update_temporaries"] = _update_temporaries(max(shard_numels(cfg["model"], ctx.world_size, cfg["stage"])),
                                                    ctx.device)
    out["planner_check"] = validate_offload_model(out["unit_numels"], ctx.world_size, cfg["stage"], out["memory"],
                                                  cfg["buffer_count"], cfg["buffer_size"])
    return out


def _update_temporaries(n: int, device: torch.device) -> int:
    """Peak bytes one in-place AdamW update of ``n`` elements allocates (the tracker's ``optim`` category)."""
    with MemoryTracker(every_op=False) as mt:
        with mt.categorize("param"):  # the operands, counted apart so the update's in-place ops are theirs
            p, g, m, v = (torch.zeros(n, device=device) for _ in range(4))
        with mt.categorize("optim"):
            adamw_(p, g, m, v, 0)
    return mt.max_by_category["optim"]


def _moments_equal(opt, ref_state) -> bool:
    """m and v of every shard, read from wherever the variant keeps them, bitwise those of the in-memory run."""
    for i, ref in enumerate(ref_state):
        if isinstance(opt, OffloadAdamW):
            got = opt.state_of(i)
        else:
            got = opt.read_state(i)
        if not (torch.equal(got["exp_avg"], ref["exp_avg"].cpu()) and torch.equal(got["exp_avg_sq"],
                                                                                  ref["exp_avg_sq"].cpu())):
            return False
    return True


def nvme_buffers(ctx, cfg: dict) -> dict:
    """The disk offload's optimizer step alone (fixed gradients) for each buffer_count x buffer_size."""
    torch.manual_seed(0)
    base = GPT(preset(cfg["model"])).to(ctx.device)
    x, y = next(batches(cfg["batch"], base.cfg.seq_len, 1, seed=6, rank=ctx.rank, world=ctx.world_size,
                        device=ctx.device))
    rows, cands = [], {}
    grid = [(c, s) for c in cfg["sweep_count"] for s in cfg["sweep_size"]]
    opts = {}
    shards = shard_numels(cfg["model"], ctx.world_size, cfg["stage"])
    store = nvme.FileStore(cfg["nvme_path"], nvme.file_bytes(shards, False), "nvme-buffers")  # one file for all
    for c, s in grid:
        z = ZeroDataParallel(copy.deepcopy(base), lambda ps, c=c, s=s: nvme.DiskAdamW(ps, cfg["nvme_path"], c, s,
                                                                                     store=store),
                             stage=cfg["stage"])
        z(x, y).backward()
        if cfg["stage"] == 1:  # ZeRO-1 reduces the gradients to the shards in step(): do that part here
            for u in z.units:
                u.reduce_scatter_grads()
        grads = [p.grad.clone() for p in z.optimizer.params]
        opt = z.optimizer
        opts[(c, s)] = opt

        def step(opt=opt, grads=grads):
            for p, g in zip(opt.params, grads):
                p.grad = g
            opt.step()
        cands[f"{c}x{s}"] = step
    res = compare(cands, warmup=cfg["warmup"], steps=cfg["bench_steps"], rounds=cfg["rounds"], sync=ctx.barrier)
    for (c, s), opt in opts.items():
        st = opt.stats[-cfg["bench_steps"]:]
        mean = {k: sum(x[k] for x in st) / len(st) for k in ("wait_read_s", "wait_write_s", "compute_s", "io_seconds")}
        rows.append({"buffer_count": c, "buffer_size": s, "host_bytes": opt.host_bytes(), "pieces": st[-1]["pieces"],
                     "io_calls": st[-1]["io_calls"], "bytes_read": st[-1]["bytes_read"],
                     "bytes_written": st[-1]["bytes_written"], "step_s": res[f"{c}x{s}"].mean_s, **mean})
    store.close()
    return {"rows": rows, "state_bytes": rows[0]["bytes_read"]}


def spill(ctx, cfg: dict) -> dict:
    """The article's MappedCheckpoint measured; DiskSpill against plain checkpointing on the same batch."""
    torch.manual_seed(0)
    mc = preset(cfg["model"])
    base = apply_checkpointing(GPT(mc), "block").to(ctx.device)
    x, y = next(batches(cfg["batch"], mc.seq_len, 1, seed=7, rank=ctx.rank, world=ctx.world_size, device=ctx.device))
    plain, spilled = copy.deepcopy(base), copy.deepcopy(base)
    params = list(plain.parameters())
    with MemoryTracker(every_op=False) as mt:
        saved, loss = saved_activation_bytes(lambda: plain(x, y), params)
        resident_plain = mt.current()["act"]
        loss.backward()
    sp = DiskSpill(cfg["nvme_path"], saved + ALIGN * 64, device=ctx.device, keep_copies=True)
    try:
        with MemoryTracker(every_op=False) as mt:
            with sp.hooks(list(spilled.parameters())):
                loss2 = spilled(x, y)
            resident_spill = mt.current()["act"]
            written, regions, verified = sp.bytes_written, sp.regions, sp.verify()
            loss2.backward()
        grads_equal = all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), spilled.parameters()))
        out = {"saved_bytes_plain_checkpoint": saved, "spill_bytes_written": written, "spill_regions": regions,
               "spill_bytes_read_back": sp.bytes_read, "file_holds_the_saved_bytes": verified,
               "mapping": "file" if sp.mapping() != "anonymous" else "anonymous",
               "reserved_bytes": sp.capacity, "grads_bitwise_equal_to_checkpoint": grads_equal,
               "resident_after_forward": {"checkpoint": resident_plain, "spill": resident_spill},
               "loss_equal": bool(loss.item() == loss2.item())}
    finally:
        sp.close()
    block = base.blocks[0].inner
    h = torch.randn(cfg["batch"], mc.seq_len, mc.d_model, device=ctx.device, requires_grad=True)
    out["article"] = inspect_article_snippet(cfg["nvme_path"], [h.detach()[0].cpu(), h.detach()[1].cpu() * 3])
    out["article_checkpoint"] = article_custom_checkpoint_saved_bytes(block, h, list(base.parameters()))
    return out


def _variable_batches(cfg: dict, seq_len: int, rank: int, world: int, steps: int, m: int, device):
    """``steps`` x ``m`` micro-batches of unequal length (uniform in [T/4, T], seeded per step, micro-batch
    and rank), so ranks do unequal work per micro-batch, as with variable-length data."""
    g = torch.Generator().manual_seed(11)
    lengths = torch.randint(max(seq_len // 4, 1), seq_len + 1, (steps, m, world), generator=g)
    data = batches(cfg["batch"], seq_len, steps * m, seed=12, rank=rank, world=world)
    out = []
    for s in range(steps):
        row = []
        for i in range(m):
            x, y = next(data)
            n = int(lengths[s, i, rank])
            row.append((x[:, :n].to(device), y[:, :n].to(device)))
        out.append(row)
    return out


def side_channel(ctx, cfg: dict) -> dict:
    """Gradient accumulation over ``m`` variable-length micro-batches; each micro-batch's top-k predictions go
    to rank 0, by a blocking all_gather right after its forward, or posted on a side channel."""
    torch.manual_seed(0)
    mc = preset(cfg["model"])
    model = GPT(mc).to(ctx.device)
    opt = adamw(list(model.parameters()))
    steps, m, k = cfg["steps"] + 1, cfg["m"], cfg["topk"]
    data = _variable_batches(cfg, mc.seq_len, ctx.rank, ctx.world_size, steps * 2, m, ctx.device)
    channel = SideChannel(dst=0)
    ctx.ledger.name_group(channel.group, "side")
    seq = mc.seq_len
    received = {}

    def topk(logits):  # [B, n, V] -> [B, seq, k] int64, padded to the full length with -1
        idx = logits.detach().topk(k, dim=-1).indices
        out = torch.full((logits.shape[0], seq, k), -1, dtype=torch.int64, device=logits.device)
        out[:, :idx.shape[1]] = idx
        return out

    def train_step(s: int, mode: str, record: bool):
        for i, (x, y) in enumerate(data[s]):
            with ctx.timeline.span("F", mb=i, mode=mode, step=s) if record else _null():
                logits = model(x)
                loss = lm_loss(logits, y)
            with ctx.timeline.span("collect" if mode == "blocking" else "post", mb=i, mode=mode, step=s) \
                    if record else _null():
                if mode == "blocking":
                    got = blocking_gather(topk(logits))
                    if ctx.rank == 0:
                        received[(mode, s, i)] = got
                else:
                    channel.post(topk(logits), label=(mode, s, i))
            with ctx.timeline.span("B", mb=i, mode=mode, step=s) if record else _null():
                (loss / m).backward()
            if i == m - 1:  # data parallel: average the accumulated gradients once per step; a blocking
                # collective, so a rank that finished its micro-batches early waits here for the slowest
                with ctx.timeline.span("allreduce", mode=mode, step=s) if record else _null():
                    for p in model.parameters():
                        dist.all_reduce(p.grad)
                        p.grad.div_(ctx.world_size)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if mode == "side":  # the previous side step's values: arrived long ago, nobody waits for this step's
            with ctx.timeline.span("wait", mode=mode, step=s) if record else _null():
                got = channel.collect(leave=m)
            received.update(got)

    times = {"blocking": [], "side": []}
    ctx.barrier()
    for s in range(steps * 2):  # alternate, so both see the same machine load; the first of each is a warm-up
        mode = ("blocking", "side")[s % 2]
        ctx.barrier()
        t0 = time.perf_counter()
        train_step(s, mode, record=s >= 2)
        times[mode].append(time.perf_counter() - t0)
    spans = [sp for sp in ctx.timeline.to_json() if sp["meta"].get("mode") in ("blocking", "side")]
    # the training thread's time in communication: collecting the values (blocking: the all_gather; side: post
    # and the end-of-step collect) and the gradient all-reduce, where waiting for the slowest rank ends up
    # when the values no longer synchronise the ranks per micro-batch
    parts = {mode: {kind: sum(s["end"] - s["start"] for s in spans if s["meta"]["mode"] == mode and s["kind"] == kind)
                    for kind in (("collect",) if mode == "blocking" else ("post", "wait")) + ("allreduce",)}
             for mode in ("blocking", "side")}
    exposed = {mode: sum(p.values()) for mode, p in parts.items()}
    n_steps = {mode: len(v) - 1 for mode, v in times.items()}
    received.update(channel.collect())
    complete = None
    if ctx.rank == 0:
        complete = all(len(v) == ctx.world_size and v[0].shape == (cfg["batch"], seq, k) for v in received.values())
    channel.close()
    return {"step_s": {mode: sum(v[1:]) / max(len(v) - 1, 1) for mode, v in times.items()},
            "exposed_collect_s_per_step": {mode: (exposed[mode] - parts[mode]["allreduce"]) / max(n_steps[mode], 1)
                                           for mode in exposed},
            "exposed_comm_s_per_step": {mode: exposed[mode] / max(n_steps[mode], 1) for mode in exposed},
            "allreduce_s_per_step": {mode: parts[mode]["allreduce"] / max(n_steps[mode], 1) for mode in exposed},
            "spans": spans, "received_values": len(received) if ctx.rank == 0 else None,
            "all_received_complete": complete, "payload_bytes": cfg["batch"] * seq * k * 8,
            "side_bytes_posted": channel.bytes_posted, "micro_batch_lengths": [[x.shape[1] for x, _ in row]
                                                                               for row in data]}


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def buckets(ctx, cfg: dict) -> dict:
    """DDP with each bucket size, on the emulated link (scaled to the measured backward time) and the real one."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    mc = preset(cfg["model"], n_layer=cfg["bucket_layers"])
    base = GPT(mc).to(ctx.device)
    data = list(batches(cfg["batch"], mc.seq_len, 4, seed=9, rank=ctx.rank, world=ctx.world_size, device=ctx.device))
    grad_bytes = sum(p.numel() * p.element_size() for p in base.parameters())
    n = ctx.world_size
    ids = None if ctx.device.type == "cpu" else [ctx.device.index]

    def make(cap_mb: float, emulator: LinkEmulator):
        model = DDP(copy.deepcopy(base), device_ids=ids, bucket_cap_mb=cap_mb, gradient_as_bucket_view=True)
        model.register_comm_hook(None, emulator.hook)
        return model

    # calibrate: backward time without any communication (no_sync), median of a few
    local = make(25.0, LinkEmulator())
    bwd = []
    for i in range(5):
        x, y = data[i % len(data)]
        loss = local(x, y)
        with local.no_sync():
            t0 = time.perf_counter()
            loss.backward()
            bwd.append(time.perf_counter() - t0)
        local.zero_grad(set_to_none=True)
    backward_s = sorted(bwd)[len(bwd) // 2]
    t = torch.tensor([backward_s])
    dist.all_reduce(t)  # the same link on every rank
    backward_s = t.item() / n
    alpha = cfg["latency_ratio"] * backward_s
    beta = 2 * (n - 1) / n * grad_bytes / (cfg["comm_ratio"] * backward_s)
    out = {"grad_bytes": grad_bytes, "n_tensors": len(list(base.parameters())), "backward_s": backward_s,
           "alpha_s": alpha, "beta_bytes_per_s": beta, "links": {}}
    links = {"emulated": (alpha, beta), "real": (0.0, float("inf"))}
    for link in cfg["links"]:
        a, b = links[link]
        emus = {cap: LinkEmulator(a, b) for cap in cfg["bucket_mb"]}
        models = {cap: make(cap, emus[cap]) for cap in cfg["bucket_mb"]}
        for model in models.values():  # DDP rebuilds its buckets after the first step: do it before timing
            for x, y in data[:2]:
                model(x, y).backward()
                model.zero_grad(set_to_none=True)
        exposed = {cap: [] for cap in models}
        it = {cap: iter(data * 1000) for cap in models}
        last_spans = {}

        def stepper(cap):
            model, emu = models[cap], emus[cap]

            def fn():
                x, y = next(it[cap])
                emu.reset()
                loss = model(x, y)
                loss.backward()
                done = time.perf_counter()
                model.zero_grad(set_to_none=True)
                last_ready = max(s["ready"] for s in emu.spans)
                exposed[cap].append(done - last_ready)
                last_spans[cap] = [dict(s) for s in emu.spans] + [{"backward_done": done}]
            return fn

        with ctx.ledger.tag(f"buckets/{link}"):
            res = compare({cap: stepper(cap) for cap in models}, warmup=cfg["warmup"], steps=cfg["bench_steps"],
                          rounds=cfg["rounds"], sync=ctx.barrier)
        rows = []
        for cap in models:
            spans = last_spans[cap]
            timed = exposed[cap][cfg["warmup"]:]
            rows.append({"bucket_mb": cap, "buckets": len(spans) - 1,
                         "bucket_bytes": [s["bytes"] for s in spans[:-1]], "step_s": res[cap].mean_s,
                         "exposed_comm_s": sorted(timed)[len(timed) // 2],
                         "simulated_exposed_s": steady_exposed([s["bytes"] for s in spans[:-1]], backward_s,
                                                               n, a, b) if link == "emulated" else 0.0,
                         "spans": _relative(spans, ctx.timeline.origin)})
        out["links"][link] = rows
        del models
        gc.collect()
    del local
    gc.collect()
    return out


def _relative(spans: list[dict], origin: float) -> list[dict]:
    out = []
    for s in spans:
        out.append({k: (v - origin if k in ("ready", "start", "end", "backward_done") else v) for k, v in s.items()})
    return out


def run(ctx, cfg: dict) -> dict:
    out = {"rank": ctx.rank, "world_size": ctx.world_size, "model": vars(preset(cfg["model"])),
           "device": ctx.device.type}
    steps = {"offload": offload, "nvme_buffers": nvme_buffers, "spill": spill, "side_channel": side_channel,
             "buckets": buckets}
    out["section_cpu_s"], out["section_wall_s"] = {}, {}
    for name in cfg["sections"]:
        ctx.phase(name)
        cpu, wall = time.process_time(), time.perf_counter()
        with ctx.ledger.tag(name):
            out[name] = steps[name](ctx, cfg)
        out["section_cpu_s"][name] = time.process_time() - cpu  # this rank's CPU time (all its threads)
        out["section_wall_s"][name] = time.perf_counter() - wall
    return out
