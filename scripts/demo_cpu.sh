#!/usr/bin/env bash
# What the project does, in a couple of minutes on CPU (configs/demo-cpu.yaml): a tiny GPT
# over 4 gloo ranks (PP2 x DP2) trains with swap under a budget and with fault tolerance;
# rank 3 is killed at iteration 12 (its process ends at once, no clean-up) and the three
# survivors recover in memory and finish the run at the same global batch. The same job
# without the failure and without Chameleon runs first, as the reference. Then a summary
# (memory saved per stage, the recovery's phases, the choice and why, the loss against the
# reference) and the plots (runs/demo/*.png).
# Extra arguments go to both training runs, e.g. --train-iters 60.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
out=runs/demo
rm -rf "$out"
mkdir -p "$out"
job=(-m chameleon_megatron.pretrain_gpt --chameleon-config configs/demo-cpu.yaml "$@")

echo "== 1/3 reference: the same job, no failure, no Chameleon ($out/reference.log)"
.venv/bin/chameleon-run --standalone --nproc-per-node 4 "${job[@]}" \
    --no-chameleon-swap --no-chameleon-ft --chameleon-metrics-file "$out/reference.jsonl" \
    > "$out/reference.log" 2>&1 || { tail -n 40 "$out/reference.log"; exit 1; }

echo "== 2/3 swap + fault tolerance, rank 3 killed at iteration 12 ($out/train.log)"
.venv/bin/chameleon-run --standalone --nproc-per-node 4 "${job[@]}" \
    --chameleon-inject-fault rank=3,iteration=12,phase=forward,kind=exit \
    2>&1 | tee "$out/train.log" | grep --line-buffered -E \
    " start: | iteration +[0-9]+/| recovered | injecting fault|worker failed" || true
[ "${PIPESTATUS[0]}" -eq 0 ] || { tail -n 40 "$out/train.log"; exit 1; }

echo "== 3/3 summary and plots"
.venv/bin/chameleon report "$out/metrics.jsonl" --baseline "$out/reference.jsonl"
