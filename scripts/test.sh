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
others=$(mktemp)
"${pytest[@]}" -m "not serial" -p no:cacheprovider > "$others" 2>&1 &
pid=$!
trap 'kill "$pid" 2>/dev/null || true; rm -f "$others"' EXIT  # interrupted: no session left running
status=0
"${pytest[@]}" -m serial || status=$?
wait "$pid" || status=$?
echo "=== the other tests (run beside the serial ones) ==="
cat "$others"
exit "$status"
