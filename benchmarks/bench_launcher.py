"""Launcher overhead: `toolkit.launch` of a trivial 2-rank job vs a bare `torchrun` of the same work.

    .venv/bin/python benchmarks/bench_launcher.py [--rounds 5]

Target (issue 2): launch / torchrun <= 1.3. Both sides start 2 Python processes that import torch,
initialise gloo and all-reduce one tensor; `launch` adds accelerate's CLI, the spec file, result files
and the progress poll. A third column: the same launch forked from a batch's launch server
(`toolkit.runtime.caller_start.serving`, what `make run` and the test session use), whose imports are done once.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from toolkit import launch
from toolkit.runtime import machine, server_process
from toolkit.runtime.caller_start import serving

BARE = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
x = torch.ones(4); dist.all_reduce(x)
dist.destroy_process_group()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    print(f"machine: {machine.describe()}", flush=True)  # what the times below mean
    script = Path(tempfile.mkdtemp()) / "bare.py"
    script.write_text(BARE)
    bare, ours, served = [], [], []
    with serving() as server:
        path = os.environ.pop(server_process.SERVER_ENV)  # set only around the served launch
        for i in range(args.rounds + 1):  # the first round warms the page cache and is dropped
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                            "--master_port", str(free_port()), str(script)], check=True, capture_output=True)
            t1 = time.perf_counter()
            launch("toolkit.lessons.selftest", 2, {}, progress="none")
            t2 = time.perf_counter()
            os.environ[server_process.SERVER_ENV] = path
            launch("toolkit.lessons.selftest", 2, {}, progress="none")
            os.environ.pop(server_process.SERVER_ENV)
            t3 = time.perf_counter()
            if i:
                bare.append(t1 - t0)
                ours.append(t2 - t1)
                served.append(t3 - t2)
        print(f"launch server: {server.summary()}")
    b, o, s = statistics.median(bare), statistics.median(ours), statistics.median(served)
    print(f"bare torchrun      median {b:.2f} s  ({', '.join(f'{t:.2f}' for t in bare)})")
    print(f"toolkit.launch     median {o:.2f} s  ({', '.join(f'{t:.2f}' for t in ours)})")
    print(f"launch, served     median {s:.2f} s  ({', '.join(f'{t:.2f}' for t in served)})")
    print(f"launch / torchrun  {o / b:.2f}   (target <= 1.3); served / torchrun {s / b:.2f}")


if __name__ == "__main__":
    main()
