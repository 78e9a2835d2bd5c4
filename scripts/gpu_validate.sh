#!/usr/bin/env bash
# Every GPU test and benchmark in one run, for a lent GPU machine (about 10 minutes on one H200).
#
#   bash scripts/gpu_validate.sh OUTDIR             # on the GPU machine
#   bash scripts/gpu_validate.sh OUTDIR --dry-run   # anywhere: each check's code on CPU, tiny sizes
#
# Installs what the machine lacks from wheels carried with the tree (gpu_wheels/*.whl, made
# by `bash scripts/gpu_wheels.sh` on a machine with a package index), then runs
# scripts/gpu_validate.py, which writes one JSON file per check and summary.json under OUTDIR
# and says which checks it could not run and why.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 1 ] || [[ "$1" == -* ]]; then
    echo "usage: bash scripts/gpu_validate.sh OUTDIR [--dry-run] [--only CHECK,...]" >&2
    exit 2
fi
out=$1
shift
PYTHON=${PYTHON:-python3}
if [ -x .venv/bin/python ] && [[ " $* " == *" --dry-run "* ]]; then
    PYTHON=.venv/bin/python
fi
if [[ " $* " != *" --dry-run "* ]] && ! "$PYTHON" -c "import megatron.core" 2>/dev/null; then
    if ! ls gpu_wheels/*.whl >/dev/null 2>&1; then
        echo "error: megatron-core is not installed and gpu_wheels/ holds no wheels" \
             "(run: bash scripts/gpu_wheels.sh on a machine with a package index)" >&2
        exit 2
    fi
    "$PYTHON" -m pip install -q --no-index --no-deps gpu_wheels/*.whl
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PYTHON" scripts/gpu_validate.py "$out" "$@"
