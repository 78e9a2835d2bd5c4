"""The seam through which a step runs on a layout megatron's parallel state cannot express.

By default the trainer runs megatron's own schedules over megatron's groups
(``training/step.py``). A ``StepEngine`` replaces that for as long as it is installed
(``Trainer.use_engine``): the resilience runtime installs one for heterogeneous pipelines and
for data rerouting, and removes it when the job returns to a layout megatron runs natively.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from chameleon_megatron.training.step import Applied


class StepEngine(Protocol):
    """One rank's part of a layout, ready to train."""

    model: torch.nn.Module
    """This rank's stage (a plain megatron ``GPTModel``)."""
    optimizer: Any
    """Its optimizer; ``build_scheduler`` works on it and its ``.optimizer`` is torch's."""

    def train_step(self, consumed: int, gbs: int) -> Applied:
        """Forward, backward and the optimizer update of the step that starts after
        ``consumed`` samples; the loss is summed up separately."""

    def global_loss(self, reports: list[dict]) -> tuple[float | None, int]:
        """Loss per token over the whole global batch, and the token count (every rank)."""

    def evaluate(self, dataset: Any, start: int, gbs: int) -> tuple[float | None, int]:
        """Forward only over ``gbs`` samples of ``dataset`` from ``start``: summed loss per
        token and the token count (every rank)."""

    def position(self) -> dict[str, int]:
        """Where this rank sits: ``pp_rank``, ``pp_size``, ``dp_rank`` (its pipeline)."""

    def pipeline_group(self) -> Any:
        """This rank's pipeline as a process group, stages in order (None: none)."""

    def layout(self) -> dict[str, Any]:
        """The layout for the metrics record."""
