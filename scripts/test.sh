#!/usr/bin/env bash
# Set up .venv and run the whole test suite (CPU; GPU checks are skipped without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec .venv/bin/python -m pytest -q --durations=25 "$@"
