#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment in .venv with the CPU build of torch.
# Reinstalls only when setup.cfg changed since the last run.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
stamp=.venv/.chameleon-setup
want=$(sha256sum setup.cfg pyproject.toml scripts/setup_env.sh | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    # Pin torch first: an unpinned torch would pull a multi-GB CUDA build. From PyPI even the
    # pinned one is the CUDA build on Linux: TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
    # takes the CPU build (not needed where pip finds a local CPU wheel, as on the CI machines).
    .venv/bin/python -m pip install -q "torch==2.13.0" \
        ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
    .venv/bin/python -m pip install -q -e ".[test]"
    # megatron-core's current release, for tests/megatron/test_mcore_next.py only: apart from
    # site-packages (everything else runs on the version installed above). Its Python 3.11
    # wheel declares Requires-Python >= 3.12, hence --ignore-requires-python.
    rm -rf .venv/megatron-core-next
    .venv/bin/python -m pip install -q --no-deps --ignore-requires-python \
        --target .venv/megatron-core-next "megatron-core==0.19.2"
    echo "$want" > "$stamp"
fi
