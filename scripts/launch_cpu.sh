#!/usr/bin/env bash
# Train on this machine's CPUs: N gloo processes under torchrun (chameleon-run).
#
#   scripts/launch_cpu.sh N PRESET.yaml [trainer flags...]
#   scripts/launch_cpu.sh 4 configs/tiny-cpu.yaml --train-iters 100
#
# Flags after the preset override it (and --distributed-backend gloo). See _launch.sh.
exec bash "$(dirname "$0")/_launch.sh" gloo "$@"
