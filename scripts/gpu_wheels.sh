#!/usr/bin/env bash
# Download what the lent GPU machine lacks (Python 3.12, torch with CUDA already there; no
# package index): the megatron-core wheel and the small packages the checks need there
# (psutil for megatron's checkpointing, pytest for the gpu-marked tests), into gpu_wheels/,
# which travels with the tree (git-ignored; carry it with the device tool).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${GPU_PYTHON_VERSION:-3.12}
MCORE=${GPU_MEGATRON_CORE:-megatron-core==0.16.1}
mkdir -p gpu_wheels
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_17_x86_64 --platform any \
    -d gpu_wheels "$MCORE" packaging psutil pytest pluggy iniconfig pytest-timeout
ls -l gpu_wheels
