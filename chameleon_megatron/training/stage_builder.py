"""How a plan builds and runs the model of one of its stages, as the job builds and runs its
own model: the job's TransformerConfig (the plan then states its layout in it), its model
builder and its forward step (with its loss).

Each loop gives its own (``TrainerHandle.stage_builder``): chameleon's trainer builds from
its arguments (``trainer_stages``); Megatron-LM's pretrain_gpt.py through Megatron-LM's
config and builder (``training.lm_stage``), so that every model flag of the job reaches a
plan's stages.
"""

from __future__ import annotations

import argparse
import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterator, Protocol

import torch
from megatron.core.transformer import TransformerConfig

from chameleon_megatron.megatron import plan_seams
from chameleon_megatron.training.model import available_kernels, model_spec, transformer_config
from chameleon_megatron.training.step import forward_step

ForwardStep = Callable[[Iterator[Any], torch.nn.Module], tuple[torch.Tensor, Callable[..., Any]]]
"""megatron's schedules' ``forward_step_func``: (data iterator, model) -> (output, the loss
function of the output)."""


class BuildStage(Protocol):
    def __call__(self, config: TransformerConfig, *, pre_process: bool, post_process: bool,
                 layers: int, groups: Any) -> torch.nn.Module:
        """The stage's ``GPTModel`` of ``layers`` layers, its process groups ``groups`` (a
        ``ProcessGroupCollection``), on this process's device."""


@dataclass(frozen=True)
class StageBuilder:
    config: Callable[[], TransformerConfig]
    """The job's TransformerConfig, as its own model is built from it."""
    model: BuildStage
    """The job's model builder, for one stage (``BuildStage``)."""
    forward_step: ForwardStep
    """The job's forward step and loss; the plan runs them in its stage's view of megatron's
    parallel state."""
    arguments: Callable[[int], ContextManager[None]] = lambda depth: contextlib.nullcontext()
    """The job's arguments as a stage of a pipeline of this depth must see them while the
    job's code runs on it (restored afterwards)."""
    refusal: str | None = None
    """Why the job's model cannot be a plan's stage (the decision center then proposes no
    plan), or None."""


def trainer_stages(args: argparse.Namespace) -> StageBuilder:
    """chameleon's trainer's model: its TransformerConfig and layer spec from ``args``."""
    kernels = available_kernels()

    def model(config: TransformerConfig, *, pre_process: bool, post_process: bool,
              layers: int, groups: Any) -> torch.nn.Module:
        return plan_seams.stage_gpt(config, model_spec(args, kernels, layers), args=args,
                                    pre_process=pre_process, post_process=post_process,
                                    groups=groups)

    return StageBuilder(lambda: transformer_config(args, kernels), model, forward_step)
