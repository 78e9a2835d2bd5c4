"""The seam between the trainer and Chameleon's subsystems.

The trainer owns the loop; a subsystem (swap, resilience) is a ``TrainerPlugin`` whose
hooks the trainer calls at fixed points. The same plugins serve the Megatron-LM path,
whose hook calls them from the patched ``pretrain_gpt.py``.
"""

from __future__ import annotations

import argparse
import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ContextManager, Iterator, Literal, Protocol

import torch

if TYPE_CHECKING:
    from chameleon_megatron.training.engine import StepEngine
    from chameleon_megatron.training.stage_builder import StageBuilder

StepAction = Literal["redo", "stop", "abandon"]
"""What the loop does after a failed step: "redo" it (every rank of the job redoes it),
"stop" quietly, or "abandon" it: this rank can redo it once every rank abandons it too."""


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
    pipeline_group: Any = None
    """This rank's pipeline as a process group, stages in order (None: none, e.g. a layout
    rerouting around dead ranks): plugins gather per-stage figures over it."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Free-form handles (e.g. the optimizer) for plugins that need them."""


AFTER_STEP = ("eval", "save")
"""The collective work after a step, in order: its evaluation, then its checkpoint."""
END_OF_JOB = ("final-save", "final-eval", "final-test")
"""The collective work Megatron-LM's ``pretrain()`` does after its loop returns, in order:
the final checkpoint, the evaluations on the validation and on the test set."""
WORK_ORDER = AFTER_STEP + END_OF_JOB
"""Every phase of work outside a step, in the order a loop runs them after its last step."""


class TrainerHandle(Protocol):
    """What a plugin may see and do of the trainer, and nothing else: the recovery
    controller resumes it at a step, rebuilds it for a layout, installs a step engine and
    emits records through it."""

    args: argparse.Namespace
    """Trainer arguments (read only; a rebuild replaces them)."""
    device: torch.device
    iteration: int
    """Completed iterations (read only: ``resume_at`` moves it)."""
    consumed_samples: int
    """Samples consumed by those iterations (read only)."""
    after_step: str
    """The work after step ``iteration`` (one of ``WORK_ORDER``) this rank is inside; ""
    in a step or between steps (read only)."""
    valid_samples: int
    """Validation samples consumed where that work began, or now when in none (read only)."""

    @property
    def rank(self) -> int:
        """This process's rank in the current world (the metrics writer is rank 0)."""

    @property
    def world_size(self) -> int: ...

    @property
    def stage_builder(self) -> StageBuilder:
        """How a plan builds its stages as this loop builds its model."""

    def scheduler_state(self) -> dict[str, Any]:
        """The LR schedule's state (``state_dict``)."""

    def model_and_optimizer(self) -> tuple[list[torch.nn.Module], Any]:
        """The model chunks and the optimizer trained now."""

    def resume_at(self, *, iteration: int, consumed_samples: int,
                  scheduler_state: dict[str, Any], after_step: str = "",
                  valid_samples: int) -> None:
        """Continue after ``iteration`` completed steps (state already loaded), first with
        the work after that step from phase ``after_step`` on (none when "") and
        ``valid_samples`` validation samples consumed."""

    def rebuild(self, *, tp: int, pp: int, rank: int, world_size: int,
                hints: dict[str, Any] | None = None) -> None:
        """A fresh model, DDP and optimizer for a megatron layout over the new world;
        ``hints`` reach the plugins in ``TrainContext.extra`` (e.g. a swap budget)."""

    def use_engine(self, engine: StepEngine, *, rank: int, world_size: int,
                   hints: dict[str, Any] | None = None) -> None:
        """Train through ``engine`` (a layout megatron's parallel state cannot express)."""

    def load(self, path: str) -> bool:
        """Load the latest checkpoint under ``path``; False when there is none."""

    def emit(self, record: dict[str, Any]) -> None:
        """Keep a record and write it to the metrics file (rank 0 writes)."""

    def drop_final_save(self) -> None:
        """Do not write the checkpoint at the end (this process holds no part of the model)."""

    def drop_layout(self) -> None:
        """Let go of the current layout's model, optimizer, schedule and engine (a recovery,
        before the next layout is built: they are freed with their last references)."""


class TrainerPlugin:
    """Hooks the trainer calls; subclasses override what they need."""

    def on_model_built(self, ctx: TrainContext) -> None:
        """Called once after model, DDP and optimizer exist, before the first step."""

    def on_model_dropped(self) -> None:
        """The trainer lets go of the model announced last (``TrainerHandle.drop_layout``):
        release every reference to it (hooks, wrappers, buffers) until the next
        ``on_model_built``."""

    def step_context(self, iteration: int, *, training: bool) -> ContextManager[None]:
        """Entered around one call of the forward-backward function (train or eval)."""
        return contextlib.nullcontext()

    def on_step_failed(self, exc: BaseException,
                       trainer: TrainerHandle) -> StepAction | None:
        """An iteration raised ``exc``: recover and say what the loop does next.

        None: not this plugin's business (the next plugin is asked; if none answers, the
        exception propagates). "redo": the trainer's state was restored to a consistent
        step; run the next iteration. "stop": leave the loop quietly (a spare at job end).
        "abandon": this rank's state allows a redo (e.g. a lowered swap budget after an
        out-of-memory error), but its peers are mid-step: the trainer redoes it alone in a
        world of one, else asks the plugins to ``abandon_step`` on every rank.
        """
        return None

    def abandon_step(self, exc: BaseException, trainer: TrainerHandle) -> StepAction | None:
        """Make every rank of the job abandon the step in progress and redo it together
        ("redo"); None: this plugin cannot."""
        return None

    def on_train_start(self, trainer: TrainerHandle) -> StepAction | None:
        """Before the first iteration (a member joining a running job is admitted here).
        "stop": leave without training."""
        return None

    def between_steps(self, trainer: TrainerHandle) -> StepAction | None:
        """After an iteration's records, before the next one: a plugin may change the layout
        here (an exception is handled like a failed step). "stop": leave the loop."""
        return None

    def leave_plan(self, trainer: TrainerHandle, work: str) -> StepAction | None:
        """Work after a step (``WORK_ORDER``) is due that the trainer runs only in a megatron
        layout, while a plan runs: a plugin may change to one here (every active rank asks
        after the same step). "stop": leave the loop."""
        return None

    def on_checkpoint(self, iteration: int) -> None:
        """Every rank is about to write the checkpoint of step ``iteration`` (collective)."""

    def on_end_of_job(self, phase: str, iteration: int) -> None:
        """Every rank is about to run ``phase`` (``END_OF_JOB``) of the work after the last
        step ``iteration`` (collective; again after a recovery during it)."""

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
