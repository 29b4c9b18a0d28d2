"""The caller's progress display of a launch: one bar fed by rank 0's reports (``progress.rank0.json``).

A widget in JupyterLab, plain lines under papermill, CI and scripts, nothing with ``progress="none"``; every
mode keeps how the bar moved (``Progress.trace``), which ``launch`` returns with the results.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path


@contextlib.contextmanager
def kernel_stays_busy():
    """While the block runs in a Jupyter kernel, every status the kernel publishes for a control-channel message
    is followed by "busy" for the cell that is running.

    Why: JupyterLab (4.4 and later, with ipykernel 7's subshells) sends ``create_subshell_request`` on the control
    channel when the first widget of a session opens its comm (here the launch's bar). ipykernel answers with a
    busy and an idle status whose parent is that request, and both JupyterLab's status bar and the server's
    ``/api/kernels`` take any status for the kernel's: the rest of the launch showed "Idle" while the cell ran
    (measured: busy in 5 of 48 polls of a 13 s launch, the first 2 s; with this, in every poll). Nothing changes
    outside a kernel or where ipykernel lacks these hooks."""
    try:
        from IPython import get_ipython
        kernel = getattr(get_ipython(), "kernel", None)
        publish, cell = kernel._publish_status, kernel.get_parent("shell")
    except Exception:  # not in a kernel, or an ipykernel without these names
        yield
        return
    if not cell:
        yield
        return

    def publish_then_busy(status, *args, **kwargs):  # ipykernel's (status, channel, parent=None)
        publish(status, *args, **kwargs)
        if status == "idle" and (args[0] if args else kwargs.get("channel")) == "control":
            publish("busy", "shell", cell)

    kernel._publish_status = publish_then_busy
    try:
        yield
    finally:
        if kernel.__dict__.get("_publish_status") is publish_then_busy:
            del kernel._publish_status


def in_notebook() -> bool:
    """A kernel that a person is looking at: JupyterLab / Notebook (their server names the session), not a
    kernel papermill or nbclient runs headless (those get plain lines, kept in the executed notebook)."""
    try:
        from IPython import get_ipython
        shell = get_ipython()
    except ImportError:
        return False
    return shell is not None and shell.__class__.__name__ == "ZMQInteractiveShell" and \
        bool(os.environ.get("JPY_SESSION_NAME"))


class Progress:
    """One bar per launch: a widget in JupyterLab, plain lines under papermill, CI and scripts, nothing with
    ``mode="none"``. Every mode keeps ``trace``: each report it read, where it put the bar, and when.

    The total is the sum of the phase weights, fixed before any rank starts (without phases: one phase
    of weight 1). Rank 0 reports ``{"phase": i, "fraction": f, "done", "total", "message"}``, ``f`` its place
    in phase i (``Context.part`` nests code that counts its own units into a slice of the phase; without
    ``fraction``, ``done / total``); the bar stands at ``(weights of the phases before i + weight_i * f) /
    sum of weights`` and never moves back. Plain lines come at each phase, every tenth of the bar (at most
    one per 2 s) and, while nothing changes, every ``HEARTBEAT_S`` seconds, so a long step is not silence.
    """

    WIDTH = 1000  # widget resolution
    HEARTBEAT_S = 30.0  # plain mode: the longest stretch without a line

    def __init__(self, title: str, mode: str, phases: list | None = None, out=None):
        self.title, self.start, self.last_line, self.last_key = title, time.monotonic(), -1e9, None
        self.phases = [list(p) for p in phases] if phases else [["run", 1.0]]
        self.declared = bool(phases)
        self.weight = sum(w for _, w in self.phases)
        self.fraction, self.state, self.out = 0.0, None, out or sys.stdout
        self.trace: list[list] = []  # [overall(state), state, seconds] per report read, before never-move-back
        if mode == "auto":
            plain = os.environ.get("TOOLKIT_PLAIN_PROGRESS") or os.environ.get("CI") or not in_notebook()
            mode = "plain" if plain else "widget"
        self.mode, self.bar = mode, None
        if mode == "widget":
            try:
                import ipywidgets as w
                from IPython.display import display
                self.bar = w.IntProgress(value=0, min=0, max=self.WIDTH, description="starting",
                                         layout=w.Layout(width="40%"))
                self.label = w.Label(title)
                display(w.HBox([self.bar, self.label]))
            except ImportError:
                self.mode = "plain"
        if self.mode == "plain":
            names = ", ".join(f"{n} ({w:g})" for n, w in self.phases) if phases else "one phase"
            self._print(f"starting; phases: {names}")

    def poll(self, tmp: Path) -> None:
        """Read rank 0's progress file, if a new one is there (plain mode: repeat the line after a silence)."""
        path = tmp / "progress.rank0.json"
        try:
            state = json.loads(path.read_text())
        except (FileNotFoundError, json.JSONDecodeError, OSError):
            state = self.state
        if state is not None and state != self.state:
            self.update(state)
        elif self.mode == "plain" and time.monotonic() - self.last_line > self.HEARTBEAT_S:
            elapsed = time.monotonic() - self.start
            self._print(" ".join(filter(None, [f"{100 * self.fraction:3.0f}%", self._where(),
                                               f"({elapsed:.1f}s, still working)"])))

    def overall(self, state: dict) -> float:
        """The fraction of the whole run that ``state`` (one report of rank 0) stands for."""
        i = self._phase_of(state)
        if "fraction" in state:
            inside = state["fraction"]
        else:
            done, total = state.get("done", 0), state.get("total", 0)
            inside = done / total if total else 0.0
        before = sum(w for _, w in self.phases[:i])
        return (before + self.phases[i][1] * min(max(inside, 0.0), 1.0)) / self.weight

    def update(self, state: dict) -> None:
        self.state = state
        self.trace.append([self.overall(state), state, round(time.monotonic() - self.start, 3)])
        self.fraction = max(self.fraction, self.trace[-1][0])
        elapsed = time.monotonic() - self.start
        if self.mode == "widget" and self.bar is not None:
            self.bar.value = int(round(self.fraction * self.WIDTH))
            self.bar.description = f"{100 * self.fraction:.0f}%"
            self.label.value = f"{self.title} · {self._where()} · {elapsed:.1f}s"
        elif self.mode == "plain":
            key = (self._phase_of(state), int(10 * self.fraction))
            if key[0] != (self.last_key or (None,))[0] or (key != self.last_key and
                                                           time.monotonic() - self.last_line > 2.0):
                self._print(f"{100 * self.fraction:3.0f}% {self._where()} ({elapsed:.1f}s)")
                self.last_key = key

    def _phase_of(self, state: dict) -> int:
        return min(max(int(state.get("phase", 0)), 0), len(self.phases) - 1)

    def _where(self) -> str:
        """Where rank 0 is: phase (i/n), its innermost count and message."""
        if self.state is None:
            return "starting the ranks"
        state = self.state
        i, done, total = self._phase_of(state), state.get("done", 0), state.get("total", 0)
        return " ".join(filter(None, [f"{self.phases[i][0]} ({i + 1}/{len(self.phases)})" if self.declared else "",
                                      f"{done:g}/{total:g}" if total else "", state.get("message", "")]))

    def close(self, status: str) -> None:
        elapsed = time.monotonic() - self.start
        if self.mode == "widget" and self.bar is not None:
            self.bar.bar_style = "success" if status == "done" else "danger"
            if status == "done":
                self.bar.value = self.WIDTH
            self.bar.description = status
            self.label.value = f"{self.title} · {status} in {elapsed:.1f}s"
        elif self.mode == "plain":
            self._print(f"{status} in {elapsed:.1f}s")

    def _print(self, text: str) -> None:
        print(f"[launch] {self.title}: {text}", file=self.out, flush=True)
        self.last_line = time.monotonic()

