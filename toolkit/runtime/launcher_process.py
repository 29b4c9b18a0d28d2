"""The launcher process: ``accelerate launch``, as :func:`toolkit.runtime.launch.launch` starts it.

``python -m toolkit.runtime.launcher_process ARGS`` takes the arguments of ``accelerate launch ARGS`` and runs
accelerate's own entry point (``accelerate.commands.launch.main``: its parser, then torchrun's agent, which
starts the ranks and waits for them). Two things differ, both for time:

How a rank starts. On CPU (gloo) launch sets torchrun's own ``--start-method fork --run-path`` (through its
``PET_*`` variables: accelerate's parser does not pass them on), and this process imports once what every rank
would import before its first line of work::

    exec (TOOLKIT_RANK_START=exec, GPUs)   agent ─► python -m toolkit.runtime.rank_process ─► import torch,
                                                    dynamo, toolkit (3.6–3.9 CPU-s a rank) ─► fn(ctx, cfg)
    fork (CPU, the default)                import torch, dynamo, toolkit once ─► agent ─► fork ─► fn(ctx, cfg)

A forked rank is still its own process with its own gloo process group; it inherits imported modules, not
state (the rank resets the agent's signal handlers, ``init_context`` seeds every generator). GPUs keep the
fresh interpreter: a forked child cannot use CUDA once its parent has touched it. In a batch (``make run``, the
test session) this process is itself forked from a launch server that did these imports once
(``toolkit.runtime.server_process``), and ``main`` runs there with the caller's argv.

How it ends. Once every rank has succeeded it leaves with ``os._exit(0)``: the interpreter's teardown of a
process that imported torch took 0.64–0.79 s on 2 cores, after the ranks' results were on disk. A failure, an
interrupt or a bad argument takes accelerate's own path: its traceback in ``launch.log`` and its exit status,
which launch reads. With forked ranks torchrun's report names only the first failure it saw, so this process
first adds every failed rank's exit status in the report's own lines (``report_forked_ranks``).
"""
from __future__ import annotations

import os
import sys

FORKED = os.environ.get("PET_START_METHOD") == "fork" and os.environ.get("PET_RUN_PATH") == "1"


def report_forked_ranks() -> None:
    """Each forked rank that failed, as torchrun's report writes one (``rank : 1 (local_rank: 1)`` then
    ``exitcode : -9 (pid: 123)``): its ProcessContext (``torch.multiprocessing``) is still reachable from the
    failure's traceback. One node: the local rank is the rank."""
    import gc

    from torch.multiprocessing import ProcessContext
    for context in (obj for obj in gc.get_objects() if isinstance(obj, ProcessContext)):
        for local_rank, proc in enumerate(context.processes):
            if proc.exitcode:
                print(f"  rank      : {local_rank} (local_rank: {local_rank})\n"
                      f"  exitcode  : {proc.exitcode} (pid: {proc.pid})", file=sys.stderr, flush=True)


def preload() -> None:
    """Import what every forked rank would import before its first line of work, and torchrun's agent."""
    import accelerate.commands.launch  # noqa: F401
    import torch._dynamo  # noqa: F401 - torch.optim, DDP and dispatch modes import it on first use
    import torch.distributed.run  # noqa: F401

    import toolkit.runtime.context  # noqa: F401
    import toolkit.runtime.target  # noqa: F401


def main() -> None:
    """accelerate launch with ``sys.argv[1:]``; leaves with ``os._exit(0)`` once every rank has succeeded."""
    if FORKED:
        preload()
    from accelerate.commands.launch import main as accelerate_launch

    try:
        accelerate_launch()
    except BaseException:
        if FORKED:
            report_forked_ranks()
        raise
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
