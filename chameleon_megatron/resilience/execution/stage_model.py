"""The model of one stage of a plan whose layout megatron's parallel state cannot express:
pipelines of different depths (a re-plan) or a kept layout with dead ranks (rerouting).

A stage is megatron-core's ``GPTModel`` built as the job builds its model (the loop's
``StageBuilder``: its config, its builder) with its pipeline's depth and layer split (any
contiguous split, as a ``pipeline_model_parallel_layout``), so its layers carry their
global numbers and its state units match every other holder's. With bf16 it runs in
``Float16Module``, as the job's chunks do. Megatron's parallel state holds no plan: the
builder runs in a view of this stage (``plan_seams.stage_view``).

Its parameters sit in megatron's DDP (fp32 main gradients) and megatron's optimizer, in
*parts*: with the distributed optimizer, one DDP per gradient-sync group of this rank (a run
of units with the same holders), over that group, so the optimizer shards each part over
exactly its holders; the units held alone and the tied embedding's copy (summed over its
copies apart) form one more part over this rank alone. Without it, the whole stage is one
part over this rank alone. The gradient sync itself is the plan's (``grad_sync``).
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Sequence

import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel

from chameleon_megatron.megatron import plan_seams
from chameleon_megatron.resilience.decision.layout import Plan
from chameleon_megatron.resilience.decision.placement import Slot
from chameleon_megatron.resilience.execution.grad_sync import tied_weight, unit_params
from chameleon_megatron.resilience.execution.plan_groups import PlanGroups
from chameleon_megatron.resilience.model_state import unit_parameters
from chameleon_megatron.training.model import ddp_config, half_precision
from chameleon_megatron.training.optim import build_optimizer
from chameleon_megatron.training.stage_builder import StageBuilder


PLAN_NEEDS: dict[str, Any] = {
    # one normaliser for the whole global batch, whatever the pipeline or microbatch share
    "calculate_per_token_loss": True,
    # gloo pairs p2p ops by order; batched p2p is wrong when prev and next are one peer
    "batch_p2p_comm": False,
    # a stage's layer split is the plan's layout, not the job's
    "virtual_pipeline_model_parallel_size": None,
    "num_layers_in_first_pipeline_stage": None, "num_layers_in_last_pipeline_stage": None,
    "account_for_embedding_in_pipeline_split": False,
    "account_for_loss_in_pipeline_split": False,
    # TE's overlapped TP communication is set up for megatron's own TP groups only
    "tp_comm_overlap": False,
}
"""What a plan's stage needs of the job's TransformerConfig, whatever the job set."""


def stage_config(base: Any, counts: Sequence[int], stage: int, tp: int = 1) -> Any:
    """The job's TransformerConfig ``base`` for stage ``stage`` of a pipeline with
    ``counts`` layers per stage (any contiguous split), at tensor parallelism ``tp``."""
    layout = plan_seams.stage_layout(counts, stage) if len(counts) > 1 else None
    return dataclasses.replace(base, tensor_model_parallel_size=tp,
                               pipeline_model_parallel_size=len(counts),
                               pipeline_model_parallel_layout=layout, **PLAN_NEEDS)


class ParamSet(torch.nn.Module):
    """Some parameters of a model registered again under the given dotted names, as the
    module of one DDP part (names keep their suffixes: megatron's optimizer reads them)."""

    def __init__(self, named: Sequence[tuple[str, torch.nn.Parameter]]) -> None:
        super().__init__()
        for name, param in named:
            *path, leaf = name.split(".")
            module: torch.nn.Module = self
            for part in path:
                if part not in module._modules:
                    module.add_module(part, torch.nn.Module())
                module = module._modules[part]
            module.register_parameter(leaf, param)


def stage_parts(gpt: torch.nn.Module, groups: PlanGroups, *, distributed: bool,
                ) -> list[tuple[list[tuple[str, torch.nn.Parameter]], dist.ProcessGroup]]:
    """The stage's DDP parts: (named parameters, the group sharding them); see above."""
    units = unit_parameters([gpt])
    every = unit_params(units, list(units), None)
    if not distributed:
        return [(every, groups.solo)]
    parts = [(unit_params(units, g.layers, tied_weight(gpt)), handle)
             for g, handle in filter(None, groups.rounds)]
    taken = {id(p) for named, _ in parts for _, p in named}
    rest = [(name, p) for name, p in every if id(p) not in taken]
    return parts + ([(rest, groups.solo)] if rest else [])


def build_stage_model(args: argparse.Namespace, plan: Plan, groups: PlanGroups,
                      builder: StageBuilder) -> tuple[torch.nn.Module, list[Any], Any]:
    """The stage of this rank (``groups.slot``) of ``plan`` as ``builder`` builds the job's
    model, its DDP parts, and megatron's optimizer over them. Weights are megatron's random
    init: load the real ones afterwards."""
    slot = groups.slot
    pipe = plan.pipelines[slot.pipeline]
    counts = [len(st.layers) for st in pipe.stages]
    config = stage_config(builder.config(), counts, slot.stage, tp=plan.tp)
    position = plan_seams.PipelinePosition(slot.stage, pipe.depth)
    plan_seams.ensure_memory_buffer()
    with plan_seams.stage_view(stage=slot.stage, depth=pipe.depth, tp=groups.tp,
                               cp=groups.solo), builder.arguments(pipe.depth):
        gpt = builder.model(config, pre_process=slot.stage == 0,
                            post_process=slot.stage == pipe.depth - 1,
                            layers=counts[slot.stage],
                            groups=plan_seams.stage_groups(groups.solo, groups.tp, position))
    config = gpt.config  # the one the builder kept (the DDP parts read it too)
    (model,) = half_precision(config, [gpt])
    parts = [
        DistributedDataParallel(
            config=config, ddp_config=ddp_config(args, plan=True), module=ParamSet(named),
            pg_collection=plan_seams.stage_ddp_groups(dp, groups.solo, groups.tp, position))
        for named, dp in stage_parts(gpt, groups, distributed=args.use_distributed_optimizer)
    ]
    solo = plan_seams.stage_ddp_groups(groups.solo, groups.solo, groups.tp, position)
    return model, parts, build_optimizer(args, parts, pg_collection=solo)


def seed_stage(seed: int, slot: Slot) -> None:
    """The trainer's seeding (per pipeline stage) with the ranks given, not read from
    parallel state: the CPU generator and megatron's tensor-parallel RNG tracker."""
    stage_seed = seed + 100 * slot.stage
    torch.manual_seed(stage_seed)
    plan_seams.seed_tp_tracker(stage_seed, tp_rank=slot.tp_index)
