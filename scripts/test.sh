#!/usr/bin/env bash
# Set up .venv and run the whole test suite (CPU; GPU checks are skipped without CUDA).
# With arguments: one pytest session over them (e.g. a file, -k, -m).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
bash scripts/setup_host_tools.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
pytest=(.venv/bin/python -m pytest -q --durations=20)
if [ $# -gt 0 ]; then
    exec "${pytest[@]}" "$@"
fi
# Two chains side by side: the recovery jobs (marker `serial`: failures are found on
# deadlines) one after another, and beside them every other test, then the Megatron-LM
# core_v0.19 tests (Python 3.12: .venv312 is built, mostly a download, while the other tests
# run), then the serial files in LATE, so that both chains end together. A job's processes
# leave the cores idle about a third of the time; at most two jobs share them.
# The soak (marker `soak`, minutes per job) is not part of this run:
# CHAMELEON_SOAK=1 bash scripts/test.sh -m soak
LATE=(tests/megatron/test_megatron_lm_plans.py tests/resilience/recovery/test_transfer.py
      tests/test_gpu_validate.py tests/megatron/test_groups.py)
# Each source the tests' processes import (the Megatron-LM checkouts they copy included) is
# compiled once, not in every process, where the environment sets PYTHONDONTWRITEBYTECODE; the
# bytecode goes to a folder of its own, never next to a checkout's sources.
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX=$(mktemp -d)
others=$(mktemp)
(
    rc=0
    env -u PYTHONPYCACHEPREFIX bash scripts/setup_env312.sh > "$others.312" 2>&1 &
    setup312=$!
    "${pytest[@]}" -m "not serial" -p no:cacheprovider || rc=1
    if wait "$setup312"; then
        CHAMELEON_REQUIRE_019=1 .venv312/bin/python -m pytest -q -p no:cacheprovider \
            tests/megatron/test_megatron_lm_019.py tests/megatron/test_lm_seams.py \
            tests/megatron/test_ckpt_writes.py || rc=1
    else
        echo "scripts/setup_env312.sh failed:"; tail -20 "$others.312"; rc=1
    fi
    "${pytest[@]}" -m "serial and not soak" -p no:cacheprovider "${LATE[@]}" || rc=1
    exit "$rc"
) > "$others" 2>&1 &
pid=$!
# interrupted: nothing left running
trap 'pkill -P "$pid" 2>/dev/null || true; kill "$pid" 2>/dev/null || true
      rm -rf "$others" "$others.312" "$PYTHONPYCACHEPREFIX"' EXIT
status=0
"${pytest[@]}" -m "serial and not soak" "${LATE[@]/#/--ignore=}" || status=$?
wait "$pid" || status=$?
echo "=== the other tests, the 0.19 tests and the late serial files (run beside the serial ones) ==="
cat "$others"
exit "$status"
