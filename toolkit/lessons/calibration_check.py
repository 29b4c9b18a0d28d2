"""The emulated cluster timed against published measurements, end to end (``tests/test_calibration.py``).

Real processes run the ops nccl-tests and a cuBLAS benchmark ran; the emulator's clock times them; the test puts
each time beside the published row of the same setting. The payloads are small tensors that ``scaled(bytes=)``
times as the published sizes (gloo moves the small ones; the clock counts the large ones)::

    all_reduce sizes of a published sweep    barrier ─► t0 ─► all_reduce (scaled) ─► t1     busbw = wire / (t1 − t0)
    GEMM shapes of a published sweep          barrier ─► t0 ─► torch.mm x 3 (eager)  ─► t1    the third one's time
"""
from __future__ import annotations

import torch
import torch.distributed as dist

PARAMS_NOTE = "cfg: sizes (bytes of each all_reduce), gemms ([m, n, k] each)"


def run(ctx, cfg: dict) -> dict:
    emu = ctx.emulator
    if emu is None:
        raise ValueError("the calibration check needs an emulated cluster: launch(..., cluster=...)")
    out = {"all_reduce": [], "gemm": []}
    small = torch.ones(256)  # 1 KiB of fp32; scaled to each size (bf16 on the target: 2 bytes an element)
    for size in cfg.get("sizes", []):
        ctx.barrier()
        t0 = emu.now()
        with emu.scaled(bytes=size / (small.numel() * emu.cluster.float_bytes)):
            dist.all_reduce(small)
        out["all_reduce"].append({"bytes": size, "virtual_s": emu.now() - t0})
    for m, n, k in cfg.get("gemms", []) if ctx.rank == 0 else []:
        a, b = torch.randn(m, k), torch.randn(k, n)
        emu.synchronize()  # a benchmark synchronizes before it times: the host starts with the stream
        ctx_times = []
        for _ in range(3):  # back to back, as a benchmark loop issues them: the host runs ahead
            t0 = emu.now()
            torch.mm(a, b)
            ctx_times.append(emu.now() - t0)
        emu.synchronize()
        out["gemm"].append({"m": m, "n": n, "k": k, "virtual_s": ctx_times[-1]})
    return out
