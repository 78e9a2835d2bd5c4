"""Plain facts about a plan that its runtime needs (pure, no torch): where a rank sits,
which microbatches each pipeline runs, a world-rank order its pipeline groups accept, what
the runtime refuses, and the (local) state moves of a rerouting transition."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Iterable

from chameleon_megatron.resilience.decision.layout import Plan
from chameleon_megatron.resilience.decision.restorer import Transfer


@dataclass(frozen=True)
class Slot:
    """Where a rank sits in a plan."""

    pipeline: int
    stage: int
    tp_index: int


def slot_of(plan: Plan, rank: int) -> Slot:
    for j, s, i, r in plan.slots():
        if r == rank:
            return Slot(j, s, i)
    raise ValueError(f"rank {rank} has no slot in the plan {plan.describe()}")


def microbatch_ids(plan: Plan) -> tuple[tuple[int, ...], ...]:
    """Global microbatch indices of each pipeline, dealt out in turn to the pipelines with
    room left. With equal shares this is megatron's data-parallel order (microbatch k of
    pipeline j is global microbatch k P + j), so a kept layout sees the same data."""
    left = [p.microbatches for p in plan.pipelines]
    ids: list[list[int]] = [[] for _ in left]
    g = 0
    while g < plan.microbatches:
        for j in range(len(left)):
            if left[j]:
                ids[j].append(g)
                left[j] -= 1
                g += 1
    return tuple(tuple(x) for x in ids)


def stage_major_order(plan: Plan) -> tuple[int, ...]:
    """Plan ranks in a world-rank order that megatron's pipeline groups accept: torch orders a
    group's ranks by world rank, so each pipeline's stages must come in ascending world ranks.
    Stage by stage, pipelines in order within a stage (megatron's own layouts are so)."""
    slots = sorted(plan.slots(), key=lambda x: (x[1], x[0], x[2]))
    return tuple(rank for *_, rank in slots)


def kept_in_place(plan: Plan, dead: Iterable[int]) -> tuple[Transfer, ...]:
    """Rerouting's transition as a restorer transfer list: every survivor copies the units
    it holds from its old model into its runtime's (source = destination: nothing crosses
    the network; ``transfer.migrate`` does the copies and the votes)."""
    gone = set(dead)
    return tuple(Transfer(r, r, u, kind, 0.0)
                 for r, (_, units) in sorted(plan.holdings().items()) if r not in gone
                 for u in units for kind in ("params", "optimizer"))


def plan_refusal(args: argparse.Namespace, plan: Plan) -> str | None:
    """Why the plan runtime cannot train this model on ``plan``'s tensor/virtual-pipeline
    sizes (the first reason), or None when it can."""
    limits = [
        (plan.vpp == 1, f"vpp={plan.vpp}: plans execute plain 1F1B only"),
        (plan.tp == 1 or not args.num_experts,
         f"--num-experts with tp={plan.tp}: plans execute MoE with tensor parallelism 1 only"),
        (not args.use_distributed_optimizer, "--use-distributed-optimizer: not with plans"),
        (not args.sequence_parallel, "--sequence-parallel: plans do not reduce the "
         "sequence-parallel layer-norm gradients"),
        (plan.num_layers == args.num_layers,
         f"plan has {plan.num_layers} layers, the model {args.num_layers}"),
    ]
    return next((message for ok, message in limits if not ok), None)


def check_plan_runtime(args: argparse.Namespace, plan: Plan) -> None:
    """Refuse, before any work, what the plan runtime does not execute yet."""
    refusal = plan_refusal(args, plan)
    if refusal is not None:
        raise ValueError(refusal)
