#!/usr/bin/env bash
# The GPU benchmark suite (see benchmarks/gpu_suite.py) with the project's interpreter, or the
# machine's python3 where there is no .venv (a lent GPU machine brings its own torch).
#
#   bash benchmarks/gpu_suite.sh [--out FILE] [--workdir DIR]   # on the GPU machine
#   bash benchmarks/gpu_suite.sh --dry-run                       # tiny sizes on the CPU (CI)
#
# A GPU machine without a registry lacks torchao (--precision fp8): bring its wheel along in
# .wheels/ (`pip download torchao==0.18.0 --no-deps -d .wheels` here), and it is installed
# into .wheels/site for this run only. Without it the fp8 runs record why they did not run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[[ -x $PY ]] || PY=python3
if compgen -G ".wheels/*.whl" >/dev/null && ! "$PY" -c "import torchao" 2>/dev/null; then
  if "$PY" -m pip install --quiet --no-deps --no-index --target .wheels/site .wheels/*.whl; then
    export PYTHONPATH="$PWD/.wheels/site${PYTHONPATH:+:$PYTHONPATH}"
  else
    echo "gpu_suite.sh: could not install .wheels/*.whl; the fp8 runs will say so" >&2
  fi
fi
exec "$PY" benchmarks/gpu_suite.py "$@"
