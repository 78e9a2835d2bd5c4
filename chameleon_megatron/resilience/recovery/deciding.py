"""The leader's decision in a recovery: who decides, what from, and the decisions it
precomputes between failures.

The lowest fresh member (it trained the current layout up to now and measured its step
time) asks the decision center and publishes the decision in the generation's store; every
member reads it there. Between steps a background thread (``Precomputer``) builds the
decisions this rank would make for likely failures, so that a failure usually finds its
decision ready (``decision_cache``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

from chameleon_megatron.megatron.plan_seams import plan_seams_refusal
from chameleon_megatron.resilience.config import ResilienceConfig
from chameleon_megatron.resilience.decision.center import (
    DecisionCandidates,
    RecoveryDecision,
    decide,
    keep_layout,
)
from chameleon_megatron.resilience.decision.feedback import Feedback
from chameleon_megatron.resilience.decision.layout import Plan
from chameleon_megatron.resilience.decision.mtbf import MtbfEstimator
from chameleon_megatron.resilience.decision.placement import NoFreshCopy, plan_refusal
from chameleon_megatron.resilience.decision.plan_return import return_to
from chameleon_megatron.resilience.decision.profile import Profile
from chameleon_megatron.resilience.decision.reroute import ReroutePlan
from chameleon_megatron.resilience.launch.nodes import node_ranks
from chameleon_megatron.resilience.recovery.decision_cache import (
    DecisionBasis,
    cache_builder,
    decision_profile,
)
from chameleon_megatron.resilience.recovery.detector import FailureDetector
from chameleon_megatron.resilience.recovery.errors import RecoveryFailed
from chameleon_megatron.resilience.recovery.precompute import Precomputer
from chameleon_megatron.resilience.recovery.regroup import Membership
from chameleon_megatron.resilience.recovery.run_state import Agreed
from chameleon_megatron.resilience.store.announce import read_failures
from chameleon_megatron.resilience.store.job_store import JobStore
from chameleon_megatron.resilience.store.waits import wait_keys
from chameleon_megatron.training.plugin import TrainerHandle

logger = logging.getLogger(__name__)

WORK_NEEDS_MEGATRON = ("Megatron-LM's evaluation and checkpoint read megatron's parallel "
                       "state: the work due runs in a megatron layout")
"""Why a work transition (``RecoveryController.leave_plan``) refuses plans."""


@dataclass(frozen=True)
class Standing:
    """Where the job stands when a decision is made (the controller's state, read once)."""

    plan: Plan
    """The plan trained now (rerouting: the kept plan, dead ranks included)."""
    reroute: ReroutePlan | None
    members: tuple[int, ...]
    """Every survivor of the last generation (spares included)."""
    active: tuple[int, ...]
    regroup_s: float | None
    """The last recovery's regroup phase (None: no recovery yet)."""
    known_failed: frozenset[int]
    cause: str
    """Why the recovery in progress happens ("failure", "join", "replan", "oom", "work",
    "back", ...)."""
    left: tuple[Plan, ReroutePlan | None] | None = None
    """The plan a work transition left, to run again (``RecoveryController.leave_plan``)."""


class Decider:
    """One rank's decisions as the leader: made at a recovery, precomputed between steps."""

    def __init__(self, *, job: JobStore, detector: FailureDetector, feedback: Feedback,
                 ft: ResilienceConfig, me: int, swap_bandwidth_Bps: float = 0.0) -> None:
        """``detector``: measures the step time; ``feedback``: the layouts' measured step
        times against their estimates (both feed the runtime profile). The others: as
        ``RecoveryController``."""
        self.job = job
        self.detector = detector
        self.feedback = feedback
        self.ft = ft
        self.me = me
        self.swap_bandwidth_Bps = swap_bandwidth_Bps
        self._seams: tuple[str | None] | None = None
        self.started_at = time.time()
        self.precompute: Precomputer[DecisionBasis, Any] = Precomputer("decision-cache")
        """Builds the decisions this rank would make for likely failures (a thread: started
        by the first request, cancelled when a recovery starts, stopped by ``close``)."""
        self._requested: DecisionBasis | None = None

    def shared(self, trainer: TrainerHandle, standing: Standing, scope: Any,
               membership: Membership, agreed: Agreed, *, timeout_s: float,
               abandoned: Callable[[], bool], on_wait: Callable[[], None]) -> RecoveryDecision:
        """The leader (the lowest fresh member) decides for everyone and publishes the
        decision in ``scope``; every member waits for it there."""
        if self.me == (agreed.fresh or membership.members)[0]:
            scope.set("decision", json.dumps(self.decide(trainer, standing, membership, agreed)))
        wait_keys(scope, ["decision"], timeout_s=timeout_s, abandoned=abandoned,
                  on_wait=on_wait)
        data = json.loads(scope.get("decision"))
        if "error" in data:
            raise RecoveryFailed(f"generation {membership.generation}: {data['error']}")
        return RecoveryDecision.from_dict(data)

    def decide(self, trainer: TrainerHandle, standing: Standing, membership: Membership,
               agreed: Agreed) -> dict[str, Any]:
        """The decision for ``membership`` as published (``{"error": ...}``: there is none),
        from the cache when it holds this failure."""
        start = time.perf_counter()
        try:
            decision, source = self._choose(trainer, standing, membership, agreed)
        except ValueError as exc:  # NoRecoveryPlan, a profile that does not fit, ...
            logger.error("no recovery plan: %s", exc)
            return {"error": str(exc)}
        out = decision.to_dict()
        out["record"] = {**out["record"], "decision_from": source,
                         "decision_s": time.perf_counter() - start}
        return out

    def _choose(self, trainer: TrainerHandle, standing: Standing, membership: Membership,
                agreed: Agreed) -> tuple[RecoveryDecision, str]:
        basis = self.basis(trainer, standing)
        new_failures = membership.failed - standing.known_failed
        if standing.cause == "back" and not new_failures and standing.left is not None:
            return return_to(standing.plan, *standing.left, alive=membership.members,
                             stale=agreed.stale, profile=self.profile(trainer, basis)), "fresh"
        if standing.cause == "work":  # a megatron layout, whoever else failed since
            basis = dataclasses.replace(basis, plans=basis.plans or WORK_NEEDS_MEGATRON)
        elif standing.cause not in ("failure", "join", "replan") and not new_failures:
            with contextlib.suppress(NoFreshCopy):  # then the center re-plans
                return keep_layout(standing.plan, standing.reroute, alive=membership.members,
                                   stale=agreed.stale, profile=self.profile(trainer, basis),
                                   cause=standing.cause), "fresh"
        profile, cands = self._cached(standing, basis, membership, agreed)
        decision = decide(standing.plan, alive=membership.members, stale=agreed.stale,
                          profile=profile or self.profile(trainer, basis),
                          d_s=self.expected_time_to_failure(), strategy=self.ft.strategy,
                          plans=basis.plans, candidates=cands, replicated=basis.replicated)
        if standing.cause == "work" and not new_failures:  # back to the plan after the work
            decision = dataclasses.replace(decision, returns_to=(standing.plan, standing.reroute))
        return decision, "fresh" if cands is None else "cache"

    def replan_wins(self, trainer: TrainerHandle, standing: Standing) -> bool:
        """Between steps while rerouting: the decision center, with the step times measured
        since the rerouting, for the same survivors: does it now choose the re-plan?"""
        members = [r for r in standing.members if r not in standing.reroute.failed_ranks]
        idle = set(standing.reroute.stopped_ranks)  # TP partners of dead ranks: spares now
        agreed = Agreed(iteration=trainer.iteration, consumed_samples=0, scheduler={},
                        fresh=tuple(r for r in members if r not in idle),
                        stale=tuple(r for r in members if r in idle))
        data = self.decide(trainer, standing,
                           Membership(0, tuple(members), frozenset()), agreed)
        return data.get("mode") not in (None, "reroute")

    def basis(self, trainer: TrainerHandle, standing: Standing) -> DecisionBasis:
        """What a decision made now is computed from (cheap: no profile is derived)."""
        user = self.ft.profile is not None  # a user profile is not calibrated
        return DecisionBasis(
            plan=standing.plan, reroute=standing.reroute,
            members=tuple(sorted(standing.members)),
            stale=tuple(sorted(set(standing.members) - set(standing.active))),
            plans=("ft.plans=false: megatron layouts only" if not self.ft.plans
                   else self._seams_refusal(trainer)
                   or plan_refusal(trainer.args, standing.plan)),
            replicated=self.ft.keep_replicas,
            step_time_s=None if user else self.detector.typical_step_time,
            regroup_s=None if user else standing.regroup_s,
            history=() if user else tuple(self.feedback.observations()))

    def _seams_refusal(self, trainer: TrainerHandle) -> str | None:
        """Why this process's megatron-core (``plan_seams``) or the job's model (its
        ``stage_builder``) cannot run plans, checked once: the basis is built between
        steps."""
        if self._seams is None:
            self._seams = (plan_seams_refusal() or trainer.stage_builder.refusal,)
        return self._seams[0]

    def profile(self, trainer: TrainerHandle, basis: DecisionBasis) -> Profile:
        return decision_profile(basis, trainer.args, path=self.ft.profile,
                                device=trainer.device,
                                swap_bandwidth_Bps=self.swap_bandwidth_Bps)

    def request(self, trainer: TrainerHandle, standing: Standing) -> None:
        """Have the background thread rebuild the decisions this rank would make for likely
        failures when what they are computed from has changed (a comparison; the work is
        the thread's)."""
        basis = self.basis(trainer, standing)
        ready = self.precompute.ready()
        if any(b is not None and b.serves(basis)
               for b in (self._requested, ready and ready[0])):
            return
        self._requested = basis
        job = self.job
        self.precompute.request(basis, cache_builder(
            basis, self.me, profile=lambda: self.profile(trainer, basis),
            nodes=lambda: node_ranks(job)))

    def cancel(self) -> None:
        """Abandon the build in progress (what is ready stays): a recovery begins."""
        self.precompute.cancel()
        self._requested = None

    def close(self) -> None:
        self.precompute.stop()

    def _cached(self, standing: Standing, basis: DecisionBasis, membership: Membership,
                agreed: Agreed) -> tuple[Profile | None, DecisionCandidates | None]:
        """The profile and candidates precomputed for this failure, if any (both None: the
        decision is computed fresh)."""
        ready = self.precompute.ready()
        if ready is None or not ready[0].serves(basis, same_members=False):
            return None, None
        cache = ready[1]
        cands = cache.lookup(plan=standing.plan, alive=membership.members, stale=agreed.stale,
                             plans=basis.plans, replicated=basis.replicated)
        return (cache.inputs.profile, cands) if cands is not None else (None, None)

    def expected_time_to_failure(self) -> float:
        """D of Eq. 8 from the prior MTBF and this job's failures (clock skew clamped)."""
        now = time.time()
        times = [min(max(f.failed_at, self.started_at), now) for f in read_failures(self.job)]
        return MtbfEstimator(prior_s=self.ft.mtbf_prior_s).expected_s(times, now, self.started_at)
