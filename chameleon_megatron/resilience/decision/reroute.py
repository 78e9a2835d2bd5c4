"""The data-rerouting candidate: keep the plan, hand each failed stage's microbatches to
healthy peers holding the same layers in other pipelines (forward and backward of a
microbatch on the same peer)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from chameleon_megatron.resilience.decision.layout import Plan, StateUnit
from chameleon_megatron.resilience.decision.perf_model import StepEstimate, plan_step, stage_cost
from chameleon_megatron.resilience.decision.profile import Profile


class Infeasible(ValueError):
    """A candidate cannot be built; the message says why."""


@dataclass(frozen=True)
class Reroute:
    """Microbatches of one failed stage and the peer pipelines that take them."""

    pipeline: int
    stage: int
    targets: tuple[tuple[int, int], ...]
    """(peer pipeline, microbatches it takes); the peer is that pipeline's stage holding
    the same layers."""


@dataclass(frozen=True)
class ReroutePlan:
    plan: Plan
    """The layout kept."""
    failed_ranks: tuple[int, ...]
    reroutes: tuple[Reroute, ...]

    @property
    def stopped_ranks(self) -> tuple[int, ...]:
        """Every rank of a failed stage: the dead ones and, at tp > 1, their live TP
        partners, which cannot run the stage without them (they wait as spares)."""
        dead = set(self.failed_ranks)
        return tuple(sorted(r for pipe in self.plan.pipelines for st in pipe.stages
                            if dead.intersection(st.ranks) for r in st.ranks))

    def extra_microbatches(self) -> dict[tuple[int, int], int]:
        """(pipeline, stage) of each peer -> microbatches it runs for failed stages."""
        stage_of = _stage_by_units(self.plan)
        extra: dict[tuple[int, int], int] = {}
        for r in self.reroutes:
            units = self.plan.pipelines[r.pipeline].stage_units(r.stage)
            for peer, n in r.targets:
                key = (peer, stage_of[units][peer])
                extra[key] = extra.get(key, 0) + n
        return extra

    def estimate(self, profile: Profile) -> StepEstimate:
        return plan_step(self.plan, profile, self.extra_microbatches())

    def to_dict(self) -> dict[str, Any]:
        return {
            "failed_ranks": list(self.failed_ranks),
            "reroutes": [{"pipeline": r.pipeline, "stage": r.stage,
                          "targets": [list(t) for t in r.targets]} for r in self.reroutes],
        }


def _stage_by_units(plan: Plan) -> dict[tuple[StateUnit, ...], dict[int, int]]:
    """State held by a stage -> {pipeline: stage index} of every stage holding exactly it."""
    out: dict[tuple[StateUnit, ...], dict[int, int]] = {}
    for j, pipe in enumerate(plan.pipelines):
        for s in range(pipe.depth):
            out.setdefault(pipe.stage_units(s), {})[j] = s
    return out


def plan_reroute(plan: Plan, dead_ranks: Iterable[int], profile: Profile) -> ReroutePlan:
    """Spread each failed stage's microbatches over its healthy peers, the least loaded
    pipelines first; raises Infeasible when a failed stage has no healthy peer."""
    dead = set(dead_ranks)
    failed = [(j, s) for j, pipe in enumerate(plan.pipelines) for s, st in enumerate(pipe.stages)
              if dead.intersection(st.ranks)]
    stage_of = _stage_by_units(plan)
    base = plan_step(plan, profile).pipeline_s
    load = list(base)
    reroutes = []
    # each failed stage, grouped with the others holding the same layers
    groups: dict[tuple[StateUnit, ...], list[int]] = {}
    for j, s in failed:
        groups.setdefault(plan.pipelines[j].stage_units(s), []).append(j)
    for units, failed_pipes in groups.items():
        peers = [p for p in stage_of[units] if p not in failed_pipes]
        if not peers:
            j = failed_pipes[0]
            raise Infeasible(
                f"stage {stage_of[units][j]} of pipeline {j} (layers {units[0]}..{units[-1]}) "
                "has no healthy peer holding the same layers"
            )
        cost = stage_cost(profile, units)
        per_mb = cost.forward_s + cost.backward_s
        total = sum(plan.pipelines[j].microbatches for j in failed_pipes)
        # one microbatch at a time to the peer that would finish first
        quota = {p: 0 for p in peers}
        for _ in range(total):
            p = min(peers, key=lambda q: (load[q] + per_mb, q))
            quota[p] += 1
            load[p] += per_mb
        for j in failed_pipes:
            need, targets = plan.pipelines[j].microbatches, []
            for p in peers:
                take = min(need, quota[p])
                if take:
                    targets.append((p, take))
                    quota[p] -= take
                    need -= take
            reroutes.append(Reroute(pipeline=j, stage=stage_of[units][j], targets=tuple(targets)))
    reroutes.sort(key=lambda r: (r.pipeline, r.stage))
    return ReroutePlan(plan=plan, failed_ranks=tuple(sorted(dead & set(plan.ranks()))),
                       reroutes=tuple(reroutes))
