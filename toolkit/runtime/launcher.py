"""``accelerate launch``, as :func:`toolkit.runtime.launch.launch` starts it.

``python -m toolkit.runtime.launcher ARGS`` takes the arguments of ``accelerate launch ARGS`` and runs
accelerate's own entry point (``accelerate.commands.launch.main``: its parser, then torchrun's agent, which
starts the ranks and waits for them). The one difference is how it ends::

    python -m accelerate.commands.launch   agent done ─► the interpreter's teardown (about 0.7 s) ─► exit
    python -m toolkit.runtime.launcher     agent done ─► os._exit(0), once every rank has succeeded

That teardown, of a process that imported torch, took 0.64–0.79 s from the agent's return to the launcher's
exit on 2 cores (0.06 s without it), on every launch, after the ranks' results were on disk. A failure, an
interrupt or a bad argument takes accelerate's own path unchanged: its traceback in ``launch.log`` and its exit
status, which the launcher reads.
"""
from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    from accelerate.commands.launch import main

    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
