"""The seam between the trainer and Chameleon's subsystems.

The trainer owns the loop; a subsystem (swap, resilience) is a ``TrainerPlugin`` whose
hooks the trainer calls at fixed points. The same plugins serve the Megatron-LM path,
whose hook calls them from the patched ``pretrain_gpt.py``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, ContextManager, Iterator, Literal

import torch

StepAction = Literal["redo", "stop"]


@dataclass(frozen=True, kw_only=True)
class TrainContext:
    """What a plugin may see of a run once the model is built."""

    model: list[torch.nn.Module]
    """Model chunks of this rank (one per virtual pipeline stage), as megatron wraps them."""
    config: Any
    """The megatron ``TransformerConfig`` of the model."""
    args: Any
    """Parsed trainer arguments (Megatron flag names as attributes)."""
    device: torch.device
    """Device of the model's activations."""
    rank: int
    """Global rank."""
    tp_rank: int
    pp_rank: int
    pp_size: int
    dp_rank: int
    vpp_size: int
    """Virtual pipeline stages per rank (1 without interleaving)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Free-form handles (e.g. the optimizer) for plugins that need them."""


class TrainerPlugin:
    """Hooks the trainer calls; subclasses override what they need."""

    def on_model_built(self, ctx: TrainContext) -> None:
        """Called once after model, DDP and optimizer exist, before the first step."""

    def step_context(self, iteration: int, *, training: bool) -> ContextManager[None]:
        """Entered around one call of the forward-backward function (train or eval)."""
        return contextlib.nullcontext()

    def on_step_failed(self, exc: BaseException, trainer: Any) -> StepAction | None:
        """An iteration raised ``exc``: recover and say what the loop does next.

        None: not this plugin's business (the next plugin is asked; if none answers, the
        exception propagates). "redo": the trainer's state was restored to a consistent
        step; run the next iteration. "stop": leave the loop quietly (a spare at job end).
        """
        return None

    def on_train_start(self, trainer: Any) -> StepAction | None:
        """Before the first iteration (a member joining a running job is admitted here).
        "stop": leave without training."""
        return None

    def between_steps(self, trainer: Any) -> StepAction | None:
        """After an iteration's records, before the next one: a plugin may change the layout
        here (an exception is handled like a failed step). "stop": leave the loop."""
        return None

    def metrics(self) -> dict[str, Any]:
        """Fields merged into this iteration's metrics record (e.g. ``{"swap": {...}}``)."""
        return {}

    def on_train_end(self) -> None:
        """Called once after the last iteration (also on error); release resources."""


@contextlib.contextmanager
def plugins_step(plugins: list[TrainerPlugin], iteration: int, *, training: bool) -> Iterator[None]:
    """Enter every plugin's step context, in order."""
    with contextlib.ExitStack() as stack:
        for p in plugins:
            stack.enter_context(p.step_context(iteration, training=training))
        yield
