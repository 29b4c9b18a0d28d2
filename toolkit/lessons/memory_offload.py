"""Lesson 00b's memory sections, per rank (``l00b_memory``'s docstring says what each one measures)::

    offload       one training run per place of the optimizer state: ZeRO with AdamW on the device, in host
                  memory (cpu, stream) or on disk (nvme, nvme_params), FSDP2 with and without CPU offload;
                  each variant is a ``DataParallelTrainer`` (``toolkit.parallel.trainer``) with its optimizer;
                  on an emulated cluster also the step of each ZeRO variant with its copies on the host link
                  and its reads and writes on the disk, at the toy's shapes and matched to ``stands_for``,
                  beside ``planner.offload_time`` (the closed form)
    nvme_buffers  the disk offload's optimizer step alone, over a grid of staging buffer counts and sizes
    spill         the saved tensors of checkpointed segments in a file-backed mapping (``DiskSpill``)

Each takes ``(ctx, cfg)`` with ``l00b_memory``'s resolved cfg.
"""
from __future__ import annotations

import copy
import gc

import torch
import torch.distributed as dist
import torch.nn as nn

from toolkit.data import batches
from toolkit.memory import nvme
from toolkit.memory.checkpointing import apply_checkpointing
from toolkit.runtime.memory import saved_activation_bytes
from toolkit.memory.optim_offload import OffloadAdamW, adamw_
from toolkit.memory.spill import ALIGN, DiskSpill, article_custom_checkpoint_saved_bytes, inspect_article_snippet
from toolkit.models import GPT, preset
from toolkit.parallel.trainer import DataParallelTrainer
from toolkit.parallel.zero import ZeroDataParallel, adamw, default_units
from toolkit import planner
from toolkit.models import catalog, matched
from toolkit.planner import offload_memory, validate_offload_model
from toolkit.runtime.bench import compare, replayed, verdict
from toolkit.runtime.memory import MemoryTracker

OFFLOAD_VARIANTS = ("zero", "cpu", "stream", "nvme", "nvme_params", "fsdp2", "fsdp2_offload")
EMULATED_VARIANTS = ("zero", "cpu", "stream", "nvme", "nvme_params")
"""The variants whose copies and disk I/O the emulated cluster times (FSDP2's CPUOffloadPolicy copies nothing on
a CPU-only machine, so its emulated step would leave them out)."""
CLOSED_FORM = {"cpu": "cpu", "nvme": "nvme"}
"""Variant -> ``planner.offload_time``'s option for it (stream and parameters on disk have no closed form there)."""
LOCAL_LINKS = ("d2h", "h2d", "disk")


def unit_numels(model_name: str) -> list[int]:
    """Parameters of each ZeRO unit (embedding, blocks, head) of the preset's GPT (built on the meta device)."""
    with torch.device("meta"):
        model = GPT(preset(model_name))
    return [sum(p.numel() for p in u.parameters()) for u in default_units(model)]


def shard_numels(model_name: str, world_size: int) -> list[int]:
    """Elements of each ZeRO unit's shard on one rank (padded to a multiple of the ranks, as ZeroDataParallel)."""
    return [-(-u // world_size) for u in unit_numels(model_name)]


def _bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[k], b[k]) for k in b)


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in b)


def _trainer(name: str, base: nn.Module, cfg: dict, group) -> DataParallelTrainer:
    """The data-parallel trainer of offload variant ``name``: FSDP2 (with ``CPUOffloadPolicy`` for
    "fsdp2_offload"), or the toolkit's ZeRO at ``stage`` with the AdamW state in memory ("zero"), in host memory
    ("cpu", "stream") or on disk ("nvme", "nvme_params")."""
    if name.startswith("fsdp2"):
        return DataParallelTrainer("fsdp2", base, group, cpu_offload=name == "fsdp2_offload")
    directory, count, size = cfg["nvme_path"], cfg["buffer_count"], cfg["buffer_size"]
    optimizer = {"zero": adamw, "cpu": lambda ps: OffloadAdamW(ps, mode="cpu"),
                 "stream": lambda ps: OffloadAdamW(ps, mode="stream"),
                 "nvme": lambda ps: nvme.DiskAdamW(ps, directory, count, size),
                 "nvme_params": lambda ps: nvme.DiskAdamW(ps, directory, count, size, offload_params=True)}[name]
    return DataParallelTrainer("zero", base, group, optimizer=optimizer, stage=cfg["stage"])


