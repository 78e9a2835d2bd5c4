#!/usr/bin/env bash
# Set up .venv and run the whole test suite (CPU; GPU checks are skipped without CUDA).
# With arguments: one pytest session over them (e.g. a file, -k, -m).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
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
others=$(mktemp)
(
    rc=0
    "${pytest[@]}" -m "not serial" -p no:cacheprovider || rc=1
    CHAMELEON_SOAK=1 "${pytest[@]}" -m soak -p no:cacheprovider || rc=1
    exit "$rc"
) > "$others" 2>&1 &
pid=$!
# interrupted: nothing left running
trap 'pkill -P "$pid" 2>/dev/null || true; kill "$pid" 2>/dev/null || true; rm -f "$others"' EXIT
status=0
"${pytest[@]}" -m "serial and not soak" || status=$?
wait "$pid" || status=$?
echo "=== the other tests and the soak (run beside the serial ones) ==="
cat "$others"
exit "$status"
