"""Where training stands on each survivor, and the state every survivor resumes from.

A failure can strike between the optimizer steps of different ranks: some replicas have
applied step k, others (those that talked to the dead rank) have not. Each member publishes
its run state in the generation's store; the job resumes at the newest step K any member
completed, from members at K (the *fresh* ones). Members behind K are *stale*: their model
state must not be used as a source, and they redo nothing on their own.

The work after step K (evaluation, checkpoint) is collective too, yet a member can finish
it and start step K+1 while another still waits in it (e.g. on a gather whose root lost a
peer). Every member resumes it from the earliest phase a fresh member had not finished, so
that all run the same collectives in the new layout.
"""

from __future__ import annotations

import dataclasses
import io
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist

from chameleon_megatron.training.plugin import WORK_ORDER, TrainerHandle


@dataclass(frozen=True)
class RunState:
    """One rank's position in training."""

    iteration: int
    """Optimizer steps applied to this rank's model (-1: holds no model state, a spare)."""
    consumed_samples: int
    scheduler: dict[str, Any] = field(default_factory=dict)
    """The LR scheduler's ``state_dict()``."""
    rng: dict[str, Any] = field(default_factory=dict)
    """RNG states (CPU, CUDA, megatron's tensor-parallel tracker), opaque here."""
    after_step: str = ""
    """The work after step ``iteration`` this rank was inside (``WORK_ORDER``); "" if none."""
    valid_samples: int = 0
    """Validation samples consumed where that work began (now, when in none): Megatron-LM
    moves through its validation set from one evaluation to the next."""

    def to_bytes(self) -> bytes:
        buf = io.BytesIO()
        torch.save({"iteration": self.iteration, "consumed_samples": self.consumed_samples,
                    "scheduler": self.scheduler, "rng": self.rng,
                    "after_step": self.after_step, "valid_samples": self.valid_samples}, buf)
        return buf.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> RunState:
        return cls(**torch.load(io.BytesIO(data), weights_only=False))


@dataclass(frozen=True)
class Agreed:
    """The state the job resumes from."""

    iteration: int
    """Steps completed (the redone step is iteration + 1)."""
    consumed_samples: int
    scheduler: dict[str, Any]
    fresh: tuple[int, ...]
    """Members whose model state is at ``iteration`` (usable as transfer sources)."""
    stale: tuple[int, ...]
    """Members behind it (their model state is discarded)."""
    after_step: str = ""
    """The work after step ``iteration`` every member redoes from this phase on, before the
    next step: the earliest a fresh member was inside ("" : none was)."""
    valid_samples: int = 0
    """Validation samples consumed where the job resumes (before the redone work)."""


def agree(states: Mapping[int, RunState]) -> Agreed:
    """The newest completed step and who holds it (pure)."""
    if not states:
        raise ValueError("no run state to agree on: no survivor")
    newest = max(s.iteration for s in states.values())
    if newest < 0:
        raise ValueError("no survivor holds model state")
    fresh = tuple(sorted(r for r, s in states.items() if s.iteration == newest))
    ref = states[fresh[0]]
    for r in fresh:
        if states[r].consumed_samples != ref.consumed_samples:
            raise ValueError(f"ranks {fresh[0]} and {r} are both at iteration {newest} but "
                             f"consumed {ref.consumed_samples} vs {states[r].consumed_samples} "
                             "samples")
    pending = [states[r].after_step for r in fresh if states[r].after_step]
    after_step = min(pending, key=WORK_ORDER.index, default="")
    # A member inside that work saw the validation position where it began; a member past
    # it (or, when "", any fresh member) sees the one after it. Spares hold none.
    at = next(r for r in fresh if states[r].after_step == after_step)
    return Agreed(iteration=newest, consumed_samples=ref.consumed_samples,
                  scheduler=ref.scheduler, fresh=fresh,
                  stale=tuple(sorted(r for r in states if r not in fresh)),
                  after_step=after_step, valid_samples=states[at].valid_samples)


def of(trainer: TrainerHandle, rng: dict[str, Any]) -> RunState:
    """The trainer's position now, with ``rng`` as the RNG streams of its next step."""
    return RunState(iteration=trainer.iteration, consumed_samples=trainer.consumed_samples,
                    scheduler=trainer.scheduler_state(), rng=rng, after_step=trainer.after_step,
                    valid_samples=trainer.valid_samples)


def without(agreed: Agreed, unusable: Sequence[int]) -> Agreed:
    """``agreed`` with ``unusable`` members' state treated as stale (not a source)."""
    bad = set(unusable)
    return dataclasses.replace(agreed, fresh=tuple(r for r in agreed.fresh if r not in bad),
                               stale=tuple(sorted(set(agreed.stale) | bad)))


def publish(store: dist.Store, rank: int, state: RunState) -> None:
    """Write this member's run state (``store``: the generation's scope)."""
    store.set(f"state/{rank}", state.to_bytes())


def keys(members: tuple[int, ...]) -> list[str]:
    """The keys of the members' run states (wait for them before ``read_all``)."""
    return [f"state/{r}" for r in members]


def read_all(store: dist.Store, members: tuple[int, ...]) -> dict[int, RunState]:
    """Every member's run state, once all are published."""
    return {r: RunState.from_bytes(store.get(k)) for r, k in zip(members, keys(members))}