def _memory_by_place(tr: DataParallelTrainer, device: torch.device) -> dict[str, dict[str, int]]:
    """Bytes at rest right now by place (device / host / disk) and category (params, grads, optim, ...)."""
    out = {"device": {"params": 0, "grads": 0, "optim": 0}, "host": {}, "disk": {}}
    if tr.zero is not None:
        out["device"] = dict(tr.memory())
    else:  # FSDP2 with CPUOffloadPolicy keeps sharded params, grads and state on the CPU
        on_host = tr.cpu_offload or (device.type != "cpu" and next(tr.model.parameters()).to_local().device.type == "cpu")
        out["host" if on_host else "device"] = tr.memory()
    opt = tr.optimizer
    if isinstance(opt, OffloadAdamW):
        out["host"] = {k: v for k, v in opt.host_bytes().items() if v}
    if isinstance(opt, nvme.DiskAdamW):
        out["host"] = {"staging": opt.host_bytes()}
        out["disk"] = {"file": opt.disk_bytes()}
    return out


def _moved_last_step(opt, params_on_disk: nvme.DiskParams | None) -> dict[str, int]:
    """Bytes moved between places in the last step (host<->device copies, disk reads and writes)."""
    if isinstance(opt, OffloadAdamW):
        return dict(opt.moved_per_step[-1])
    if isinstance(opt, nvme.DiskAdamW):
        s = opt.stats[-1]
        out = {"d2h": s["d2h"], "h2d": s["h2d"], "disk_read": s["bytes_read"], "disk_written": s["bytes_written"]}
        if params_on_disk is not None:
            out["disk_read_params_fwd_bwd"] = params_on_disk.last_step_bytes
        return out
    return {}


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
        tr = _trainer(name, base, cfg, group)
        on_disk = nvme.DiskParams(tr.zero, tr.optimizer) if name == "nvme_params" else None
        losses = []
        with ctx.ledger.tag(f"offload/{name}"):
            for i, (x, y) in enumerate(data[:cfg["steps"]]):
                if i < cfg["steps"] - 1:
                    losses.append(tr.fwd_bwd(x, y))
                    tr.step()
                    continue
                # the last step under the memory tracker: bytes at rest after its backward (optimizer state
                # exists from the first step on), and each category's peak over the whole step
                with MemoryTracker(tr.model, tr.optimizer, every_op=False) as mt:
                    register = getattr(tr.optimizer, "register", None)
                    register and register(mt)
                    losses.append(tr.fwd_bwd(x, y))
                    out["memory"][name] = _memory_by_place(tr, ctx.device)
                    mt.mark("step")
                    tr.step()
            # on a CPU-only machine FSDP2's CPU-offloaded tensors are where its "device" tensors are: the
            # tracker cannot tell them apart, so that variant's peak is left out there
            cpu_blind = name == "fsdp2_offload" and ctx.device.type == "cpu"
            out["peak"][name] = None if cpu_blind else {
                "device_total": mt.peak["total"], "optim_max": mt.max_by_category["optim"],
                "host_max": mt.max_by_category["host"]}
            out["moved"][name] = _moved_last_step(tr.optimizer, on_disk)
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
    emu = ctx.emulator
    last: dict[str, dict] = {}  # emulated: each variant's last step on the virtual clock

    def stepper(name):
        tr = trainers[name]

        def fn():
            x, y = next(it[name])
            first, t0 = (len(emu.comms), emu.now()) if emu is not None else (0, 0.0)
            tr.fwd_bwd(x, y)
            t1 = emu.now() if emu is not None else 0.0
            tr.step()
            if emu is not None:
                last[name] = {"fwd_bwd_s": t1 - t0, "step_s": emu.now() - t1, "start": t0, "optimizer_start": t1,
                              "transfers": [c for c in emu.comms[first:] if c["link"] in LOCAL_LINKS]}
        return fn

    # wall time only, without the emulator's bookkeeping on every op: the virtual clock is deterministic, so
    # _emulated() times one more step of each variant on it
    with ctx.ledger.tag("offload/timing"), ctx.part(len(names), len(names) + 2, "offload timing"), ctx.paused():
        res = compare({name: stepper(name) for name in names}, warmup=cfg["warmup"], steps=cfg["bench_steps"],
                      rounds=cfg["rounds"], sync=ctx.barrier, on_round=ctx.progress)
    out["step_time_s"] = {name: r.mean_s for name, r in res.items()}
    for name in ("nvme", "nvme_params"):  # the timed steps' disk statistics, before _emulated() adds steps
        if name in trainers:
            s = trainers[name].optimizer.stats[-cfg["bench_steps"]:]
            out["disk"][name]["timed"] = {k: sum(x[k] for x in s) / len(s) for k in
                                          ("wait_read_s", "wait_write_s", "compute_s", "io_seconds")}
    out["emulated"] = None if emu is None else _emulated(ctx, cfg, out, trainers, stepper, last)
    for tr in trainers.values():
        if isinstance(tr.optimizer, nvme.DiskAdamW):
            tr.optimizer.close()
    trainers.clear()  # the variants and their state freed before the memory probes below
    gc.collect()
    # stream's moments on the device while the step runs (its two slots), as the planner predicts them, and
    # what one AdamW update of the largest shard allocates besides (its temporaries), measured on its own:
    # stream's peak of device optimizer bytes should be exactly their sum
    out["planner_device_step_optim"] = {"stream": offload_memory(out["unit_numels"], ctx.world_size, cfg["stage"],
                                                                 "stream")["device_step_optim"]}
    out["update_temporaries"] = _update_temporaries(max(shard_numels(cfg["model"], ctx.world_size)),
                                                    ctx.device)
    out["planner_check"] = validate_offload_model(out["unit_numels"], ctx.world_size, cfg["stage"], out["memory"],
                                                  cfg["buffer_count"], cfg["buffer_size"])
    return out


