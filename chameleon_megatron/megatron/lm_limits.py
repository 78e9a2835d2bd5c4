"""What Chameleon cannot serve on Megatron-LM's ``pretrain_gpt.py``, as tables of (ok, why).

``megatron_lm.check_supported`` refuses the first row that is not ok, in one line, after
each parse (before ``validate_args`` fills in derived values, so a value here is the user's).

Recovery (``--chameleon-ft``) rebuilds what ``groups.build_uniform`` builds: tensor, pipeline
and virtual-pipeline parallelism, data parallelism being world / (TP x PP), every other
megatron parallel degree at its default. It moves parameters, persistent module buffers (the
MoE router's ``expert_bias``) and optimizer state between replicas, and falls back to
Megatron-LM's own checkpoints of ``--save``, which it must be able to reshard to the new
layout. Anything else is refused, as are module buffers with the distributed optimizer (its
shard copies hold the optimizer's pieces only).

Dest names are read with defaults, so that Megatron-LM releases without a flag pass.
"""

from __future__ import annotations

import argparse

Limits = list[tuple[bool, str]]
VPP_REFUSED = ("interleaved pipelines (virtual stages): the decision center plans one "
               "contiguous run of layers per pipeline stage")
RAMPUP_REFUSED = "--rampup-batch-size: the decision center plans for one global batch size"
"""Why recovery refuses these on both entries (``recovery/plugin.check_recoverable`` says
the same on chameleon's trainer)."""


def _get(margs: argparse.Namespace, name: str, default: object = None) -> object:
    return getattr(margs, name, default)


def _parallel(margs: argparse.Namespace) -> Limits:
    tp = _get(margs, "tensor_model_parallel_size", 1)
    etp = _get(margs, "expert_tensor_parallel_size")
    return [
        ((_get(margs, "context_parallel_size", 1) or 1) <= 1,
         f"--context-parallel-size {_get(margs, 'context_parallel_size')}: recovery rebuilds "
         "tensor, pipeline and data parallelism only (context parallelism would be lost)"),
        ((_get(margs, "expert_model_parallel_size", 1) or 1) <= 1,
         f"--expert-model-parallel-size {_get(margs, 'expert_model_parallel_size')}: recovery "
         "rebuilds expert parallelism 1 only (experts are not re-sharded over the survivors)"),
        (etp is None or etp == tp,
         f"--expert-tensor-parallel-size {etp} with --tensor-model-parallel-size {tp}: "
         "recovery rebuilds expert tensor parallelism at the TP degree only"),
        (not _get(margs, "use_tp_pp_dp_mapping", False),
         "--use-tp-pp-dp-mapping: recovery rebuilds megatron's default rank order "
         "(tp-cp-ep-dp-pp) only"),
        (_get(margs, "num_distributed_optimizer_instances", 1) in (None, 1),
         f"--num-distributed-optimizer-instances "
         f"{_get(margs, 'num_distributed_optimizer_instances')}: the shard copies follow one "
         "distributed-optimizer instance over the whole data-parallel group"),
    ]


def _pipeline(margs: argparse.Namespace) -> Limits:
    uneven = ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
              "pipeline_model_parallel_layout")
    given = next((n for n in uneven if _get(margs, n) is not None), None)
    return [
        (_get(margs, "num_layers_per_virtual_pipeline_stage") is None
         and _get(margs, "num_virtual_stages_per_pipeline_rank") is None,
         VPP_REFUSED),
        (given is None,
         f"--{(given or '').replace('_', '-')}: uneven pipeline stages; recovery re-plans "
         "onto an even layer split"),
    ]


def _memory(margs: argparse.Namespace) -> Limits:
    fsdp = next((f for f in ("use_torch_fsdp2", "use_megatron_fsdp", "use_custom_fsdp")
                 if _get(margs, f, False)), None)
    return [
        (fsdp is None,
         f"--{(fsdp or '').replace('_', '-')}: FSDP shards parameters over the data-parallel "
         "group; recovery copies whole parameters from replicas"),
        (not (_get(margs, "moe_router_enable_expert_bias", False)
              and _get(margs, "use_distributed_optimizer", False)),
         "--moe-router-enable-expert-bias with --use-distributed-optimizer: the router's "
         "expert_bias is a module buffer, and the shard copies hold the optimizer's pieces "
         "only (it would restart at zero)"),
        (not _get(margs, "fp16", False),
         "--fp16: the loss scaler's state (scale, growth tracker) is not migrated; use --bf16"),
        (not _get(margs, "optimizer_cpu_offload", False),
         "--optimizer-cpu-offload: megatron's HybridDeviceOptimizer moves state between its "
         "device and host sub-optimizers at each step; in-memory recovery does not follow it"),
    ]


def _checkpoints(margs: argparse.Namespace) -> Limits:
    return [
        (_get(margs, "ckpt_format", "torch_dist") != "torch",
         "--ckpt-format torch: the fallback to the last checkpoint reshards it to the new "
         "layout, which needs torch_dist"),
        (not _get(margs, "async_save", False),
         "--async-save: a checkpoint still being written when a rank fails is neither "
         "finished nor known to be unfinished to the fallback"),
        (_get(margs, "non_persistent_ckpt_type") != "local",
         "--non-persistent-ckpt-type local: node-local checkpoints die with their node and "
         "cannot be resharded"),
    ]


def ft_limits(margs: argparse.Namespace) -> Limits:
    """What recovery (``--chameleon-ft``) cannot rebuild or move, as (ok, why)."""
    return [
        *_parallel(margs), *_pipeline(margs), *_memory(margs), *_checkpoints(margs),
        (_get(margs, "rampup_batch_size") is None, RAMPUP_REFUSED),
    ]


def swap_limits(margs: argparse.Namespace) -> Limits:
    """What ``--chameleon-swap`` cannot share: Megatron's own activation offloading owns the
    same saved-tensor hooks."""
    # Megatron sets its cpu_offloading from --cpu-offloading-num-layers (no flag of its own)
    return [
        (not _get(margs, "cpu_offloading_num_layers", 0),
         f"--cpu-offloading-num-layers {_get(margs, 'cpu_offloading_num_layers')}: "
         "Megatron's activation offloading and Chameleon's swap would both own the "
         "saved-tensor hooks; use one"),
        (not _get(margs, "fine_grained_activation_offloading", False),
         "--fine-grained-activation-offloading: Megatron's activation offloading and "
         "Chameleon's swap would both own the saved-tensor hooks; use one"),
    ]


def first_refused(limits: Limits) -> str | None:
    return next((why for ok, why in limits if not ok), None)
