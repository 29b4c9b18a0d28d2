"""GPU check of lesson 00b's CUDA paths, on one GPU (a one-rank process group):

- ``OffloadAdamW("stream")``: moments in pinned host memory, copied on a side stream; update on the device:
  bitwise equal to the device AdamW; no optimizer bytes on the device between steps.
- ``OffloadAdamW("cpu")``: update on the host's processor: how far (if at all) from the device AdamW.
- ``DiskAdamW`` (host update, pinned staging): bitwise equal to ``cpu`` mode (same host arithmetic);
  with ``DiskParams`` (ZeRO-3 shards on disk, read back and copied up for each all-gather) bitwise equal
  to ``DiskAdamW`` alone.
- ``DiskSpill``: a checkpointed model's saved tensors leave the device for the file and come back: grads
  bitwise equal to plain checkpointing, bytes written = saved bytes, device memory after forward lower.
- ``SideChannel``: a CUDA tensor posted from a side stream arrives intact.
- FSDP2 ``CPUOffloadPolicy``: sharded parameters on the CPU, results vs FSDP2 without offload.

``check()`` returns rows ``{"check", "ok", "value"}``; it assumes CUDA is available.
"""
from __future__ import annotations

import copy
import os
import socket
import tempfile

import torch
import torch.distributed as dist

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS (read when cuBLAS starts)


def _init_one_rank() -> None:
    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))


def _train(factory, stage: int = 3, disk_params: bool = False, steps: int = 3):
    from toolkit.data import batches
    from toolkit.memory.nvme import DiskParams
    from toolkit.models import GPT, preset
    from toolkit.parallel.zero import ZeroDataParallel
    torch.manual_seed(0)
    model = GPT(preset("smoke")).cuda()
    zdp = ZeroDataParallel(model, factory, stage=stage)
    if disk_params:
        DiskParams(zdp, zdp.optimizer)
    for x, y in batches(2, 32, steps, seed=1, device="cuda"):
        zdp(x, y).backward()
        zdp.step()
    torch.cuda.synchronize()
    return zdp.full_parameters(), zdp


