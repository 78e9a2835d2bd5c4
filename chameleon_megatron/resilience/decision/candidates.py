"""Both recovery candidates for a failure: data rerouting and a re-planned layout."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from chameleon_megatron.resilience.decision.layout import Plan
from chameleon_megatron.resilience.decision.perf_model import plan_step
from chameleon_megatron.resilience.decision.planner import Planner
from chameleon_megatron.resilience.decision.reroute import Infeasible, ReroutePlan, plan_reroute
from chameleon_megatron.resilience.decision.restorer import (
    Holdings,
    RestorePlan,
    assign_slots,
    live_holdings,
    restore_plan,
    transition_s,
    unit_order,
)

REROUTE = "reroute"
REPLAN = "replan"


@dataclass(frozen=True)
class Candidate:
    """One way to continue; infeasible ones carry the reason and no times."""

    name: str
    feasible: bool
    reason: str
    t_step_s: float | None = None
    t_transition_s: float | None = None
    plan: Plan | None = None
    """Layout trained after the transition (for rerouting: the kept layout)."""
    reroute: ReroutePlan | None = None
    restore: RestorePlan | None = None
    complete: bool = True
    """False when the plan search was stopped by its time limit."""

    def summary(self) -> dict[str, Any]:
        """JSON-serialisable facts for decision records."""
        out: dict[str, Any] = {
            "name": self.name, "feasible": self.feasible, "reason": self.reason,
            "t_step_s": self.t_step_s, "t_transition_s": self.t_transition_s,
            "plan": self.plan.describe() if self.plan else None,
        }
        if self.restore is not None:
            out["bytes_moved"] = self.restore.bytes_moved()
            out["allreduce_rounds"] = len(self.restore.rounds)
        if self.name == REPLAN:
            out["search_complete"] = self.complete
        return out


@dataclass(frozen=True)
class Candidates:
    failed_ranks: tuple[int, ...]
    reroute: Candidate
    replan: Candidate

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter((self.reroute, self.replan))


def broken_units(units: Sequence[tuple[int, ...]], dead: set[int]) -> list[int]:
    """Indices of the TP groups that lost at least one rank."""
    return [k for k, group in enumerate(units) if dead.intersection(group)]


def reroute_candidate(current: Plan, dead: set[int], planner: Planner) -> Candidate:
    try:
        rp = plan_reroute(current, dead, planner.profile)
    except Infeasible as exc:
        return Candidate(name=REROUTE, feasible=False, reason=str(exc))
    est = rp.estimate(planner.profile)
    if not est.fits_memory:
        return Candidate(name=REROUTE, feasible=False, reason=(
            f"peers need {est.peak_memory_bytes:.3g} B, more than device memory"))
    return Candidate(name=REROUTE, feasible=True, reason="ok", t_step_s=est.t_step_s,
                     t_transition_s=0.0, plan=current, reroute=rp)


def replan_candidate(holdings: Holdings, healthy: Sequence[tuple[int, ...]],
                     planner: Planner) -> Candidate:
    """The fastest plan over the ``healthy`` TP groups, filled from ``holdings``."""
    if not healthy:
        return Candidate(name=REPLAN, feasible=False, reason="no intact TP group left")
    result = planner.search(len(healthy))
    if result.pipelines is None:
        return Candidate(name=REPLAN, feasible=False, reason=result.reason,
                         complete=result.complete)
    plan = assign_slots(result.pipelines, healthy, holdings, planner.profile)
    restore = restore_plan(holdings, plan, planner.profile)
    t_step = plan_step(plan, planner.profile).t_step_s
    common = dict(name=REPLAN, t_step_s=t_step, plan=plan, restore=restore,
                  complete=result.complete)
    if restore.unrecoverable:
        lost = sorted({u for u, _ in restore.lost}, key=unit_order)
        return Candidate(feasible=False, reason=f"no surviving copy of {lost}: restart from "
                         "the last checkpoint", **common)
    return Candidate(feasible=True, reason="ok",
                     t_transition_s=transition_s(restore, planner.profile), **common)


def make_candidates(current: Plan, dead_ranks: Iterable[int], planner: Planner,
                    units: Sequence[tuple[int, ...]] | None = None) -> Candidates:
    """Both candidates after ``dead_ranks`` failed while training ``current``.

    ``units``: every TP group the job may use (spares included); default: the stages of
    ``current``. A group with a dead rank is not used by the re-plan, but its live ranks
    still serve their shards as transfer sources.
    """
    dead = set(dead_ranks)
    groups = units if units is not None else [
        st.ranks for p in current.pipelines for st in p.stages]
    broken = set(broken_units(groups, dead))
    healthy = [g for k, g in enumerate(groups) if k not in broken]
    return Candidates(
        failed_ranks=tuple(sorted(dead)),
        reroute=reroute_candidate(current, dead, planner),
        replan=replan_candidate(live_holdings(current, dead), healthy, planner),
    )
