"""What the survivors of a failure do next: the decision center's answer as a runnable plan.

Pure: from the layout trained so far (a ``Plan`` over launch ranks), who is alive, whose state
is stale and a profile, ``decide`` builds both candidates (rerouting, re-plan restricted to
uniform layouts), scores them (Eq. 8), and returns a ``RecoveryDecision``: the megatron layout
and the world-rank order of the active survivors, the spares, the restorer's transfer list,
whether the job must fall back to its checkpoint, and the decision record. Only the uniform
re-plan is executable in this runtime; when rerouting wins the score, the re-plan is executed
and the record says why.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from chameleon_megatron.resilience.candidates import (
    REPLAN, REROUTE, reroute_candidate, replan_candidate,
)
from chameleon_megatron.resilience.layout import (
    Pipeline, Plan, Stage, UniformLayout, contiguous_layers,
)
from chameleon_megatron.resilience.perf_model import unit_cost
from chameleon_megatron.resilience.planner import Planner, SearchOptions
from chameleon_megatron.resilience.profile import Profile
from chameleon_megatron.resilience.restorer_plan import Holdings, Transfer, unit_order
from chameleon_megatron.resilience.selector import NoFeasibleCandidate, Strategy, select

CHECKPOINT = "checkpoint"


class NoRecoveryPlan(ValueError):
    """No layout can be trained by the survivors (e.g. no intact tensor-parallel group)."""


@dataclass(frozen=True)
class RecoveryDecision:
    """The layout to rebuild and how state gets there; identical on every member."""

    layout: UniformLayout
    active: tuple[int, ...]
    """Launch ranks of the new world, in world-rank order."""
    spares: tuple[int, ...]
    """Survivors without a slot: they wait for the next re-plan."""
    transfers: tuple[Transfer, ...]
    """The restorer's list (empty when falling back to the checkpoint)."""
    fallback: str | None
    """``"checkpoint"`` when some state has no surviving copy, else None."""
    estimated_step_s: float | None
    """The estimator's step time of the new layout."""
    rng_donor: Mapping[int, int] = field(default_factory=dict)
    """Active launch rank -> the member whose RNG streams it continues."""
    record: Mapping[str, Any] = field(default_factory=dict)
    """Decision record: D, B, both candidates, the choice, what was executed and why."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "layout": [self.layout.tp, self.layout.pp, self.layout.dp],
            "active": list(self.active), "spares": list(self.spares),
            "transfers": [[t.src, t.dst, t.layer, t.kind, t.bytes] for t in self.transfers],
            "fallback": self.fallback, "estimated_step_s": self.estimated_step_s,
            "rng_donor": [[r, d] for r, d in self.rng_donor.items()], "record": self.record,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RecoveryDecision:
        tp, pp, dp = d["layout"]
        return cls(layout=UniformLayout(tp=tp, pp=pp, dp=dp), active=tuple(d["active"]),
                   spares=tuple(d["spares"]),
                   transfers=tuple(Transfer(*t) for t in d["transfers"]),
                   fallback=d["fallback"], estimated_step_s=d["estimated_step_s"],
                   rng_donor={r: dn for r, dn in d["rng_donor"]}, record=d["record"])


def uniform_plan(layout: UniformLayout, active: Sequence[int], num_layers: int,
                 microbatches: int) -> Plan:
    """``layout`` as a Plan whose ranks are the launch ranks ``active`` (world-rank order)."""
    if len(active) != layout.world_size:
        raise ValueError(f"{len(active)} active ranks for a layout of {layout.world_size}")
    plan = layout.to_plan(num_layers, microbatches)
    pipes = tuple(
        Pipeline(stages=tuple(Stage(layers=st.layers, ranks=tuple(active[r] for r in st.ranks))
                              for st in p.stages), microbatches=p.microbatches)
        for p in plan.pipelines
    )
    return Plan(num_layers=num_layers, pipelines=pipes, vpp=plan.vpp)


def world_order(plan: Plan) -> tuple[UniformLayout, tuple[int, ...]]:
    """The megatron layout of a uniform plan and its ranks in world-rank order (megatron's
    tp-dp-pp order: pipeline j is data-parallel rank j, stage s pipeline rank s)."""
    depth = plan.pipelines[0].depth
    even = list(contiguous_layers([plan.num_layers // depth] * depth))
    if plan.vpp != 1 or not plan.is_uniform or plan.num_layers % depth or \
            [st.layers for st in plan.pipelines[0].stages] != even:
        raise ValueError(f"plan {plan.describe()} is not a uniform megatron layout "
                         "(equal depths, even layer split, vpp 1)")
    layout = UniformLayout(tp=plan.tp, pp=depth, dp=len(plan.pipelines))
    order = [0] * layout.world_size
    for j, s, i, rank in plan.slots():
        order[layout.rank(i, j, s)] = rank
    return layout, tuple(order)


def recovery_units(current: Plan, alive: Iterable[int]) -> list[tuple[int, ...]]:
    """The tensor-parallel groups a re-plan may use: every intact group of ``current``, then
    the other survivors (spares, partners of dead ranks) in groups of tp, ascending."""
    alive = set(alive)
    intact = [st.ranks for p in current.pipelines for st in p.stages if alive.issuperset(st.ranks)]
    taken = {r for g in intact for r in g}
    rest = sorted(alive - taken)
    tp = current.tp
    return intact + [tuple(rest[k:k + tp]) for k in range(0, len(rest) - tp + 1, tp)]


def rng_donors(plan: Plan, holdings: Holdings) -> dict[int, int]:
    """Whose RNG streams each rank of ``plan`` continues: a holder of the first layer of its
    new stage at its TP index (itself when it holds it). Holders of one layer share their
    stage's streams (seeded per pipeline stage and TP rank, consumed alike by every
    data-parallel replica), so a new TP group stays consistent. Ranks whose first layer has
    no holder keep their own streams."""
    donors = {}
    for j, s, i, rank in plan.slots():
        first = plan.pipelines[j].stages[s].layers[0]
        holders = sorted(r for r, (index, units) in holdings.items()
                         if index == i and first in units)
        if holders:
            donors[rank] = rank if rank in holders else holders[0]
    return donors


def local_copies(plan: Plan, holdings: Holdings, profile: Profile) -> tuple[Transfer, ...]:
    """Transfers from each rank to itself for the state it keeps: the restorer leaves kept
    state in place, but this runtime rebuilds the model, so it is copied from the old one."""
    out = []
    for j, s, i, rank in plan.slots():
        index, owned = holdings.get(rank, (i, ()))
        for unit in plan.pipelines[j].stage_units(s):
            if index == i and unit in owned:
                cost = unit_cost(profile, unit)
                out += [Transfer(rank, rank, unit, "params", cost.param_bytes),
                        Transfer(rank, rank, unit, "optimizer", cost.optimizer_bytes)]
    return tuple(out)


def decide(current: Plan, *, alive: Sequence[int], stale: Iterable[int], profile: Profile,
           d_s: float, strategy: Strategy = "adaptive",
           time_limit_s: float | None = 2.0) -> RecoveryDecision:
    """Both candidates for the survivors ``alive`` of ``current``, the choice, and the plan
    executed (the uniform re-plan). ``stale`` members are alive but hold no usable state."""
    alive_set, stale_set = set(alive), set(stale)
    dead = set(current.ranks()) - alive_set
    holdings = {r: h for r, h in current.holdings().items()
                if r in alive_set and r not in stale_set}
    planner = Planner(profile, SearchOptions(uniform=True, time_limit_s=time_limit_s))
    reroute = reroute_candidate(current, dead, planner)
    replan = replan_candidate(holdings, recovery_units(current, alive_set), planner)
    try:
        selected = select([reroute, replan], d_s=d_s, batch=profile.global_batch_size,
                          strategy=strategy)
        record, choice = dict(selected.record), selected.chosen.name
    except NoFeasibleCandidate as exc:
        record, choice = dict(exc.record), None
    if replan.plan is None or replan.restore is None:
        raise NoRecoveryPlan(f"no layout for the survivors {sorted(alive_set)}: {replan.reason}")
    restore = replan.restore
    fallback = CHECKPOINT if restore.unrecoverable else None
    layout, active = world_order(replan.plan)
    record.update(
        executed=REPLAN, executed_reason=_reason(choice, fallback), fallback=fallback,
        lost=sorted({u for u, _ in restore.lost}, key=unit_order),
        stale=sorted(stale_set), layout_before=current.describe(),
        transfers=0 if fallback else len(restore.transfers),
        bytes_planned=0.0 if fallback else restore.bytes_moved(),
    )
    return RecoveryDecision(
        layout=layout, active=active, spares=tuple(sorted(alive_set - set(active))),
        transfers=() if fallback else
        local_copies(replan.plan, holdings, profile) + restore.transfers, fallback=fallback,
        estimated_step_s=replan.t_step_s, rng_donor=rng_donors(replan.plan, holdings),
        record=record,
    )


def _reason(choice: str | None, fallback: str | None) -> str:
    if fallback:
        return "some state has no surviving copy: the re-planned layout loads the last checkpoint"
    if choice == REROUTE:
        return "rerouting wins the score but is not executable yet: executing the re-plan"
    if choice is None:
        return "no candidate is usable by the score: executing the re-plan anyway"
    return "chosen by score"
