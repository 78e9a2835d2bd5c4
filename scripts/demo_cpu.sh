#!/usr/bin/env bash
# Set up .venv and train the tiny GPT preset on CPU over 4 gloo ranks (TP2 x PP2).
# Extra arguments are passed to the trainer, e.g. --train-iters 100 or --chameleon-swap.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec .venv/bin/torchrun --standalone --nproc-per-node 4 -m chameleon_megatron.pretrain_gpt \
    --chameleon-config configs/tiny-cpu.yaml "$@"