def _traffic(transfers: list[dict], optimizer_start: float) -> dict[str, dict]:
    """One step's copies and disk I/O by kind (``d2h``, ``h2d``, ``read``, ``write``): calls, bytes on the target,
    seconds on the link or drive, and the seconds of it before the optimizer step began (under forward and
    backward)."""
    out: dict[str, dict] = {}
    for t in transfers:
        row = out.setdefault(t["op"], {"calls": 0, "bytes": 0.0, "busy_s": 0.0, "before_step_s": 0.0})
        row["calls"] += 1
        row["bytes"] += t["bytes"]
        row["busy_s"] += t["local_end"] - t["start"]
        row["before_step_s"] += max(0.0, min(t["local_end"], optimizer_start) - t["start"])
    return out


def _optimizer_vstats(opt) -> dict | None:
    """The optimizer's last step on the virtual clock (``OffloadAdamW.vstats``, ``DiskAdamW``'s ``v*`` stats)."""
    if isinstance(opt, OffloadAdamW):
        return dict(opt.vstats[-1])
    if isinstance(opt, nvme.DiskAdamW):
        return {k[1:]: v for k, v in opt.stats[-1].items() if k.startswith("v")}
    return None


def _emulated(ctx, cfg: dict, out: dict, trainers: dict, stepper, last: dict) -> dict:
    """The ZeRO variants on the emulated cluster's clock: their steps (forward + backward, optimizer), the copies
    and disk I/O of one step, at the toy's shapes and matched to ``cfg["stands_for"]``'s gradient and backward
    (one step each, after the timed ones: the virtual clock is deterministic), each beside
    ``planner.offload_time`` for the same workload, cluster, data parallelism and ZeRO stage."""
    ctx.reserve_for_replay()  # the bar's last quarter: the run replayed on other figures
    emu, n, hw = ctx.emulator, ctx.world_size, ctx.emulator.cluster
    names = [v for v in EMULATED_VARIANTS if v in trainers]
    real = catalog.get(cfg["stands_for"])
    tokens = cfg["batch"] * preset(cfg["model"]).seq_len
    toy = planner.Workload(params=out["numel"])
    scales = matched.matched_scales(matched.dp_grad_op(out["numel"], tokens, hw.float_bytes),
                                    matched.dp_grad_op(real.params(), real.seq_len, hw.float_bytes))

    def view(bench: dict, workload: planner.Workload) -> dict:
        base = bench["zero"]
        rows = {}
        for name in names:
            step = last[name]
            rows[name] = {"step_s": bench[name].mean_s, "fwd_bwd_s": step["fwd_bwd_s"], "optimizer_s": step["step_s"],
                          "extra_s": bench[name].mean_s - base.mean_s,
                          "verdict": verdict(base, bench[name]).to_dict() if name != "zero" else None,
                          "optimizer": _optimizer_vstats(trainers[name].optimizer),
                          "traffic": _traffic(step["transfers"], step["optimizer_start"]),
                          "closed_form_s": (planner.offload_time(workload, n, 1, 1, cfg["stage"], CLOSED_FORM[name], hw)
                                            if name in CLOSED_FORM else None)}
        return rows

    def one_step_each(label: str) -> dict:
        """Each variant's step on the virtual clock, started from clocks a barrier aligned (compare's sync):
        deterministic, so one stands for every round."""
        return compare({name: stepper(name) for name in names}, warmup=0, steps=1, rounds=1, sync=ctx.barrier,
                       clock="virtual", label=label)

    with ctx.ledger.tag("offload/toy"):
        toy_bench = one_step_each("offload toy")
    E = {"cluster": hw.name, "gpu": hw.gpu.name, "cpu": hw.cpu.name, "float_bytes": hw.float_bytes,
         "host_link": {"name": hw.host.name, "bytes_per_s": hw.host.bytes_per_s, "latency_s": hw.host.latency_s},
         "disk": {"name": hw.disk.name, "read_bytes_per_s": hw.disk.read_bytes_per_s,
                  "write_bytes_per_s": hw.disk.write_bytes_per_s, "latency_s": hw.disk.latency_s},
         "cpu_adam_bytes_per_s": planner.Assumptions().cpu_adam_bytes_per_s,
         "toy": {"params": out["numel"], "tokens": tokens,
                 "rows": view(toy_bench, toy)}}
    with emu.scaled(**scales), ctx.ledger.tag("offload/matched"):
        bench = one_step_each("offload matched")
    E["matched"] = {"stands_for": cfg["stands_for"], "scales": scales, "params": real.params(),
                    "tokens": real.seq_len, "rows": view(bench, planner.Workload(real))}
    E["sensitivity"] = ctx.replay(lambda clocks: {name: replayed(clocks, f"offload matched/{name}") for name in names})
    return E


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
    shards = shard_numels(cfg["model"], ctx.world_size)
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
    with ctx.paused():  # wall time only: the emulated cluster's drive times one more step of each below
        res = compare(cands, warmup=cfg["warmup"], steps=cfg["bench_steps"], rounds=cfg["rounds"], sync=ctx.barrier)
    timed = {key: opt.stats[-cfg["bench_steps"]:] for key, opt in opts.items()}
    virtual = None if ctx.emulator is None else compare(cands, warmup=0, steps=1, rounds=1, sync=ctx.barrier,
                                                         clock="virtual")  # deterministic: one step each
    for (c, s), opt in opts.items():
        st = timed[(c, s)]
        mean = {k: sum(x[k] for x in st) / len(st) for k in ("wait_read_s", "wait_write_s", "compute_s", "io_seconds")}
        rows.append({"buffer_count": c, "buffer_size": s, "host_bytes": opt.host_bytes(), "pieces": st[-1]["pieces"],
                     "io_calls": st[-1]["io_calls"], "bytes_read": st[-1]["bytes_read"],
                     "bytes_written": st[-1]["bytes_written"], "step_s": res[f"{c}x{s}"].mean_s, **mean,
                     "vstep_s": virtual[f"{c}x{s}"].mean_s if virtual is not None else None,
                     **{k: opt.stats[-1][k] for k in ("vread_wait_s", "vwrite_wait_s") if k in opt.stats[-1]}})
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
