"""A bandwidth probe of the collectives in the style of nccl-tests, and a check of NCCL settings.

nccl-tests reports two numbers per message size S and time t (n ranks)::

    algbw = S / t                      what the application sees
    busbw = algbw * factor(op, n)      what each link carried, comparable across ops and n
      all_reduce          2(n-1)/n
      all_gather          (n-1)/n      (S = the gathered output)
      reduce_scatter      (n-1)/n      (S = the full input)
      all_to_all          (n-1)/n
      broadcast           1

busbw close to the link's peak means the collective is bandwidth-bound and well
implemented; a busbw far below it at large S points at topology or settings.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import time

import torch
import torch.distributed as dist

from toolkit.runtime import compat

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")


def bus_factor(op: str, n: int) -> float:
    if op not in OPS:
        raise ValueError(f"op={op!r} is not known; allowed: {OPS}")
    return {"all_reduce": 2 * (n - 1) / n, "broadcast": 1.0}.get(op, (n - 1) / n)


def _issue(op: str, buf: torch.Tensor, out: torch.Tensor, n: int, group=None) -> None:
    if op == "all_reduce":
        dist.all_reduce(buf, group=group)
    elif op == "all_gather":
        compat.all_gather_single(out, buf[: buf.numel() // n], group=group)
    elif op == "reduce_scatter":
        compat.reduce_scatter_single(out[: buf.numel() // n], buf, group=group)
    elif op == "all_to_all":
        dist.all_to_all_single(out, buf, group=group)
    else:
        dist.broadcast(buf, src=dist.get_global_rank(group, 0) if group else 0, group=group)


def probe(sizes_bytes: list[int], ops: tuple[str, ...] = OPS, iters: int = 5, warmup: int = 2, group=None,
          device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, on_step=None) -> list[dict]:
    """Time each op at each message size on every rank of ``group``; rows of size, time, algbw and busbw.

    Sizes are rounded down to a multiple of ``n * element size`` so every op splits evenly.
    The time is the slowest rank's (a max all-reduce of the per-rank means), as in nccl-tests.
    """
    n = dist.get_world_size(group)
    elt = torch.tensor([], dtype=dtype).element_size()
    rows, total, done = [], len(ops) * len(sizes_bytes), 0
    for op in ops:
        if op not in OPS:
            raise ValueError(f"op={op!r} is not known; allowed: {OPS}")
        for size in sizes_bytes:
            numel = max(size // (elt * n), 1) * n
            buf = torch.ones(numel, dtype=dtype, device=device)
            out = torch.empty(numel, dtype=dtype, device=device)
            for _ in range(warmup):
                _issue(op, buf, out, n, group)
            dist.barrier(group=group)
            t0 = time.perf_counter()
            for _ in range(iters):
                _issue(op, buf, out, n, group)
            if torch.device(device).type == "cuda":
                torch.cuda.synchronize()
            elapsed = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
            seconds = elapsed.item()
            nbytes = numel * elt
            algbw = nbytes / seconds
            rows.append({"op": op, "bytes": nbytes, "seconds": seconds, "algbw_GBps": algbw / 1e9,
                         "busbw_GBps": algbw * bus_factor(op, n) / 1e9})
            done += 1
            on_step and on_step(done, total)
    return rows


# Documented in the NCCL user guide ("Environment Variables"); values where the set is closed.
NCCL_VARIABLES: dict[str, tuple[str, ...] | None] = {
    "NCCL_ALGO": ("Ring", "Tree", "CollNet", "CollNetDirect", "CollNetChain", "NVLS", "NVLSTree", "PAT"),
    "NCCL_PROTO": ("LL", "LL128", "Simple"),
    "NCCL_IB_DISABLE": ("0", "1"), "NCCL_P2P_DISABLE": ("0", "1"), "NCCL_SHM_DISABLE": ("0", "1"),
    "NCCL_NVLS_ENABLE": ("0", "1"), "NCCL_COLLNET_ENABLE": ("0", "1"), "NCCL_CUMEM_ENABLE": ("0", "1"),
    "NCCL_DEBUG": ("VERSION", "WARN", "INFO", "TRACE"),
    **{name: None for name in (
        "NCCL_SOCKET_IFNAME", "NCCL_SOCKET_NTHREADS", "NCCL_NSOCKS_PERTHREAD", "NCCL_NTHREADS", "NCCL_BUFFSIZE",
        "NCCL_MAX_NCHANNELS", "NCCL_MIN_NCHANNELS", "NCCL_CROSS_NIC", "NCCL_IB_HCA", "NCCL_IB_TIMEOUT",
        "NCCL_IB_RETRY_CNT", "NCCL_IB_GID_INDEX", "NCCL_IB_SL", "NCCL_IB_TC", "NCCL_IB_QPS_PER_CONNECTION",
        "NCCL_IB_PCI_RELAXED_ORDERING", "NCCL_IB_ADAPTIVE_ROUTING", "NCCL_NET", "NCCL_NET_PLUGIN",
        "NCCL_NET_GDR_LEVEL", "NCCL_NET_GDR_READ", "NCCL_P2P_LEVEL", "NCCL_P2P_NET_CHUNKSIZE", "NCCL_TOPO_FILE",
        "NCCL_TOPO_DUMP_FILE", "NCCL_DEBUG_FILE", "NCCL_DEBUG_SUBSYS", "NCCL_LAUNCH_MODE", "NCCL_PXN_DISABLE",
        "NCCL_P2P_PXN_LEVEL", "NCCL_CONF_FILE", "NCCL_IGNORE_CPU_AFFINITY", "NCCL_COMM_BLOCKING")},
}


def check_nccl_settings(settings: dict[str, str]) -> list[dict]:
    """One row per variable: is it a documented NCCL variable, is each value allowed, is it set twice.

    ``settings`` may come from ``os.environ`` or be parsed from a script (``parse_exports``).
    """
    rows = []
    for name, value in settings.items():
        allowed = NCCL_VARIABLES.get(name, "unknown")
        if allowed == "unknown":
            verdict = "not a documented NCCL variable"
        elif allowed is None:
            verdict = "ok"
        else:
            bad = [v for v in str(value).split(",") if v.strip().lstrip("^") and v.strip().lstrip("^").lower()
                   not in {a.lower() for a in allowed}]
            verdict = "ok" if not bad else f"unknown value(s) {bad}; allowed: {', '.join(allowed)}"
        rows.append({"variable": name, "value": value, "verdict": verdict})
    return rows


def parse_exports(script: str) -> tuple[dict[str, str], list[str]]:
    """``export A=1`` lines -> (last value of each variable, variables exported more than once)."""
    values, seen, repeated = {}, set(), []
    for line in script.splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("export ") and "=" in line:
            name, value = line[len("export "):].split("=", 1)
            if name in seen and name not in repeated:
                repeated.append(name)
            seen.add(name)
            values[name] = value.strip()
    return values, repeated


def environment_report() -> dict:
    """What this machine tells about its communication setup: backend versions, NCCL_* vars, GPU topology."""
    report = {"torch": torch.__version__, "cuda_available": torch.cuda.is_available(),
              "gloo_available": dist.is_gloo_available(), "nccl_available": dist.is_nccl_available(),
              "nccl_version": None, "nccl_env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")},
              "gpu_topology": None}
    if torch.cuda.is_available() and dist.is_nccl_available():
        report["nccl_version"] = ".".join(map(str, torch.cuda.nccl.version()))
        if shutil.which("nvidia-smi"):
            out = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=20)
            report["gpu_topology"] = out.stdout
    return report
