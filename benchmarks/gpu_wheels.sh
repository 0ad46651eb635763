#!/usr/bin/env bash
# Fetch, here, the wheels that gpu_suite.sh installs on a GPU machine without a registry:
# what the lent nvidia-h200 image lacks (/work/.library/device/KINDS.md lists what it has):
# torchao for --precision fp8, fastapi, uvicorn and their needs for the serving stage, and
# nvImageCodec with the nvJPEG it loads for the images stage's --decode gpu.
# Python 3.12 x86-64 wheels, into .wheels/ (git ignores it; carry it to the GPU machine).
#
#   bash benchmarks/gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[[ -x $PY ]] || PY=python3
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .wheels \
  torchao==0.18.0 fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5 \
  annotated-types==0.8.0 annotated-doc==0.0.7 typing-inspection==0.4.5 \
  opentelemetry-api==1.45.2 uvicorn==0.54.0 nvidia-nvimgcodec-cu13==0.9.0.20 \
  nvidia-nvjpeg==13.0.2.28
ls .wheels
