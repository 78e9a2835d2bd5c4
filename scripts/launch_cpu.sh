#!/usr/bin/env bash
# Train on this machine's CPUs: N gloo processes under torchrun.
#
#   scripts/launch_cpu.sh [--nproc-per-node N] PRESET.yaml [trainer flags...]
#   scripts/launch_cpu.sh --nproc-per-node 4 configs/tiny-cpu.yaml --train-iters 10
#
# N defaults to 4. Flags after the preset override it (and --distributed-backend gloo).
# PYTHON picks the interpreter (default python3); CHAMELEON_ENTRY runs another script with
# the same flags, e.g. a patched Megatron-LM pretrain_gpt.py (see docs/megatron-lm.md).
set -euo pipefail

usage="usage: $0 [--nproc-per-node N] PRESET.yaml [trainer flags...]"
nproc=4
if [[ ${1:-} == --nproc-per-node ]]; then
    [[ $# -ge 2 ]] || { echo "$usage" >&2; exit 2; }
    nproc=$2
    shift 2
fi
[[ $# -ge 1 && -f $1 ]] || { echo "$usage" >&2; echo "no preset file: ${1:-}" >&2; exit 2; }
preset=$1
shift

entry=(-m chameleon_megatron.pretrain_gpt)
[[ -n ${CHAMELEON_ENTRY:-} ]] && entry=("$CHAMELEON_ENTRY")
# --standalone: a local rendezvous on a free port, so parallel jobs do not collide.
exec "${PYTHON:-python3}" -m torch.distributed.run --standalone --nproc-per-node "$nproc" \
    "${entry[@]}" --chameleon-config "$preset" --distributed-backend gloo "$@"
