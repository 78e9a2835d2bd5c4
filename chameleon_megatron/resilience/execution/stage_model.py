"""The model of one stage of a plan whose layout megatron's parallel state cannot express:
pipelines of different depths (a re-plan) or a kept layout with dead ranks (rerouting).

A stage is a plain ``GPTModel`` (no megatron DDP: its gradient sync is per layer, see
``hetero_sync``) built from the trainer's arguments with its pipeline's depth and layer split
(``num_layers_in_first/last_pipeline_stage``), so its layers carry their global numbers and
its state units match every other holder's. Nothing here reads megatron's parallel state.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import TransformerConfig

from chameleon_megatron.resilience.decision.layout import Plan
from chameleon_megatron.resilience.decision.placement import Slot, first_last
from chameleon_megatron.training.model import layer_spec, transformer_config


class PipelinePosition:
    """Stands in for the pipeline group while a stage is built.

    megatron-core reads only ``rank()`` and ``size()`` of the model's pipeline group (layer
    offsets, first/last stage); the plan knows both. A stage whose pipeline lost a rank
    (rerouting) can thus be built without a group that could never form. The schedules get
    the real groups separately.
    """

    def __init__(self, stage: int, depth: int) -> None:
        if not 0 <= stage < depth:
            raise ValueError(f"stage={stage}: must be in [0, {depth})")
        self._stage, self._depth = stage, depth

    def rank(self) -> int:
        return self._stage

    def size(self) -> int:
        return self._depth


def stage_config(args: argparse.Namespace, counts: Sequence[int]) -> TransformerConfig:
    """The trainer's TransformerConfig for a pipeline with ``counts`` layers per stage."""
    first, last = first_last(counts)
    return dataclasses.replace(
        transformer_config(args), tensor_model_parallel_size=1,
        pipeline_model_parallel_size=len(counts),
        virtual_pipeline_model_parallel_size=None,
        num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last,
    )


def build_stage_model(args: argparse.Namespace, plan: Plan, slot: Slot,
                      solo: dist.ProcessGroup) -> GPTModel:
    """The stage ``slot`` of ``plan``; ``solo`` is a group of this rank alone (its TP and CP
    group at tp = 1). Weights are megatron's random init: load the real ones afterwards."""
    pipe = plan.pipelines[slot.pipeline]
    config = stage_config(args, [len(st.layers) for st in pipe.stages])
    # embd=None: the copy of the tied embedding is loaded with the state, not all-reduced in.
    groups = ProcessGroupCollection(tp=solo, cp=solo, pp=PipelinePosition(slot.stage, pipe.depth),
                                    embd=None, pos_embd=None)
    ensure_memory_buffer()
    model = GPTModel(
        config=config, transformer_layer_spec=layer_spec(args),
        vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
        pre_process=slot.stage == 0, post_process=slot.stage == pipe.depth - 1,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type, rotary_base=args.rotary_base,
        pg_collection=groups,
    )
    return model.to(torch.cuda.current_device() if torch.cuda.is_available() else "cpu")


def ensure_memory_buffer() -> None:
    """megatron's attention takes scratch space from parallel_state's global buffer, which
    only ``initialize_model_parallel`` creates (and ``destroy_model_parallel`` drops)."""
    if parallel_state._GLOBAL_MEMORY_BUFFER is None:
        parallel_state._set_global_memory_buffer()


def seed_stage(seed: int, slot: Slot) -> None:
    """The trainer's seeding (per pipeline stage) with the ranks given, not read from
    parallel state: the CPU generator and megatron's tensor-parallel RNG tracker."""
    stage_seed = seed + 100 * slot.stage
    torch.manual_seed(stage_seed)
    tensor_parallel.model_parallel_cuda_manual_seed(stage_seed, tp_rank=slot.tp_index,
                                                   ep_rank=0, etp_rank=0)
