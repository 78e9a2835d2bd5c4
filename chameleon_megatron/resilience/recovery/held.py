"""A member's run state through a recovery: what it holds coming in (``Held``), where the
members agree to resume from what they hold (``where_to_resume``), and the resumption itself
(``resume_at``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from chameleon_megatron.resilience.model_state import ModelState
from chameleon_megatron.resilience.recovery import overlap, run_state
from chameleon_megatron.resilience.recovery.run_state import Agreed, RunState
from chameleon_megatron.resilience.recovery.shard_replica import ShardReplicas
from chameleon_megatron.training.plugin import TrainerHandle
from chameleon_megatron.training.rng import set_rng_state


class NoState:
    """The state view of a member holding no model (a spare)."""

    def tensors(self, unit: Any, kind: str) -> dict[str, torch.Tensor]:
        return {}


@dataclass(frozen=True)
class Held:
    """What a member brings into a recovery: its run state and its old model state's
    tensors, which stay alive (and unchanged) until the recovery has completed; the model
    and optimizer around them do not (``overlap``)."""

    run: RunState
    view: Any

    @classmethod
    def of(cls, trainer: TrainerHandle, rng: dict[str, Any],
           shards: ShardReplicas | None = None) -> Held:
        """The trainer's state now; with a distributed optimizer, the run state of its last
        shard copies (the units are assembled from the copies in the recovery)."""
        if shards is not None:
            if shards.run is None:
                return cls.nothing()
            run = shards.run
            if run.iteration == trainer.iteration:  # the work after it is redone as usual
                run = dataclasses.replace(run, after_step=trainer.after_step)
            return cls(run, NoState())
        model, optimizer = trainer.model_and_optimizer()
        return cls(run_state.of(trainer, rng),
                   overlap.SourceTensors(ModelState(model, optimizer, role="source")))

    @classmethod
    def nothing(cls) -> Held:
        return cls(RunState(iteration=-1, consumed_samples=0), NoState())


def where_to_resume(states: dict[int, RunState]) -> Agreed:
    """Where training resumes; when only spares survived, nobody holds state (every unit
    is lost: the decision falls back to the checkpoint)."""
    if max(s.iteration for s in states.values()) >= 0:
        return run_state.agree(states)
    return Agreed(iteration=-1, consumed_samples=0, scheduler={}, fresh=(),
                  stale=tuple(sorted(states)))


def resume_at(trainer: TrainerHandle, agreed: Agreed, states: dict[int, RunState],
              donor: int | None) -> None:
    """The run state of the newest completed step: position, LR schedule, RNG streams."""
    trainer.resume_at(iteration=agreed.iteration, consumed_samples=agreed.consumed_samples,
                      scheduler_state=agreed.scheduler, after_step=agreed.after_step)
    if donor is not None:
        set_rng_state(states[donor].rng)
