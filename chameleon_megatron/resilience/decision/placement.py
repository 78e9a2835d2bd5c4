"""Plain facts about a plan that its runtime needs (pure, no torch): where a rank sits,
which microbatches each pipeline runs, a world-rank order its pipeline groups accept, what
the runtime refuses, and the (local) state moves of a rerouting transition."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable, Iterable

from chameleon_megatron.resilience.decision.layout import Plan, StateUnit
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


class NoFreshCopy(ValueError):
    """A stale survivor keeps a unit that no fresh survivor holds: the layout cannot be
    kept as it is."""


def kept_in_place(plan: Plan, dead: Iterable[int], stale: Iterable[int] = (),
                  bytes_of: Callable[[StateUnit, str], float] = lambda unit, kind: 0.0,
                  ) -> tuple[Transfer, ...]:
    """Keeping ``plan`` (rerouting, or redoing a step) as a restorer transfer list: every
    survivor copies the units it holds from its old model into its runtime's (source =
    destination: nothing crosses the network), except a ``stale`` one (behind the step the
    job resumes from: it did not apply the last step), which receives each of its units from
    the lowest fresh holder at its TP index (``bytes_of(unit, kind)`` bytes). Raises
    NoFreshCopy when there is none."""
    gone, behind = set(dead), set(stale)
    held = sorted((r, i, units) for r, (i, units) in plan.holdings().items() if r not in gone)
    fresh: dict[tuple[StateUnit, int], int] = {}
    for r, i, units in held:
        for u in units:
            if r not in behind:
                fresh.setdefault((u, i), r)
    out = []
    for r, i, units in held:
        for u in units:
            src = fresh.get((u, i)) if r in behind else r
            if src is None:
                raise NoFreshCopy(f"stale rank {r} keeps unit {u!r} (TP index {i}), which no "
                                  "fresh survivor holds")
            out += [Transfer(src, r, u, kind, 0.0 if src == r else bytes_of(u, kind))
                    for kind in ("params", "optimizer")]
    return tuple(out)


def plan_refusal(args: argparse.Namespace, plan: Plan) -> str | None:
    """Why the plan runtime cannot train this model on ``plan``'s tensor/virtual-pipeline
    sizes (the first reason), or None when it can."""
    limits = [
        (plan.vpp == 1, f"vpp={plan.vpp}: plans execute plain 1F1B only"),
        (plan.num_layers == args.num_layers,
         f"plan has {plan.num_layers} layers, the model {args.num_layers}"),
        # its gradient sync replaces megatron's finalize_model_grads, which updates the bias
        (not getattr(args, "moe_router_enable_expert_bias", False),
         "--moe-router-enable-expert-bias: the plan runtime does not update the router's "
         "expert_bias"),
    ]
    return next((message for ok, message in limits if not ok), None)


def check_plan_runtime(args: argparse.Namespace, plan: Plan) -> None:
    """Refuse, before any work, what the plan runtime does not execute yet."""
    refusal = plan_refusal(args, plan)
    if refusal is not None:
        raise ValueError(refusal)
