#!/usr/bin/env bash
# Create (or refresh) .venv312: Python 3.12 with torch, the project (editable) and megatron-core
# 0.19, for Megatron-LM core_v0.19 (its pyproject asks for Python >= 3.12; it imports
# typing.override). Reinstalls only when setup.cfg or this script changed since the last run.
# The Megatron-LM tests put the 0.19 checkout itself first on PYTHONPATH; the megatron-core
# wheel here satisfies the project's install_requires and matches the checkout's tag.
set -euo pipefail
cd "$(dirname "$0")/.."
# PYTHON312, else python3.12 on PATH, else pyenv's 3.12 (its shim answers only where selected).
PYTHON=${PYTHON312:-}
if [ -z "$PYTHON" ] && python3.12 --version >/dev/null 2>&1; then
    PYTHON=python3.12
fi
if [ -z "$PYTHON" ]; then
    for candidate in "$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")"/versions/3.12*/bin/python3.12; do
        [ -x "$candidate" ] && PYTHON=$candidate
    done
fi
if [ -z "$PYTHON" ]; then
    echo "setup_env312.sh: no Python 3.12 found (set PYTHON312=/path/to/python3.12)" >&2
    exit 1
fi
if [ ! -x .venv312/bin/python ]; then
    "$PYTHON" -m venv .venv312
fi
stamp=.venv312/.chameleon-setup
want=$(sha256sum setup.cfg pyproject.toml scripts/setup_env312.sh | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    # From PyPI this is torch's CUDA build (with its nvidia-* wheels, ~4.7 GB; it runs on CPU):
    # `--no-deps` does not save them, torch then fails to import (libcudnn.so.9 missing).
    # TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu takes the CPU build instead.
    .venv312/bin/python -m pip install -q "torch==2.13.0" \
        ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
    .venv312/bin/python -m pip install -q "megatron-core==0.19.0" -e ".[test]"
    echo "$want" > "$stamp"
fi
