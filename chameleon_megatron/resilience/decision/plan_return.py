"""The way back to a plan after Megatron-LM's evaluation or checkpoint ran in a megatron
layout (``RecoveryController.leave_plan``): the plan the work transition left runs again,
its state moved in from the layout trained since, as a re-plan's is. Pure."""

from __future__ import annotations

from typing import Iterable, Sequence

from chameleon_megatron.resilience.decision.center import (
    NoRecoveryPlan,
    RecoveryDecision,
    local_copies,
    rng_donors,
)
from chameleon_megatron.resilience.decision.layout import Plan
from chameleon_megatron.resilience.decision.placement import stage_major_order
from chameleon_megatron.resilience.decision.profile import Profile
from chameleon_megatron.resilience.decision.reroute import ReroutePlan
from chameleon_megatron.resilience.decision.restorer import (
    allreduce_groups,
    allreduce_rounds,
    live_holdings,
    restore_plan,
)


def return_to(current: Plan, left: Plan, reroute: ReroutePlan | None, *,
              alive: Sequence[int], stale: Iterable[int], profile: Profile) -> RecoveryDecision:
    """Move from ``current`` (the megatron layout the work ran in) back to ``left`` (a
    heterogeneous plan, or with ``reroute`` the rerouting around its dead ranks). Raises
    NoRecoveryPlan when a rank of ``left`` is gone or some of its state has no holder."""
    alive_set = set(alive)
    stopped = set(reroute.stopped_ranks) if reroute is not None else set()
    missing = set(left.ranks()) - stopped - alive_set
    if missing:
        raise NoRecoveryPlan(f"ranks {sorted(missing)} of the plan left are gone")
    holdings = live_holdings(current, set(current.ranks()) - alive_set | set(stale))
    restore = restore_plan(holdings, left, profile)
    moves = tuple(t for t in local_copies(left, holdings, profile) + restore.transfers
                  if t.dst not in stopped)  # a dead rank's stage runs elsewhere
    if restore.lost:  # a megatron layout holds every unit: only a bug gets here
        raise NoRecoveryPlan(f"no rank of {current.describe()} holds {restore.lost[0]}")
    active = tuple(r for r in stage_major_order(left) if r not in stopped)
    mode = "reroute" if reroute is not None else "hetero"
    record = {"cause": "back", "executed": "return", "mode": mode,
              "executed_reason": "the plan a checkpoint or an evaluation left runs again",
              "fallback": None, "layout_before": current.describe(),
              "layout_after": left.describe(), "transfers": sum(t.src != t.dst for t in moves),
              "bytes_planned": sum(t.bytes for t in moves if t.src != t.dst)}
    return RecoveryDecision(
        mode=mode, plan=left, active=active, spares=tuple(sorted(alive_set - set(active))),
        transfers=moves, fallback=None, estimated_step_s=None, reroute=reroute,
        sync_groups=allreduce_groups(left, profile), sync_rounds=allreduce_rounds(left, profile),
        rng_donor=rng_donors(left, holdings), record=record)
