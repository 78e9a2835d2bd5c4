"""The decisions' candidates for likely failures, computed between failures by the rank
that would decide, so that a failure costs a lookup.

Likely failures: every single member and every node (its members). Entries are keyed by
the exact survivors and computed by ``center.decision_candidates`` on the same inputs a
fresh decision uses (plan, survivors, stale members, profile, plan-runtime refusal, search
time limit), so a decision made from an entry equals the fresh one. A survivor set that
was not precomputed (two failures, a member that missed the last step, other inputs) is
not served: the caller decides fresh. Entries whose plan search hit its time limit are
left out (a fresh search may go further).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Sequence

from chameleon_megatron.resilience.decision.center import (
    DecisionCandidates,
    decision_candidates,
    make_planner,
)
from chameleon_megatron.resilience.decision.layout import Plan
from chameleon_megatron.resilience.decision.profile import Profile


@dataclass(frozen=True)
class CacheInputs:
    """What a decision's candidates depend on, besides who died."""

    plan: Plan
    members: tuple[int, ...]
    """Every member before the failure (spares included), ascending."""
    stale: tuple[int, ...]
    """Members holding no usable state (the spares), ascending."""
    profile: Profile
    plans: str | None
    """Why the plan runtime cannot run this model (None: it can)."""
    time_limit_s: float | None = 2.0
    replicated: bool = True
    """Re-plans keep two or more pipelines where they fit (``ft.keep_replicas``)."""


@dataclass(frozen=True)
class FailureCache:
    inputs: CacheInputs | None
    """None: nothing was precomputed (no failure to decide)."""
    entries: Mapping[frozenset[int], DecisionCandidates] = field(hash=False)
    """Survivors -> their candidates."""
    build_s: float = 0.0

    def lookup(self, *, plan: Plan, alive: Iterable[int], stale: Iterable[int],
               plans: str | None, time_limit_s: float | None = 2.0, replicated: bool = True
               ) -> DecisionCandidates | None:
        """The candidates precomputed for exactly these inputs, or None (profile: the
        caller's, checked before: it is ``inputs.profile`` when served)."""
        ins = self.inputs
        if ins is None or (plan, plans, time_limit_s, tuple(sorted(stale)), replicated) != \
                (ins.plan, ins.plans, ins.time_limit_s, ins.stale, ins.replicated):
            return None
        return self.entries.get(frozenset(alive))


def likely_failures(members: Sequence[int], stale: Iterable[int],
                    nodes: Iterable[Iterable[int]], me: int) -> list[frozenset[int]]:
    """The dead-rank sets whose decision ``me`` would make (it is the lowest fresh
    survivor): each single member, then each node's members; none that kills every fresh
    member. Each set once, in that order."""
    stale_set = set(stale)
    out: list[frozenset[int]] = []
    for dead in [frozenset([r]) for r in members] + [frozenset(n) & set(members)
                                                      for n in nodes]:
        fresh = sorted(set(members) - dead - stale_set)
        if dead and fresh and fresh[0] == me and dead not in out:
            out.append(dead)
    return out


def build_cache(inputs: CacheInputs, failures: Iterable[frozenset[int]],
                cancelled: Callable[[], bool] = lambda: False) -> FailureCache | None:
    """The candidates for each of ``failures`` (dead-rank sets); None when ``cancelled``
    says so between two of them. One pair of planners serves all (their searches share
    work)."""
    start = time.perf_counter()
    uniform = make_planner(inputs.profile, uniform=True, time_limit_s=inputs.time_limit_s,
                           replicated=inputs.replicated)
    planner = uniform if inputs.plans is not None else make_planner(
        inputs.profile, uniform=False, time_limit_s=inputs.time_limit_s,
        replicated=inputs.replicated)
    entries = {}
    for dead in failures:
        if cancelled():
            return None
        alive = frozenset(inputs.members) - dead
        cands = decision_candidates(inputs.plan, alive=alive, stale=inputs.stale,
                                    profile=inputs.profile, time_limit_s=inputs.time_limit_s,
                                    plans=inputs.plans, planners=(planner, uniform),
                                    replicated=inputs.replicated)
        if cands.replan.complete:
            entries[alive] = cands
    return FailureCache(inputs=inputs, entries=entries, build_s=time.perf_counter() - start)
