#!/usr/bin/env bash
# The GPU benchmark suite (see benchmarks/gpu_suite.py) with the project's interpreter, or the
# machine's python3 where there is no .venv (a lent GPU machine brings its own torch).
#
#   bash benchmarks/gpu_suite.sh [--out FILE] [--workdir DIR]   # on the GPU machine
#   bash benchmarks/gpu_suite.sh --dry-run                       # tiny sizes on the CPU (CI)
#   bash benchmarks/gpu_suite.sh --pending --budget-s 450        # what needs measuring, in
#   bash benchmarks/gpu_suite.sh --pending --dry-run             # order; the queue, listed
#                                                                # (benchmarks/gpu_queue.py)
#
# A GPU machine without a registry lacks torchao (--precision fp8), fastapi/uvicorn
# (serving) and nvImageCodec (images --decode gpu): `bash benchmarks/gpu_wheels.sh` here
# fetches their wheels into .wheels/;
# carried along, they are installed into .wheels/site for this run where one is missing.
# Without them those stages record why they did not run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[[ -x $PY ]] || PY=python3
if compgen -G ".wheels/*.whl" >/dev/null && ! "$PY" -c \
    "import torchao, fastapi, uvicorn, nvidia.nvimgcodec" 2>/dev/null; then
  if "$PY" -m pip install --quiet --no-deps --no-index --no-compile --upgrade \
      --target .wheels/site .wheels/*.whl; then
    export PYTHONPATH="$PWD/.wheels/site${PYTHONPATH:+:$PYTHONPATH}"
  else
    echo "gpu_suite.sh: could not install .wheels/*.whl; the stages that need them say so" >&2
  fi
fi
for arg in "$@"; do
  [[ $arg == --pending ]] && exec "$PY" benchmarks/gpu_queue.py "$@"
done
exec "$PY" benchmarks/gpu_suite.py "$@"
