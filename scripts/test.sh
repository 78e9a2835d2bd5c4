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
# Two sessions side by side: the recovery jobs (marker `serial`: failures are found on
# deadlines) one after another, and every other test beside them. A job's processes leave
# the cores idle about a third of the time; two recovery jobs never compete for them.
# When the other tests are done, the soak jobs (marker `soak`: a new random seed on every
# run, and the seeds that found bugs) follow them, beside the last serial jobs.
# Megatron-LM core_v0.19 needs Python 3.12: .venv312 is built (mostly a download) while the
# other tests run, and its tests follow them, before the soak.
others=$(mktemp)
(
    rc=0
    bash scripts/setup_env312.sh > "$others.312" 2>&1 &
    setup312=$!
    "${pytest[@]}" -m "not serial" -p no:cacheprovider || rc=1
    if wait "$setup312"; then
        CHAMELEON_REQUIRE_019=1 .venv312/bin/python -m pytest -q -p no:cacheprovider \
            tests/megatron/test_megatron_lm_019.py tests/megatron/test_lm_seams.py \
            tests/megatron/test_ckpt_writes.py || rc=1
    else
        echo "scripts/setup_env312.sh failed:"; tail -20 "$others.312"; rc=1
    fi
    CHAMELEON_SOAK=1 "${pytest[@]}" -m soak -p no:cacheprovider || rc=1
    exit "$rc"
) > "$others" 2>&1 &
pid=$!
# interrupted: nothing left running
trap 'pkill -P "$pid" 2>/dev/null || true; kill "$pid" 2>/dev/null || true; rm -f "$others" "$others.312"' EXIT
status=0
"${pytest[@]}" -m "serial and not soak" || status=$?
wait "$pid" || status=$?
echo "=== the other tests and the soak (run beside the serial ones) ==="
cat "$others"
exit "$status"
