"""A member's run state through a recovery: what it holds coming in (``Held``), where the
members agree to resume from what they all hold (``exchange``, through the generation's
store), and the resumption itself (``resume_at``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from chameleon_megatron.resilience.model_state import ModelState
from chameleon_megatron.resilience.recovery import overlap, run_state, shard_assembly
from chameleon_megatron.resilience.recovery.run_state import Agreed, RunState
from chameleon_megatron.resilience.recovery.shard_replica import ShardReplicas
from chameleon_megatron.resilience.store.waits import wait_keys
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


@dataclass(frozen=True)
class Resumption:
    """Where the members resume, agreed from what each holds."""

    states: dict[int, RunState]
    """Every member's run state (with shard copies: at the step of its usable copies)."""
    agreed: Agreed
    shards: dict[int, list] | None
    """Every member's shard copies (None: no distributed optimizer)."""
    state_from: dict[str, Any] | None
    """Where the state comes from, for the record (None: the replicas)."""


def exchange(scope: dist.Store, me: int, held: Held, members: tuple[int, ...],
             shards: ShardReplicas | None, completed: int, *, timeout_s: float,
             abandoned: Callable[[], bool], on_wait: Callable[[], None]) -> Resumption:
    """Publish this member's run state (and shard copies) in the generation's ``scope``,
    read every member's and agree where to resume. ``completed``: the steps this member
    had completed when the recovery began."""
    run_state.publish(scope, me, held.run)
    wanted = run_state.keys(members)
    if shards is not None:
        shard_assembly.publish(scope, me, shards)
        wanted += shard_assembly.keys(members)
    wait_keys(scope, wanted, timeout_s=timeout_s, abandoned=abandoned, on_wait=on_wait)
    states = run_state.read_all(scope, members)
    if shards is None:
        return Resumption(states, _where_to_resume(states), None, None)
    copies = shard_assembly.read(scope, members)
    # at the step of the copies every holder can use
    states = shard_assembly.agreed_states(copies, states)
    agreed = _where_to_resume(states)
    agreed = run_state.without(agreed, shard_assembly.unassemblable(copies, agreed.iteration))
    return Resumption(states, agreed, copies,
                      shard_assembly.sources(copies, agreed.iteration, completed))


def _where_to_resume(states: dict[int, RunState]) -> Agreed:
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
                      scheduler_state=agreed.scheduler, after_step=agreed.after_step,
                      valid_samples=agreed.valid_samples)
    if donor is not None:
        set_rng_state(states[donor].rng)
