"""The seam through which the trainer runs a step: a ``StepEngine`` per layout.

The trainer runs every step, evaluation and checkpoint decision through its engine. A
megatron layout (uniform TP x PP x DP, megatron's parallel state) has
``megatron_engine.MegatronEngine``: megatron's own schedules (``training/step.py``). The
resilience runtime installs a plan's engine (``Trainer.use_engine``) for heterogeneous
pipelines and for data rerouting, and the trainer builds a megatron one again when the job
returns to a layout megatron runs natively.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from chameleon_megatron.training.step import Applied


class StepEngine(Protocol):
    """One rank's part of a layout, ready to train."""

    model: list[torch.nn.Module]
    """This rank's model chunks (megatron's ``GPTModel`` in its wrappers)."""
    optimizer: Any
    """Their optimizer; ``build_scheduler`` works on it and its ``.optimizer`` is torch's."""
    config: Any
    """Their ``TransformerConfig``."""
    vpp_size: int
    """Virtual pipeline stages per rank (1: none)."""
    checkpointable: bool
    """Whether megatron's dist_checkpointing can save this layout (it shards by megatron's
    parallel state)."""

    def train_step(self, dataset: Any, consumed: int, gbs: int) -> Applied:
        """Forward, backward and the optimizer update of the step that starts after
        ``consumed`` samples of ``dataset``; the loss is summed up separately."""

    def global_loss(self, reports: list[dict]) -> tuple[float | None, int]:
        """Loss per token over the whole global batch, and the token count (every rank)."""

    def evaluate(self, dataset: Any, start: int, gbs: int) -> tuple[float | None, int]:
        """Forward only over ``gbs`` samples of ``dataset`` from ``start``: summed loss per
        token and the token count (every rank)."""

    def position(self) -> dict[str, int]:
        """Where this rank sits: ``tp_rank``, ``pp_rank``, ``pp_size``, ``dp_rank``."""

    def pipeline_group(self) -> Any:
        """This rank's pipeline as a process group, stages in order (None: none)."""

    def layout(self) -> dict[str, Any]:
        """The layout for the metrics record."""
