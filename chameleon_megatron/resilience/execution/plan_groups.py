"""Process groups of a plan (heterogeneous pipelines, or a kept layout with dead ranks).

Plans name ranks by their own ids (launch ranks, say); ``world`` maps each live one to its
rank in the current torch.distributed world, which must consist of exactly those ranks.
Every rank creates every group, in one order derived from the plan alone
(``megatron.groups.new_groups``):

1. one group per live rank alone (its CP group, and its TP group at tp = 1);
2. at tp > 1, one TP group per stage;
3. with ``pipelines``: one group per pipeline and TP index, for megatron's 1F1B schedule;
4. the gradient all-reduce groups, round by round (``grad_sync.SyncSpec``);
5. the groups of the tied embedding's copies;
6. with ``host``: every live rank over gloo, where the distributed optimizer's shard copies
   travel (``recovery/shard_replica``) whatever the device backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch.distributed as dist

from chameleon_megatron.megatron import groups
from chameleon_megatron.resilience.decision.layout import Plan
from chameleon_megatron.resilience.decision.placement import Slot, slot_of
from chameleon_megatron.resilience.decision.restorer import AllReduceGroup
from chameleon_megatron.resilience.execution.grad_sync import SyncSpec


@dataclass(frozen=True)
class PlanGroups:
    """This rank's handles."""

    slot: Slot
    solo: dist.ProcessGroup
    """This rank alone."""
    tp: dist.ProcessGroup
    """This rank's stage's TP group (``solo`` at tp = 1)."""
    pipeline: dist.ProcessGroup | None
    """This rank's pipeline at its TP index, stage order = group rank order (None without
    ``pipelines``)."""
    rounds: tuple[tuple[AllReduceGroup, dist.ProcessGroup] | None, ...]
    """Per sync round, this rank's group in it (ranks in plan ids) and its handle."""
    tied: dist.ProcessGroup | None
    world: Mapping[int, int]
    host: dist.ProcessGroup | None = None
    """Every live rank over gloo (None without ``host``)."""


def build_plan_groups(plan: Plan, me: int, spec: SyncSpec, *, world: Mapping[int, int],
                      pipelines: bool, timeout_s: float, host: bool = False) -> PlanGroups:
    """Create every group of the plan (collective over the world); ``me`` is a plan rank."""
    _check_world(plan, me, world, pipelines)
    live = sorted(world, key=world.__getitem__)
    lists: list[tuple[int, ...]] = [(world[r],) for r in live]
    stages = [st.ranks for p in plan.pipelines for st in p.stages
              if plan.tp > 1 and all(r in world for r in st.ranks)]  # a failed stage has none
    lists += [tuple(world[r] for r in ranks) for ranks in stages]
    pipes = [(j, i) for j in range(len(plan.pipelines)) for i in range(plan.tp)] \
        if pipelines else []
    lists += [tuple(world[st.ranks[i]] for st in plan.pipelines[j].stages) for j, i in pipes]
    sync = [g for rnd in spec.rounds for g in rnd]
    lists += [tuple(world[r] for r in g.ranks) for g in sync]
    lists += [tuple(world[r] for r in ranks) for ranks in spec.tied]
    handles = iter(groups.new_groups(lists, timeout_s=timeout_s))
    slot = slot_of(plan, me)
    solo = [next(handles) for _ in live][live.index(me)]
    tp = next((h for h in [next(handles) for _ in stages] if h is not None), solo)
    pipeline = [next(handles) for _ in pipes]
    rounds = []
    for rnd in spec.rounds:
        mine = None
        for g in rnd:
            handle = next(handles)
            if handle is not None:
                mine = (g, handle)
        rounds.append(mine)
    tied = [h for h in handles if h is not None]
    ring = groups.new_groups([tuple(range(len(live)))], timeout_s=timeout_s,
                             backend="gloo")[0] if host else None
    return PlanGroups(
        slot=slot, solo=solo, tp=tp,
        pipeline=pipeline[pipes.index((slot.pipeline, slot.tp_index))] if pipelines else None,
        rounds=tuple(rounds), tied=tied[0] if tied else None, world=dict(world), host=ring,
    )


def _check_world(plan: Plan, me: int, world: Mapping[int, int], pipelines: bool) -> None:
    size = dist.get_world_size()
    if sorted(world.values()) != list(range(size)):
        raise ValueError(f"world ranks {sorted(world.values())}: the plan's live ranks must be "
                         f"exactly the world's {size} ranks")
    unknown = set(world) - set(plan.ranks())
    if unknown:
        raise ValueError(f"ranks {sorted(unknown)} are not in the plan {plan.describe()}")
    if world.get(me) != dist.get_rank():
        raise ValueError(f"plan rank {me} is world rank {world.get(me)}, "
                         f"but this process is world rank {dist.get_rank()}")
    if not pipelines:
        return
    for j, pipe in enumerate(plan.pipelines):
        for i in range(plan.tp):
            ranks = [world.get(st.ranks[i]) for st in pipe.stages]
            if None in ranks or ranks != sorted(ranks):
                raise ValueError(f"pipeline {j}: world ranks {ranks} must all be live and "
                                 "ascend with the stage (order the world by "
                                 "stage_major_order)")
