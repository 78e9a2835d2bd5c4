#!/usr/bin/env bash
# Train on this node's GPUs: N nccl processes (one per GPU) under torchrun.
#
#   scripts/launch_gpu.sh N PRESET.yaml [trainer flags...]
#   scripts/launch_gpu.sh 8 configs/gpt-7b-8xh100.yaml --mock-data --train-iters 50
#
# Flags after the preset override it (and --distributed-backend nccl).
# The launcher is chameleon-run: torchrun, with an agent that keeps survivors running when
# the run enables --chameleon-ft (flag or preset), plain torchrun otherwise.
# PYTHON picks the interpreter (default: the repository's .venv, else python3).
# CHAMELEON_ENTRY runs another script with the same flags, e.g. a patched Megatron-LM
# pretrain_gpt.py (docs/megatron-lm.md); default: the chameleon_megatron.pretrain_gpt module.
set -euo pipefail

if [[ $# -lt 2 || ! $1 =~ ^[0-9]+$ || ! -f $2 ]]; then
    echo "usage: $0 N PRESET.yaml [trainer flags...]  (N GPUs; the preset must exist)" >&2
    exit 2
fi
nproc=$1 preset=$2
shift 2

repo=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-$([[ -x $repo/.venv/bin/python ]] && echo "$repo/.venv/bin/python" || echo python3)}
entry=(-m chameleon_megatron.pretrain_gpt)
[[ -n ${CHAMELEON_ENTRY:-} ]] && entry=("$CHAMELEON_ENTRY")
# Megatron-LM requires it with tensor parallelism: TP communication then runs in issue order.
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
exec "$python" -m chameleon_megatron.launch --standalone --nproc-per-node "$nproc" \
    "${entry[@]}" --chameleon-config "$preset" --distributed-backend nccl "$@"