def _diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _equal(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def check() -> list[dict]:
    from toolkit.memory.nvme import DiskAdamW
    from toolkit.memory.optim_offload import OffloadAdamW
    from toolkit.parallel.zero import adamw
    _init_one_rank()
    torch.use_deterministic_algorithms(True)  # embedding backward without atomics: runs compare bitwise
    rows = []
    tmp = tempfile.mkdtemp(prefix="gpu-check-00b-")
    try:
        ref, _ = _train(adamw)
        again, _ = _train(adamw)
        rows.append({"check": "00b: the device AdamW run repeats bitwise", "ok": _equal(again, ref),
                     "value": "deterministic algorithms on"})
        got, z = _train(lambda ps: OffloadAdamW(ps, mode="stream"))
        pinned = all(t.is_pinned() for st in z.optimizer.host for t in st.values())
        rows.append({"check": "00b: stream offload bitwise equal to device AdamW, host state pinned",
                     "ok": _equal(got, ref) and pinned and z.memory_by_category()["optim"] == 0,
                     "value": f"max |diff| {_diff(got, ref):.2e}, pinned {pinned}, moved/step "
                              f"{z.optimizer.moved_per_step[-1]}"})
        cpu, z = _train(lambda ps: OffloadAdamW(ps, mode="cpu"))
        rows.append({"check": "00b: cpu offload (host update) vs device AdamW", "ok": _diff(cpu, ref) < 1e-5,
                     "value": "bitwise" if _equal(cpu, ref) else f"max |diff| {_diff(cpu, ref):.2e} (host vs device "
                                                                  "kernels' last bits)"})
        disk, z = _train(lambda ps: DiskAdamW(ps, tmp, 2, 2048))
        rows.append({"check": "00b: NVMe offload (host update, pinned staging) bitwise equal to cpu offload",
                     "ok": _equal(disk, cpu) and all(b.is_pinned() for b in z.optimizer.buffers),
                     "value": f"max |diff| {_diff(disk, cpu):.2e}, stats {z.optimizer.stats[-1]}"})
        z.optimizer.close()
        dparams, z = _train(lambda ps: DiskAdamW(ps, tmp, 3, 1024, offload_params=True), disk_params=True)
        rows.append({"check": "00b: NVMe params (ZeRO-3 shards on disk) bitwise equal to NVMe optimizer only",
                     "ok": _equal(dparams, disk) and z.memory_by_category()["params"] == 0,
                     "value": f"params read in fwd+bwd {z.optimizer.params_on_disk.last_step_bytes} B"})
        z.optimizer.close()
        rows += _spill(tmp)
        rows += _side_channel()
        rows += _fsdp2_offload()
    finally:
        torch.use_deterministic_algorithms(False)
        for f in os.listdir(tmp):
            os.unlink(os.path.join(tmp, f))
        os.rmdir(tmp)
    return rows


def _spill(tmp: str) -> list[dict]:
    from toolkit.memory.checkpointing import apply_checkpointing
    from toolkit.runtime.memory import saved_activation_bytes
    from toolkit.memory.spill import ALIGN, DiskSpill
    from toolkit.models import GPT, preset
    torch.manual_seed(0)
    base = apply_checkpointing(GPT(preset("default")), "block").cuda()
    x = torch.randint(0, 256, (4, 128), device="cuda")
    plain, spilled = copy.deepcopy(base), copy.deepcopy(base)
    saved, loss = saved_activation_bytes(lambda: plain(x, x), list(plain.parameters()))
    loss.backward()
    torch.cuda.synchronize()
    sp = DiskSpill(tmp, saved + 64 * ALIGN, device="cuda")
    before = torch.cuda.memory_allocated()
    with sp.hooks(list(spilled.parameters())):
        loss2 = spilled(x, x)
    after_spill = torch.cuda.memory_allocated() - before
    loss2.backward()
    torch.cuda.synchronize()
    same = all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), spilled.parameters()))
    sp.close()
    return [{"check": "00b: activation spill on CUDA: grads bitwise, bytes written = saved bytes",
             "ok": same and sp.bytes_written == saved,
             "value": f"saved {saved:,} B, written {sp.bytes_written:,} B, device bytes after forward {after_spill:,}"}]


def _side_channel() -> list[dict]:
    from toolkit.comm.side_channel import SideChannel
    ch = SideChannel(dst=0)
    t = torch.arange(1000, device="cuda")
    ch.post(t, label="a")
    t.zero_()  # the channel copied it first
    got = ch.collect()
    ch.close()
    ok = torch.equal(got["a"][0], torch.arange(1000)) and got["a"][0].is_pinned()
    return [{"check": "00b: side channel posts a CUDA tensor from a side stream (pinned copy)", "ok": ok,
             "value": str(got["a"][0][:4].tolist())}]


def _fsdp2_offload() -> list[dict]:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    from toolkit.data import batches
    from toolkit.models import GPT, preset
    from toolkit.parallel.zero import adamw, default_units

    def train(policy):
        torch.manual_seed(0)
        model = GPT(preset("smoke")).cuda()
        mesh = DeviceMesh.from_group(dist.group.WORLD, "cuda")
        kw = {"offload_policy": policy} if policy is not None else {}
        for u in default_units(model):
            fully_shard(u, mesh=mesh, **kw)
        fully_shard(model, mesh=mesh, **kw)
        opt = adamw(list(model.parameters()))
        for x, y in batches(2, 32, 3, seed=1, device="cuda"):
            model(x, y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        return {n: p.full_tensor().detach().cpu() for n, p in model.named_parameters()}, model

    ref, _ = train(None)
    got, model = train(CPUOffloadPolicy(pin_memory=True))
    where = {p.to_local().device.type for p in model.parameters()}
    return [{"check": "00b: FSDP2 CPUOffloadPolicy keeps shards on the CPU; vs FSDP2 on the device",
             "ok": where == {"cpu"} and _diff(got, ref) < 1e-5,
             "value": ("bitwise" if _equal(got, ref) else f"max |diff| {_diff(got, ref):.2e} (CPU AdamW vs CUDA)")
             + f", shards on {where}"}]


if __name__ == "__main__":
    for row in check():
        print(("ok  " if row["ok"] else "FAIL"), row["check"], "|", row["value"])
