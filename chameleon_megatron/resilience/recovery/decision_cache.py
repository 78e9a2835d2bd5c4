"""The leader's decisions precomputed between failures (``decision.failure_cache``) inside a
running job: what they are computed from (``DecisionBasis``), when a cache still serves
(the same basis; the measured step time within ``STEP_TIME_TOLERANCE``), and the build the
controller's background thread runs (``Precomputer``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from chameleon_megatron.resilience.decision.calibration import Observation
from chameleon_megatron.resilience.decision.failure_cache import (
    CacheInputs,
    FailureCache,
    build_cache,
    likely_failures,
)
from chameleon_megatron.resilience.decision.layout import Plan
from chameleon_megatron.resilience.decision.profile import Profile
from chameleon_megatron.resilience.decision.reroute import ReroutePlan
from chameleon_megatron.resilience.recovery.live_profile import hardware_for, runtime_profile

STEP_TIME_TOLERANCE = 0.05
"""A cache built on a median step time within 5% of the current one still serves (with the
profile calibrated to its step time); a larger drift rebuilds it."""


@dataclass(frozen=True)
class DecisionBasis:
    """What the leader's decision is computed from, besides who died and D."""

    plan: Plan
    reroute: ReroutePlan | None
    members: tuple[int, ...]
    stale: tuple[int, ...]
    """Members holding no state now (spares)."""
    plans: str | None
    replicated: bool
    """Re-plans keep two or more pipelines where they fit (``ft.keep_replicas``)."""
    step_time_s: float | None
    regroup_s: float | None
    history: tuple[Observation, ...]
    """The last three are None/() with a user profile (which does not use them)."""

    def serves(self, now: DecisionBasis, *, same_members: bool = True) -> bool:
        """Whether a decision computed on this basis stands for one computed on ``now``;
        ``same_members=False``: whoever the members are (at a failure they are the
        survivors already; the cache's lookup checks them exactly)."""
        a, b = self.step_time_s, now.step_time_s
        close = a == b or (a is not None and b is not None
                           and abs(a - b) <= STEP_TIME_TOLERANCE * b)
        mine = self if same_members else dataclasses.replace(
            self, members=now.members, stale=now.stale)
        return close and dataclasses.replace(now, step_time_s=a) == mine


def decision_profile(basis: DecisionBasis, args: Any, *, path: str | None,
                     device: torch.device, swap_bandwidth_Bps: float) -> Profile:
    return runtime_profile(args, path=path, hardware=hardware_for(device), plan=basis.plan,
                           reroute=basis.reroute, step_time_s=basis.step_time_s,
                           regroup_s=basis.regroup_s, history=basis.history,
                           swap_bandwidth_Bps=swap_bandwidth_Bps)


def cache_builder(basis: DecisionBasis, me: int, profile: Callable[[], Profile],
                  nodes: Callable[[], Iterable[Iterable[int]]]
                  ) -> Callable[[Callable[[], bool]], FailureCache | None]:
    """The background build: the profile, then the candidates of every failure ``me`` would
    decide (each single member, each node)."""
    def build(cancelled: Callable[[], bool]) -> FailureCache | None:
        failures = likely_failures(basis.members, basis.stale, nodes(), me)
        if not failures:  # this rank decides none: no profile to derive either
            return FailureCache(inputs=None, entries={})
        inputs = CacheInputs(plan=basis.plan, members=basis.members, stale=basis.stale,
                             profile=profile(), plans=basis.plans,
                             replicated=basis.replicated)
        return build_cache(inputs, failures, cancelled)
    return build
