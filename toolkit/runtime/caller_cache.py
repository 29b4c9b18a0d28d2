"""The test suite's launch cache: a launch hook (``toolkit.runtime.launch.HOOK_ENV``) that ``conftest.py`` installs.

In the suite a notebook's run and a test module's fixture often launch the same lesson job; with this hook the
second returns the first one's results instead of starting its processes again. ``CACHE_ENV`` names the
session's folder; every xdist worker and notebook kernel inherits it, and the hook, from the environment.
Outside the suite (a notebook, ``make run``, your code) no hook is installed and every launch runs.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Callable

try:
    import fcntl  # the cache's lock (POSIX)
except ImportError:  # pragma: no cover - Windows: identical launches may then run twice
    fcntl = None

from .caller_watch import RankResults
from .launch import HOOK_ENV, Job

CACHE_ENV = "TOOLKIT_LAUNCH_CACHE"
"""The session's folder (``conftest.py`` makes one): one ``{key}.json`` per launch that ran, and ``hits.log``."""
CACHE_KEY_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "TRITON_INTERPRET")
"""Environment a run's results may depend on, besides every ``TOOLKIT_*`` variable: part of the cache key."""
NOT_IN_KEY = (CACHE_ENV, HOOK_ENV, "TOOLKIT_PLAIN_PROGRESS")
"""``TOOLKIT_*`` variables no rank reads: the hook's own, and how the bar is drawn."""
CACHED_PROGRAMS = re.compile(r"toolkit\.lessons\.(l\d\d\w*:run|emulator_check:\w+)")
"""Launch targets (``module:function``) the cache may serve: deterministic programs of the course."""


def reuse(job: Job, run: Callable[[], RankResults]) -> RankResults:
    """The hook: the results of an identical launch earlier in this session, else ``run()``'s, stored for the next.

    The entry is held under a lock, so an identical launch in another process (a pytest-xdist worker, a notebook
    kernel) waits for this one and then reads its results. Only the course's own programs are cached
    (``CACHED_PROGRAMS``: a lesson's ``run``, the emulator's checks that lesson 00 shows and
    ``tests/test_emulator.py`` asserts), never a launch whose files were asked for (``out_dir``, ``keep_files``:
    tests of the launcher itself always start processes), and never a failure (the next identical launch runs)."""
    path = entry(job)
    if path is None:
        return run()
    with locked(path):
        if path.exists():
            data = json.loads(path.read_text())
            results = RankResults(data["results"])
            results.wall_s, results.log, results.progress = data["wall_s"], data["log"], data.get("progress")
            with open(path.parent / "hits.log", "a") as hits:  # what the cache saved
                hits.write(f"{job.title}\t{results.wall_s:.1f}\n")
            if job.progress != "none":
                print(f"{job.title}: the results of an identical launch earlier in this test session ({CACHE_ENV})",
                      flush=True)
            return results
        results = run()
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"results": list(results), "wall_s": results.wall_s, "log": results.log,
                                   "progress": results.progress}))
        tmp.replace(path)
        return results


def entry(job: Job) -> Path | None:
    """Where ``job``'s results are kept: a file named by the hash of everything they may depend on (None: not
    cached). What was hashed is written beside it, so a miss is found by comparing these."""
    folder = os.environ.get(CACHE_ENV)
    spec = job.target
    program = f"{spec.get('module', '')}:{spec.get('function', '')}" if spec.get("kind") == "import" else ""
    if not folder or job.keep or CACHED_PROGRAMS.fullmatch(program) is None:
        return None
    env = {k: v for k, v in os.environ.items()
           if (k.startswith("TOOLKIT_") and k not in NOT_IN_KEY) or k in CACHE_KEY_ENV}
    fields = {"target": spec, "cfg": job.cfg, "world_size": job.world_size, "backend": job.backend,
              "seed": job.seed, "threads": job.threads, "cluster": job.cluster,
              "accelerate_args": job.accelerate_args, "env": env,
              "toolkit": str(Path(__file__).resolve().parents[1]),  # the code
              # the caller's folder only where a cfg value may be a relative path (nvme_path): a lesson reads no
              # other, so a test (in the repository's root) and a notebook (in notebooks/) share one launch
              "cwd": os.getcwd() if any(isinstance(v, str) and os.sep in v and not os.path.isabs(v)
                                        for v in job.cfg.values()) else None}
    text = json.dumps(fields, sort_keys=True, default=repr)
    path = Path(folder) / f"{hashlib.sha256(text.encode()).hexdigest()[:32]}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".key.json").write_text(text)
    return path


@contextlib.contextmanager
def locked(path: Path):
    """Hold ``path``'s lock file for the block (another process's identical launch waits here)."""
    with open(path.with_suffix(".lock"), "w") as lock:
        if fcntl is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield
