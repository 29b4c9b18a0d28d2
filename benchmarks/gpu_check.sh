#!/usr/bin/env bash
# Every GPU path the CPU machines cannot run, on one GPU, in one prepared run (benchmarks/gpu_check.py):
# compiled Triton kernels bit-equal to the torch references and their GB/s, CUDA memory statistics in the
# memory tracker, the CUDA offload stream path, a lesson at preset full on one GPU, and every
# benchmarks/gpu/*.py module's check(). Prints one summary table; exits 1 on any mismatch, 124 if it runs
# past GPU_CHECK_TIMEOUT seconds (default 480 = 8 minutes); without a GPU it says so and exits 0.
#
#   bash benchmarks/gpu_check.sh [--only kernels offload ...]
#   PYTHON=python3 bash benchmarks/gpu_check.sh        (the interpreter; default .venv/bin/python, else python3)
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec timeout --kill-after=10 "${GPU_CHECK_TIMEOUT:-480}" "$PY" benchmarks/gpu_check.py "$@"
