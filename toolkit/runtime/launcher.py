"""``accelerate launch``, as :func:`toolkit.runtime.launch.launch` starts it.

``python -m toolkit.runtime.launcher ARGS`` takes the arguments of ``accelerate launch ARGS`` and runs
accelerate's own entry point (``accelerate.commands.launch.main``: its parser, then torchrun's agent, which
starts the ranks and waits for them). The one difference is how it ends::

    agent done (every rank succeeded) ─► os._exit(0)                   this module
                                     └─► Python's teardown, then exit  python -m accelerate.commands.launch

The teardown of a process that imported torch frees thousands of objects one by one and takes about 0.7 s
(2 cores: from the agent's return to the launcher's exit 0.64–0.79 s, and 0.06 s without it), on every
launch, after the ranks' results are on disk. A failure, an interrupt or a bad argument takes accelerate's
own path unchanged: its traceback in ``launch.log`` and its exit status, which the launcher reads.
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
