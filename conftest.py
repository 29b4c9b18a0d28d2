"""Test-session settings shared by tests/ and the nbval run over notebooks/.

- Notebooks run at the smoke preset with plain progress lines (the kernel inherits this env).
- Triton runs in its interpreter (there is no CPU backend); the switch is read when triton is first
  imported, so it is set here, before any test module (or the toolkit it imports) loads triton.
- ``pytest-xdist --dist loadfile`` keeps each notebook's nbval cells on one worker (they share one kernel).
"""
import os

os.environ.setdefault("TOOLKIT_PRESET", "smoke")
os.environ.setdefault("TOOLKIT_PLAIN_PROGRESS", "1")
os.environ.setdefault("TRITON_INTERPRET", "1")
