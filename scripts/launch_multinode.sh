#!/usr/bin/env bash
# Train across nodes: run this on every node with the same endpoint and id (torchrun's c10d
# rendezvous); node 0 hosts the rendezvous store at the endpoint.
#
#   scripts/launch_multinode.sh --nnodes NODES --node-rank R --rdzv-endpoint HOST:PORT \
#       [--rdzv-id ID] [--nproc-per-node N] [--backend nccl|gloo] PRESET.yaml [trainer flags...]
#
#   # on node0 (10.0.0.1) and node1 alike, only --node-rank differs:
#   scripts/launch_multinode.sh --nnodes 2 --node-rank 0 --rdzv-endpoint 10.0.0.1:29400 \
#       configs/llama-13b-8xh100.yaml --mock-data
#
# N defaults to every visible GPU; ID to "chameleon"; backend to nccl. Ranks are numbered
# node by node, so a node's processes get consecutive ranks (tensor parallelism stays inside
# a node). Flags after the preset override it.
# PYTHON picks the interpreter (default python3); CHAMELEON_ENTRY runs another script with
# the same flags, e.g. a patched Megatron-LM pretrain_gpt.py (see docs/megatron-lm.md).
set -euo pipefail

usage="usage: $0 --nnodes NODES --node-rank R --rdzv-endpoint HOST:PORT [--rdzv-id ID] \
[--nproc-per-node N] [--backend nccl|gloo] PRESET.yaml [trainer flags...]"
nnodes= node_rank= endpoint= rdzv_id=chameleon nproc=gpu backend=nccl
while [[ ${1:-} == --* ]]; do
    [[ $# -ge 2 ]] || { echo "$usage" >&2; exit 2; }
    case $1 in
        --nnodes) nnodes=$2 ;;
        --node-rank) node_rank=$2 ;;
        --rdzv-endpoint) endpoint=$2 ;;
        --rdzv-id) rdzv_id=$2 ;;
        --nproc-per-node) nproc=$2 ;;
        --backend) backend=$2 ;;
        *) echo "unknown option $1" >&2; echo "$usage" >&2; exit 2 ;;
    esac
    shift 2
done
if [[ -z $nnodes || -z $node_rank || -z $endpoint ]]; then
    echo "$usage" >&2; echo "--nnodes, --node-rank and --rdzv-endpoint are required" >&2; exit 2
fi
[[ $# -ge 1 && -f $1 ]] || { echo "$usage" >&2; echo "no preset file: ${1:-}" >&2; exit 2; }
preset=$1
shift

# The c10d rendezvous assigns ranks itself (torchrun ignores --node-rank for it); the node
# rank says which node hosts the store, instead of guessing from host names.
is_host=false
[[ $node_rank == 0 ]] && is_host=true
[[ $backend == nccl ]] && export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
entry=(-m chameleon_megatron.pretrain_gpt)
[[ -n ${CHAMELEON_ENTRY:-} ]] && entry=("$CHAMELEON_ENTRY")
exec "${PYTHON:-python3}" -m torch.distributed.run --nnodes "$nnodes" \
    --nproc-per-node "$nproc" --rdzv-backend c10d --rdzv-endpoint "$endpoint" \
    --rdzv-id "$rdzv_id" --rdzv-conf "is_host=$is_host" \
    "${entry[@]}" --chameleon-config "$preset" --distributed-backend "$backend" "$@"
