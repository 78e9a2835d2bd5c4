"""How a recovery's members bring the new layout its state: from the surviving copies
(the held state of every member, or with the distributed optimizer the assembled shard
copies) through the restorer's transfers, or as the fallback from the last checkpoint; then
the LR schedule, data position and RNG streams of the agreed step."""

from __future__ import annotations

from typing import Any, Callable

from chameleon_megatron.resilience.decision.center import RecoveryDecision
from chameleon_megatron.resilience.dist_opt import sink_view
from chameleon_megatron.resilience.recovery import overlap, shard_assembly
from chameleon_megatron.resilience.recovery.held import Held, NoState, Resumption, resume_at
from chameleon_megatron.resilience.recovery.rebuild import load_checkpoint
from chameleon_megatron.resilience.recovery.record import group_sum
from chameleon_megatron.resilience.recovery.regroup import Membership
from chameleon_megatron.resilience.recovery.shard_replica import ShardReplicas
from chameleon_megatron.resilience.recovery.transfer import migrate
from chameleon_megatron.resilience.store.job_store import JobStore
from chameleon_megatron.training.plugin import TrainerHandle


def move_state(trainer: TrainerHandle, group: Any, membership: Membership, held: Held,
               res: Resumption, decision: RecoveryDecision, *, me: int, job: JobStore,
               shards: ShardReplicas | None, timeout_s: float,
               abandoned: Callable[[], bool]) -> int:
    """The new layout's state on this rank (``me``), collective over the recovery
    ``group``: the bytes moved, summed over the group (0: loaded from the checkpoint)."""
    active = me in decision.active
    if decision.fallback is not None:
        if active:
            load_checkpoint(trainer)
        return 0
    old = held.view
    if shards is not None:
        old = shard_assembly.assemble(group, membership.members, me, res.shards, shards,
                                      res.agreed.iteration)
    sink = sink_view(*trainer.model_and_optimizer()) if active else NoState()
    if shards is None:  # (assembled units are built, and adopted, one at a time)
        overlap.adopt_local(old, sink, decision.transfers, me)
    report = migrate(group, membership.members, me, decision.transfers, old=old, new=sink,
                     timeout_s=timeout_s,
                     store=job.scoped(f"gen/{membership.generation}/migrate"),
                     abandoned=abandoned)
    if active:
        sink.commit()
    old = sink = None  # the assembled units: freed before new shard copies are made
    overlap.give_back()
    moved = group_sum(group, report.sent_bytes)
    if active:
        resume_at(trainer, res.agreed, res.states, decision.rng_donor.get(me))
    return moved
