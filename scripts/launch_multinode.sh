#!/usr/bin/env bash
# Train across nodes with torchrun's static rendezvous: run this on every node, with the same
# NNODES, RDZV_ENDPOINT (an address of node 0, which hosts the job store) and RDZV_ID, and
# each node's own NODE_RANK. A node joining a running --chameleon-ft job later runs it with the
# same variables (any NODE_RANK) and --chameleon-ft-join after the preset.
#
#   NNODES=M NODE_RANK=R RDZV_ENDPOINT=HOST:PORT scripts/launch_multinode.sh N PRESET.yaml [flags...]
#   NNODES=2 NODE_RANK=0 RDZV_ENDPOINT=host0:29500 scripts/launch_multinode.sh 8 \
#       configs/llama-13b-8xh100.yaml --mock-data          # and NODE_RANK=1 on host1
#
# N processes per node (one per GPU). RDZV_ID (default chameleon) names the job; BACKEND
# (default nccl; gloo for CPU nodes) is passed as --distributed-backend. A node's processes get
# consecutive ranks, so tensor parallelism stays inside a node. Flags after the preset
# override it.
# The launcher is chameleon-run: torchrun, with an agent that keeps survivors running when
# the run enables --chameleon-ft (flag or preset), plain torchrun otherwise. With a static
# rendezvous the surviving nodes can also resume the job from its checkpoint by themselves
# when node 0 (and with it the store) is lost, if they are a majority of the launch's nodes;
# a node cut off from the job stops with status 75 (docs/resilience.md, Network partitions).
# PYTHON picks the interpreter (default: the repository's .venv, else python3).
# CHAMELEON_ENTRY runs another script with the same flags, e.g. a patched Megatron-LM
# pretrain_gpt.py (docs/megatron-lm.md); default: the chameleon_megatron.pretrain_gpt module.
set -euo pipefail

if [[ $# -lt 2 || ! $1 =~ ^[0-9]+$ || ! -f $2 ]]; then
    echo "usage: NNODES=M NODE_RANK=R RDZV_ENDPOINT=HOST:PORT $0 N PRESET.yaml [trainer flags...]" >&2
    exit 2
fi
if [[ -z ${NNODES:-} || -z ${NODE_RANK:-} || -z ${RDZV_ENDPOINT:-} ]]; then
    echo "$0: set NNODES, NODE_RANK and RDZV_ENDPOINT (HOST:PORT of node 0)" >&2
    exit 2
fi
nproc=$1 preset=$2
shift 2
backend=${BACKEND:-nccl}

repo=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-$([[ -x $repo/.venv/bin/python ]] && echo "$repo/.venv/bin/python" || echo python3)}
entry=(-m chameleon_megatron.pretrain_gpt)
[[ -n ${CHAMELEON_ENTRY:-} ]] && entry=("$CHAMELEON_ENTRY")
[[ $backend == nccl ]] && export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
if [[ ! $RDZV_ENDPOINT =~ ^(.+):([0-9]+)$ ]]; then
    echo "$0: RDZV_ENDPOINT=$RDZV_ENDPOINT: must be HOST:PORT (of node 0)" >&2
    exit 2
fi
exec "$python" -m chameleon_megatron.run --nnodes "$NNODES" --node-rank "$NODE_RANK" \
    --nproc-per-node "$nproc" --master-addr "${BASH_REMATCH[1]}" --master-port "${BASH_REMATCH[2]}" \
    --rdzv-id "${RDZV_ID:-chameleon}" \
    "${entry[@]}" --chameleon-config "$preset" --distributed-backend "$backend" "$@"
