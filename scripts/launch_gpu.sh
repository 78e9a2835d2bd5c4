#!/usr/bin/env bash
# Train on this node's GPUs: one nccl process per GPU under torchrun.
#
#   scripts/launch_gpu.sh [--nproc-per-node N] PRESET.yaml [trainer flags...]
#   scripts/launch_gpu.sh configs/gpt-7b-8xh100.yaml --mock-data --train-iters 50
#
# N defaults to every visible GPU. Flags after the preset override it.
# PYTHON picks the interpreter (default python3); CHAMELEON_ENTRY runs another script with
# the same flags, e.g. a patched Megatron-LM pretrain_gpt.py (see docs/megatron-lm.md).
set -euo pipefail

usage="usage: $0 [--nproc-per-node N] PRESET.yaml [trainer flags...]"
nproc=gpu  # torchrun: one process per visible GPU
if [[ ${1:-} == --nproc-per-node ]]; then
    [[ $# -ge 2 ]] || { echo "$usage" >&2; exit 2; }
    nproc=$2
    shift 2
fi
[[ $# -ge 1 && -f $1 ]] || { echo "$usage" >&2; echo "no preset file: ${1:-}" >&2; exit 2; }
preset=$1
shift

# Megatron orders tensor-parallel communication after compute on one CUDA queue.
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
entry=(-m chameleon_megatron.pretrain_gpt)
[[ -n ${CHAMELEON_ENTRY:-} ]] && entry=("$CHAMELEON_ENTRY")
exec "${PYTHON:-python3}" -m torch.distributed.run --standalone --nproc-per-node "$nproc" \
    "${entry[@]}" --chameleon-config "$preset" --distributed-backend nccl "$@"
