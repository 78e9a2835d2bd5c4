"""In-memory recovery strategies: Chameleon (adaptive), always-reroute (Recycle-like) and
always-re-plan (Oobleck-like). All three use the same candidates, costs and trace.

At a failure the candidates are rerouting around every unavailable stage of the current
plan (transition 0) and a re-plan over the intact TP groups (restorer bytes / bandwidth +
regroup). At a repair they are staying as is, re-admitting repaired ranks into their
slots of the current plan (their state is copied back from peers, then regroup), and a
re-plan. Adaptive scores them by Eq. 8 with D from its MTBF estimator; always-reroute
re-admits when a repair makes a slot whole and falls back to a re-plan when rerouting is
impossible; always-re-plan re-plans whenever the set of intact TP groups changes. When
no candidate is feasible (state lost) a strategy restarts from its last (asynchronous)
checkpoint on the best plan over the intact groups.
"""

from __future__ import annotations

from typing import Literal, Sequence

from chameleon_megatron.resilience.decision.candidates import (
    REPLAN,
    REROUTE,
    Candidate,
    replan_candidate,
    reroute_candidate,
)
from chameleon_megatron.resilience.decision.layout import Plan
from chameleon_megatron.resilience.decision.mtbf import MtbfEstimator
from chameleon_megatron.resilience.decision.perf_model import plan_step
from chameleon_megatron.resilience.decision.planner import Planner
from chameleon_megatron.resilience.decision.restorer import (
    assign_slots,
    live_holdings,
    restore_plan,
    transition_s,
)
from chameleon_megatron.resilience.decision.selector import NoFeasibleCandidate, select
from chameleon_megatron.sim.engine import Reaction
from chameleon_megatron.sim.traces import Event

Policy = Literal["adaptive", "reroute", "replan"]
STAY = "stay"
READMIT = "readmit"


class InMemoryStrategy:
    """State of one in-memory strategy during a replay."""

    def __init__(self, name: str, policy: Policy, *, plan: Plan, units: Sequence[tuple[int, ...]],
                 planner: Planner, estimator: MtbfEstimator, detect_s: float,
                 restart_s: float) -> None:
        self.name, self.policy = name, policy
        self.plan = plan
        self.units = tuple(units)
        self.planner = planner
        self.estimator = estimator
        self.detect_s, self.restart_s = detect_s, restart_s
        self.down: set[int] = set()
        self.stale: set[int] = set()  # repaired ranks of the plan that hold no state yet
        self.failures: list[float] = []
        self._step: float | None = plan_step(plan, planner.profile).t_step_s

    def step_s(self) -> float | None:
        return self._step

    # -- candidates ---------------------------------------------------------------------
    def _healthy(self) -> list[tuple[int, ...]]:
        return [g for g in self.units if not self.down.intersection(g)]

    def _replan(self) -> Candidate:
        holdings = live_holdings(self.plan, self.down | self.stale)
        return replan_candidate(holdings, self._healthy(), self.planner)

    def _readmit(self) -> Candidate:
        """Copy state back to the repaired ranks of the plan and stop rerouting around them."""
        restore = restore_plan(live_holdings(self.plan, self.down | self.stale), self.plan,
                               self.planner.profile)
        rest = reroute_candidate(self.plan, self.down, self.planner)
        if not rest.feasible or restore.unrecoverable:
            return Candidate(name=READMIT, feasible=False, reason=rest.reason)
        return Candidate(name=READMIT, feasible=True, reason="ok", t_step_s=rest.t_step_s,
                         t_transition_s=transition_s(restore, self.planner.profile), plan=self.plan)

    def _choose(self, cands: list[Candidate], forced: list[str],
                now_s: float) -> tuple[Candidate | None, dict]:
        """Eq. 8 for the adaptive policy; else the first feasible of ``forced``."""
        d_s = self.estimator.expected_s(self.failures, now_s)
        batch = self.planner.profile.global_batch_size
        if self.policy == "adaptive":
            try:
                decision = select(cands, d_s=d_s, batch=batch)
                return decision.chosen, decision.record
            except NoFeasibleCandidate as exc:
                return None, exc.record
        for name in forced:
            for c in cands:
                if c.name == name and c.feasible:
                    return c, {"choice": name, "t_step_s": c.t_step_s,
                               "t_transition_s": c.t_transition_s}
        return None, {"choice": None}

    # -- events -------------------------------------------------------------------------
    def react(self, event: Event, now_s: float) -> Reaction:
        in_plan = event.rank in set(self.plan.ranks())
        if event.kind == "fail":
            self.down.add(event.rank)
            self.stale.discard(event.rank)
            self.failures.append(now_s)
            if not in_plan and self._step is not None:
                return Reaction(downtime_s=0.0, reset_progress=False)
            cands = [reroute_candidate(self.plan, self.down | self.stale, self.planner),
                     self._replan()]
            forced = {"reroute": [REROUTE, REPLAN], "replan": [REPLAN], "adaptive": []}
            return self._apply(*self._choose(cands, forced[self.policy], now_s),
                               self.detect_s, event)
        healthy_before = len(self._healthy())
        self.down.discard(event.rank)
        if in_plan:
            self.stale.add(event.rank)
        if self._step is None:
            return self._restart(event, rollback=False)
        stay = Candidate(name=STAY, feasible=True, reason="ok", t_step_s=self._step,
                         t_transition_s=0.0, plan=self.plan)
        cands = [stay, self._readmit(), self._replan()]
        whole = any(self.stale.intersection(st.ranks) and not self.down.intersection(st.ranks)
                    for p in self.plan.pipelines for st in p.stages)
        grew = len(self._healthy()) > healthy_before
        forced = {"reroute": [READMIT, STAY] if whole else [STAY],
                  "replan": [REPLAN, STAY] if grew else [STAY], "adaptive": []}
        return self._apply(*self._choose(cands, forced[self.policy], now_s), 0.0, event)

    def _apply(self, chosen: Candidate | None, record: dict, detect_s: float,
               event: Event) -> Reaction:
        record = {"kind": event.kind, "rank": event.rank, **record}
        if chosen is None:
            return self._restart(event, rollback=True, record=record)
        if chosen.name == STAY:
            return Reaction(downtime_s=0.0, reset_progress=False, record=record)
        if chosen.name in (REPLAN, READMIT):
            self.stale.clear()
        self.plan = chosen.plan  # type: ignore[assignment]
        self._step = chosen.t_step_s
        return Reaction(downtime_s=detect_s + (chosen.t_transition_s or 0.0), reset_progress=True,
                        record=record)

    def _restart(self, event: Event, *, rollback: bool, record: dict | None = None) -> Reaction:
        """Reload the last checkpoint on the best plan over the intact TP groups."""
        healthy = self._healthy()
        result = self.planner.search(len(healthy)) if healthy else None
        self.stale.clear()
        record = {**(record or {"kind": event.kind, "rank": event.rank}), "choice": "restart"}
        if result is None or result.pipelines is None:
            self._step = None
            return Reaction(downtime_s=0.0, reset_progress=True, rollback=rollback, record=record)
        self.plan = assign_slots(result.pipelines, healthy, {}, self.planner.profile)
        self._step = plan_step(self.plan, self.planner.profile).t_step_s
        return Reaction(downtime_s=self.detect_s + self.restart_s, reset_progress=True,
                        rollback=rollback, record=record)
