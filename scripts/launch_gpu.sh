#!/usr/bin/env bash
# Train on this node's GPUs: N nccl processes (one per GPU) under torchrun (chameleon-run).
#
#   scripts/launch_gpu.sh N PRESET.yaml [trainer flags...]
#   scripts/launch_gpu.sh 8 configs/gpt-7b-8xh100.yaml --mock-data --train-iters 50
#
# Flags after the preset override it (and --distributed-backend nccl). See _launch.sh.
# Megatron-LM requires it with tensor parallelism: TP communication then runs in issue order.
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
# Swap frees and re-allocates activation-sized blocks every step: growable segments keep the
# caching allocator from fragmenting into out-of-memory errors.
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
exec bash "$(dirname "$0")/_launch.sh" nccl "$@"
