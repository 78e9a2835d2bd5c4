"""The model of one stage of a plan whose layout megatron's parallel state cannot express:
pipelines of different depths (a re-plan) or a kept layout with dead ranks (rerouting).

A stage is megatron-core's ``GPTModel`` built from the trainer's arguments with its
pipeline's depth and layer split (any contiguous split, as a
``pipeline_model_parallel_layout``), so its layers carry their global numbers and its state
units match every other holder's. It is wrapped as the trainer wraps its chunks (bf16:
``Float16Module``; megatron's DDP with fp32 main gradients), over groups of this rank alone:
the gradient sync is per layer (``grad_sync``). Nothing here reads megatron's parallel
state.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Sequence

import torch
import torch.distributed as dist

from chameleon_megatron.megatron import plan_seams
from chameleon_megatron.resilience.decision.layout import Plan
from chameleon_megatron.resilience.decision.placement import Slot
from chameleon_megatron.training.model import (
    Kernels,
    available_kernels,
    layer_spec,
    transformer_config,
    wrap_ddp,
)
from chameleon_megatron.training.optim import build_optimizer


def stage_config(args: argparse.Namespace, counts: Sequence[int], stage: int,
                 kernels: Kernels, tp: int = 1) -> Any:
    """The trainer's TransformerConfig for stage ``stage`` of a pipeline with ``counts``
    layers per stage (any contiguous split), at tensor parallelism ``tp``."""
    layout = plan_seams.stage_layout(counts, stage) if len(counts) > 1 else None
    return dataclasses.replace(
        transformer_config(args, kernels), tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=len(counts),
        virtual_pipeline_model_parallel_size=None,
        num_layers_in_first_pipeline_stage=None, num_layers_in_last_pipeline_stage=None,
        pipeline_model_parallel_layout=layout,
    )


def build_stage_model(args: argparse.Namespace, plan: Plan, slot: Slot,
                      solo: dist.ProcessGroup,
                      tp: dist.ProcessGroup) -> tuple[torch.nn.Module, Any]:
    """The stage ``slot`` of ``plan`` in its DDP wrapper, and megatron's optimizer over it;
    ``solo`` is a group of this rank alone, ``tp`` the stage's TP group (``solo`` at
    tp = 1). Weights are megatron's random init: load the real ones afterwards."""
    pipe = plan.pipelines[slot.pipeline]
    kernels = available_kernels()
    config = stage_config(args, [len(st.layers) for st in pipe.stages], slot.stage, kernels,
                          tp=plan.tp)
    position = plan_seams.PipelinePosition(slot.stage, pipe.depth)
    gpt = plan_seams.stage_gpt(config, layer_spec(args, kernels), args=args,
                               pre_process=slot.stage == 0,
                               post_process=slot.stage == pipe.depth - 1,
                               groups=plan_seams.stage_groups(solo, tp, position))
    ddp_groups = plan_seams.stage_ddp_groups(solo, tp, position)
    (model,) = wrap_ddp(args, config, [gpt], pg_collection=ddp_groups)
    return model, build_optimizer(args, [model], pg_collection=ddp_groups)


def seed_stage(seed: int, slot: Slot) -> None:
    """The trainer's seeding (per pipeline stage) with the ranks given, not read from
    parallel state: the CPU generator and megatron's tensor-parallel RNG tracker."""
    stage_seed = seed + 100 * slot.stage
    torch.manual_seed(stage_seed)
    plan_seams.seed_tp_tracker(stage_seed, tp_rank=slot.tp_index)
