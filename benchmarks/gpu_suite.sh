#!/usr/bin/env bash
# The GPU benchmark suite (see benchmarks/gpu_suite.py) with the project's interpreter, or the
# machine's python3 where there is no .venv (a lent GPU machine brings its own torch).
#
#   bash benchmarks/gpu_suite.sh [--out FILE] [--workdir DIR]   # on the GPU machine
#   bash benchmarks/gpu_suite.sh --dry-run                       # tiny sizes on the CPU (CI)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[[ -x $PY ]] || PY=python3
exec "$PY" benchmarks/gpu_suite.py "$@"
