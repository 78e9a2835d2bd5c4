#!/usr/bin/env bash
# Every GPU check and benchmark in one run, for a lent GPU machine (at most 9 minutes of
# checks, --budget-s, plus the install; one H200).
#
#   bash scripts/gpu_validate.sh OUTDIR                       # on the GPU machine
#   bash scripts/gpu_validate.sh OUTDIR --dry-run             # anywhere: CPU, tiny sizes
#   bash scripts/gpu_validate.sh OUTDIR --break plan_failover # a deliberate defect: must FAIL
#
# One line per check: PASS/FAIL/SKIP NAME {figures}; exit status 1 if any FAIL.
# Unpacks what the machine lacks from wheels carried with the tree (gpu_wheels/*.whl, made
# by `bash scripts/gpu_wheels.sh` on a machine with a package index), then runs
# scripts/gpu_validate.py, which writes one JSON file per check and summary.json under OUTDIR
# and says which checks it could not run and why.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 1 ] || [[ "$1" == -* ]]; then
    echo "usage: bash scripts/gpu_validate.sh OUTDIR [--dry-run] [--only CHECK,...]" \
         "[--break CHECK,...] [--budget-s SECONDS]" >&2
    exit 2
fi
out=$1
shift
PYTHON=${PYTHON:-python3}
if [ -x .venv/bin/python ] && [[ " $* " == *" --dry-run "* ]]; then
    PYTHON=.venv/bin/python
fi
site=$PWD/gpu_wheels/site
if [[ " $* " != *" --dry-run "* ]] && \
        ! "$PYTHON" -c "import megatron.core, psutil, pytest, pytest_timeout" 2>/dev/null; then
    if ! ls gpu_wheels/*.whl >/dev/null 2>&1; then
        echo "error: megatron-core, psutil or pytest is missing and gpu_wheels/ holds no" \
             "wheels (run: bash scripts/gpu_wheels.sh on a machine with a package index)" >&2
        exit 2
    fi
    # Unpacked beside the tree, not installed: no pip, no index, the system's packages intact.
    rm -rf "$site" && mkdir -p "$site"
    for wheel in gpu_wheels/*.whl; do "$PYTHON" -m zipfile -e "$wheel" "$site"; done
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PYTHON" scripts/gpu_validate.py "$out" "$@"
