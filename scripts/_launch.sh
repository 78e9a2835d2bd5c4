#!/usr/bin/env bash
# Shared body of launch_cpu.sh and launch_gpu.sh: BACKEND N PRESET.yaml [trainer flags...].
# The launcher is chameleon-run: torchrun, with an agent that keeps survivors running when
# the run enables --chameleon-ft (flag or preset), plain torchrun otherwise.
# PYTHON picks the interpreter (default: the repository's .venv, else python3).
# CHAMELEON_ENTRY runs another script with the same flags, e.g. a patched Megatron-LM
# pretrain_gpt.py (docs/megatron-lm.md); default: the chameleon_megatron.pretrain_gpt module.
set -euo pipefail
backend=$1
shift
if [[ $# -lt 2 || ! $1 =~ ^[0-9]+$ || ! -f $2 ]]; then
    echo "usage: $(basename "$0") N PRESET.yaml [trainer flags...]  (N processes; the preset must exist)" >&2
    exit 2
fi
nproc=$1 preset=$2
shift 2

repo=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-$([[ -x $repo/.venv/bin/python ]] && echo "$repo/.venv/bin/python" || echo python3)}
entry=(-m chameleon_megatron.pretrain_gpt)
[[ -n ${CHAMELEON_ENTRY:-} ]] && entry=("$CHAMELEON_ENTRY")
# --standalone: a local rendezvous on a free port, so parallel jobs do not collide.
exec "$python" -m chameleon_megatron.run --standalone --nproc-per-node "$nproc" \
    "${entry[@]}" --chameleon-config "$preset" --distributed-backend "$backend" "$@"
