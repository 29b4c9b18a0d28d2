"""GPU check of toolkit.moe: the dispatcher, its codecs (Triton quantization on CUDA) and the DeepEP-style
low-latency buffers on CUDA tensors over nccl (one rank): wire rows bitwise equal to the CPU reference, round
trips exact (no codec) or within 5% relative error (quantized dispatch, bf16 combine).

``check()`` assumes CUDA is available; run it through ``benchmarks/gpu_check.sh`` or
``python benchmarks/gpu/moe_dispatch.py``.
"""
from __future__ import annotations

import socket

import torch
import torch.distributed as dist


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check() -> list[dict]:
    from toolkit.moe import Codec, TokenDispatcher, run_experts
    from toolkit.moe.deepep import LowLatency

    own = not dist.is_initialized()
    if own:
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1,
                                device_id=torch.device("cuda", 0))
    rows = []
    try:
        T, H, E, K = 256, 1024, 8, 2
        g = torch.Generator().manual_seed(0)
        x = torch.randn(T, H, generator=g).bfloat16().float()
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
        w = torch.full((T, K), 1.0 / K)
        for mode in ("none", "bf16", "int8", "fp8"):
            codec = Codec(mode, 128)
            wire_cpu, wire_gpu = codec.encode(x), codec.encode(x.cuda())
            rows.append({"check": f"codec {mode}: CUDA wire rows == CPU wire rows (bitwise)",
                         "ok": torch.equal(wire_gpu.cpu(), wire_cpu), "value": f"{tuple(wire_gpu.shape)}"})
            for dedup in (False, True):
                disp = TokenDispatcher(E, K, codec=codec, combine_codec="bf16" if mode != "none" else "none",
                                       dedup=dedup)
                xd, idd, wd = x.cuda(), ids.cuda(), w.cuda()
                plan = disp.plan(idd, wd, xd)
                y = disp.combine(run_experts([torch.nn.Identity()] * disp.local, disp.dispatch(xd, plan),
                                             plan.recv_counts), plan)
                err = float((y.cpu() - x).norm() / x.norm())
                ok = err == 0.0 if mode == "none" else err < 0.05
                rows.append({"check": f"round trip {mode} {'dedup' if dedup else 'plain'} on CUDA",
                             "ok": ok, "value": f"rel err {err:.2e}"})
        ll = LowLatency(E, T, codec=Codec("fp8"), combine_codec="bf16")
        recv, count, handle, hook = ll.dispatch(x.cuda(), ids.cuda(), w.cuda(), return_recv_hook=True)
        recv, count = hook()
        back = ll.combine(recv, handle)
        rows.append({"check": "low-latency fp8 dispatch + bf16 combine on CUDA (hook)",
                     "ok": int(count.sum()) == T * K and float((back.cpu() - x).norm() / x.norm()) < 0.05,
                     "value": f"recv_count {count.tolist()}"})
        torch.cuda.synchronize()
    finally:
        if own:
            dist.destroy_process_group()
    return rows


if __name__ == "__main__":
    for row in check():
        print(("ok  " if row["ok"] else "FAIL") + f"  {row['check']}: {row['value']}")
