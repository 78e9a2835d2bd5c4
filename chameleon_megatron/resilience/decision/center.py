"""What the survivors of a failure do next: the decision center's answer as a runnable plan.

Pure: from the plan trained so far (over launch ranks; it may already be rerouting around
dead ranks), who is alive, whose state is stale and a profile, ``decide`` builds both
candidates (rerouting, re-plan), scores them (Eq. 8) and returns a ``RecoveryDecision``: how
the next layout runs (``mode``), its plan and the world-rank order of its active ranks, the
spares, the restorer's transfer list, the gradient-sync groups of a plan, whether the job
must fall back to its checkpoint, and the decision record. Modes:

* ``megatron``: a uniform layout, trained by megatron's own parallel state;
* ``hetero``: pipelines of different depths, splits or shares (``runtime``);
* ``reroute``: the current plan kept, the dead ranks' microbatches rerouted (``rerouted``).

The last two need a model the plan runtime executes (``placement.check_plan_runtime``);
without one the re-plan is restricted to uniform layouts and rerouting is not executed.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Iterable, Literal, Mapping, Sequence

from chameleon_megatron.resilience.decision.candidates import (
    REPLAN,
    REROUTE,
    Candidate,
    replan_candidate,
    reroute_candidate,
)
from chameleon_megatron.resilience.decision.layout import (
    Pipeline,
    Plan,
    Stage,
    StateUnit,
    UniformLayout,
    contiguous_layers,
)
from chameleon_megatron.resilience.decision.perf_model import StepEstimate, plan_step, unit_cost
from chameleon_megatron.resilience.decision.placement import (
    NoFreshCopy,
    kept_in_place,
    stage_major_order,
)
from chameleon_megatron.resilience.decision.planner import Planner, SearchOptions
from chameleon_megatron.resilience.decision.profile import Profile
from chameleon_megatron.resilience.decision.reroute import Reroute, ReroutePlan
from chameleon_megatron.resilience.decision.restorer import (
    AllReduceGroup,
    Holdings,
    Transfer,
    allreduce_groups,
    allreduce_rounds,
    unit_order,
)
from chameleon_megatron.resilience.decision.selector import NoFeasibleCandidate, Strategy, select

CHECKPOINT = "checkpoint"
Mode = Literal["megatron", "hetero", "reroute"]


class NoRecoveryPlan(ValueError):
    """No layout can be trained by the survivors (e.g. no intact tensor-parallel group)."""


@dataclass(frozen=True)
class RecoveryDecision:
    """The layout to build and how state gets there; identical on every member."""

    mode: Mode
    plan: Plan
    """The plan trained next, over launch ranks (rerouting: the kept plan, dead ranks in)."""
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
    reroute: ReroutePlan | None = None
    """Mode ``reroute``: who takes the dead ranks' microbatches."""
    sync_groups: tuple[AllReduceGroup, ...] = ()
    sync_rounds: tuple[tuple[int, ...], ...] = ()
    """Modes ``hetero``/``reroute``: the restorer's gradient all-reduce groups and rounds."""
    rng_donor: Mapping[int, int] = field(default_factory=dict)
    """Active launch rank -> the member whose RNG streams it continues."""
    swap_budgets: Mapping[int, float] = field(default_factory=dict)
    """Active launch rank -> the share of its stage's no-swap activation peak its swap
    subsystem may keep on the device (only ranks whose stage must swap to fit)."""
    record: Mapping[str, Any] = field(default_factory=dict)
    """Decision record: D, B, both candidates, the choice, what was executed and why."""
    returns_to: tuple[Plan, ReroutePlan | None] | None = None
    """A work transition's (a megatron layout for Megatron-LM's evaluation or checkpoint):
    the plan it left, and its rerouting, which run again once the work is done."""

    @property
    def layout(self) -> UniformLayout:
        """Mode ``megatron``: the layout megatron builds."""
        if self.mode != "megatron":
            raise ValueError(f"a {self.mode} plan has no megatron layout")
        return world_order(self.plan)[0]

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode, "plan": self.plan.to_dict(),
            "active": list(self.active), "spares": list(self.spares),
            "transfers": [[t.src, t.dst, t.layer, t.kind, t.bytes] for t in self.transfers],
            "fallback": self.fallback, "estimated_step_s": self.estimated_step_s,
            "reroute": None if self.reroute is None else self.reroute.to_dict(),
            "sync_groups": [[list(g.ranks), list(g.layers), g.bytes] for g in self.sync_groups],
            "sync_rounds": [list(r) for r in self.sync_rounds],
            "rng_donor": [[r, d] for r, d in self.rng_donor.items()],
            "swap_budgets": [[r, f] for r, f in self.swap_budgets.items()],
            "record": self.record,
            "returns_to": None if self.returns_to is None else {
                "plan": self.returns_to[0].to_dict(),
                "reroute": None if self.returns_to[1] is None else self.returns_to[1].to_dict()},
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RecoveryDecision:
        plan = Plan.from_dict(d["plan"])
        return cls(
            mode=d["mode"], plan=plan, active=tuple(d["active"]), spares=tuple(d["spares"]),
            transfers=tuple(Transfer(*t) for t in d["transfers"]), fallback=d["fallback"],
            estimated_step_s=d["estimated_step_s"],
            reroute=None if d["reroute"] is None else reroute_from_dict(plan, d["reroute"]),
            sync_groups=tuple(AllReduceGroup(tuple(r), tuple(u), b)
                              for r, u, b in d["sync_groups"]),
            sync_rounds=tuple(tuple(r) for r in d["sync_rounds"]),
            rng_donor={r: dn for r, dn in d["rng_donor"]},
            swap_budgets={r: f for r, f in d.get("swap_budgets", [])}, record=d["record"],
            returns_to=_returns_to(d.get("returns_to")))


def _returns_to(d: Mapping[str, Any] | None) -> tuple[Plan, ReroutePlan | None] | None:
    if d is None:
        return None
    plan = Plan.from_dict(d["plan"])
    return plan, None if d["reroute"] is None else reroute_from_dict(plan, d["reroute"])


def reroute_from_dict(plan: Plan, d: Mapping[str, Any]) -> ReroutePlan:
    return ReroutePlan(plan=plan, failed_ranks=tuple(d["failed_ranks"]), reroutes=tuple(
        Reroute(pipeline=r["pipeline"], stage=r["stage"],
                targets=tuple(tuple(t) for t in r["targets"])) for r in d["reroutes"]))


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


@dataclass(frozen=True)
class DecisionCandidates:
    """Both candidates for one set of survivors: the expensive part of a decision (plan
    search, restorer), which ``decide`` turns into a choice at the failure (cheap)."""

    reroute: Candidate
    replan: Candidate


def make_planner(profile: Profile, *, uniform: bool, time_limit_s: float | None,
                 replicated: bool = True) -> Planner:
    """A recovery's planner; ``replicated``: its layouts keep a copy of every stage's state
    where one fits (``ft.keep_replicas``)."""
    return Planner(profile, SearchOptions(uniform=uniform, replicated=replicated,
                                          time_limit_s=time_limit_s))


def decision_candidates(current: Plan, *, alive: Iterable[int], stale: Iterable[int],
                        profile: Profile, time_limit_s: float | None = 2.0,
                        plans: str | None = None,
                        planners: tuple[Planner, Planner] | None = None,
                        replicated: bool = True) -> DecisionCandidates:
    """The rerouting and re-plan candidates ``decide`` scores for the survivors ``alive``.
    ``planners``: (the one for ``plans``, the uniform one), shared between calls on the
    same profile so that their searches share work (default: new ones)."""
    alive_set, stale_set = set(alive), set(stale)
    dead = set(current.ranks()) - alive_set
    holdings = _holdings(current, alive_set, stale_set)
    planner = planners[0] if planners else make_planner(
        profile, uniform=plans is not None, time_limit_s=time_limit_s, replicated=replicated)
    reroute = reroute_candidate(current, dead, planner)
    replan = replan_candidate(holdings, recovery_units(current, alive_set), planner)
    if replan.restore is not None and replan.restore.unrecoverable and \
            not _is_megatron(replan.plan):  # a checkpoint loads into megatron layouts only
        uniform = planners[1] if planners else make_planner(
            profile, uniform=True, time_limit_s=time_limit_s, replicated=replicated)
        replan = replan_candidate(holdings, recovery_units(current, alive_set), uniform)
    return DecisionCandidates(reroute=reroute, replan=replan)


def decide(current: Plan, *, alive: Sequence[int], stale: Iterable[int], profile: Profile,
           d_s: float, strategy: Strategy = "adaptive", time_limit_s: float | None = 2.0,
           plans: str | None = None,
           candidates: DecisionCandidates | None = None,
           replicated: bool = True) -> RecoveryDecision:
    """Both candidates for the survivors ``alive`` of ``current``, the choice, and how it
    runs. ``stale`` members are alive but hold no usable state (spares, joiners). ``plans``:
    None when the plan runtime executes this model, else why not (then only uniform
    re-plans are made and rerouting is scored but not executed). ``candidates``: computed
    beforehand by ``decision_candidates`` on these same inputs (a precomputed failure)."""
    alive_set, stale_set = set(alive), set(stale)
    holdings = _holdings(current, alive_set, stale_set)
    cands = candidates or decision_candidates(current, alive=alive_set, stale=stale_set,
                                              profile=profile, time_limit_s=time_limit_s,
                                              plans=plans, replicated=replicated)
    reroute, replan = cands.reroute, cands.replan
    try:
        selected = select([reroute, replan], d_s=d_s, batch=profile.global_batch_size,
                          strategy=strategy)
        record, choice = dict(selected.record), selected.chosen.name
    except NoFeasibleCandidate as exc:
        record, choice = dict(exc.record), None
    kept = choice == REROUTE and plans is None and reroute.reroute is not None
    decision = None
    if kept:
        try:
            decision = _kept(current, reroute.reroute, reroute.t_step_s, holdings, profile,
                             alive_set, stale_set)
        except NoFreshCopy:  # a unit with no fresh copy: the re-plan falls back
            kept = False
    if decision is None:
        decision = _replanned(replan, holdings, profile, alive_set)
    record.update(
        executed=REROUTE if kept else REPLAN,
        mode=decision.mode,
        executed_reason=_reason(choice, decision.fallback, plans),
        fallback=decision.fallback, stale=sorted(stale_set), layout_before=current.describe(),
        layout_after=decision.plan.describe(),
        transfers=sum(t.src != t.dst for t in decision.transfers),
        bytes_planned=sum(t.bytes for t in decision.transfers if t.src != t.dst),
    )
    if not kept:
        record["lost"] = sorted({u for u, _ in replan.restore.lost}, key=unit_order)
    est = reroute.reroute.estimate(profile) if kept else plan_step(decision.plan, profile)
    budgets, record["swap"] = swap_budgets(decision.plan, est)
    return dataclasses.replace(decision, record=record, swap_budgets=budgets)


def _holdings(current: Plan, alive: set[int], stale: set[int]) -> Holdings:
    """What the fresh survivors hold: the sources of a new layout's state."""
    return {r: h for r, h in current.holdings().items() if r in alive and r not in stale}


def swap_budgets(plan: Plan, est: StepEstimate) -> tuple[dict[int, float], list[dict]]:
    """The activation budget of each rank on a stage that must swap to fit (as the share of
    its no-swap peak it may keep), and one record entry per such stage."""
    budgets: dict[int, float] = {}
    entries = []
    for (j, s), sw in sorted(est.swaps.items()):
        ranks = plan.pipelines[j].stages[s].ranks
        budgets.update(dict.fromkeys(ranks, sw.fraction))
        entries.append({"pipeline": j, "stage": s, "ranks": list(ranks),
                        "budget_bytes": sw.budget_bytes, "fraction": sw.fraction,
                        "swapped_bytes": sw.swapped_bytes, "stall_s": sw.stall_s})
    return budgets, entries


def keep_layout(current: Plan, reroute: ReroutePlan | None, *, alive: Sequence[int],
                stale: Iterable[int] = (), profile: Profile, cause: str) -> RecoveryDecision:
    """Every member redoes an abandoned step in the layout trained now (``reroute``: the
    rerouting in use, if any), as nobody failed since (a rank ran out of memory, say): no
    search; state crosses the network only to ``stale`` members (they had not applied the
    step the others resume after). Raises NoFreshCopy when one cannot be refreshed."""
    alive_set, stale_set = set(alive), set(stale)
    holdings = _holdings(current, alive_set, stale_set)
    decision = _kept(current, reroute, None, holdings, profile, alive_set, stale_set)
    record = {"cause": cause, "executed": "keep", "mode": decision.mode,
              "executed_reason": f"{cause}: every rank redoes the step in the same layout",
              "fallback": None, "layout_before": current.describe(),
              "layout_after": current.describe(), "transfers": 0, "bytes_planned": 0}
    return dataclasses.replace(decision, record=record)


def _kept(current: Plan, rp: ReroutePlan | None, t_step_s: float | None, holdings: Holdings,
          profile: Profile, alive: set[int], stale: set[int]) -> RecoveryDecision:
    """Keep ``current``; the survivors keep their stages (copied into the plan runtime; a
    stale one's from a fresh peer). Without dead ranks (new members were offered, but
    keeping the layout scores better) the plan runs as it did: a megatron layout natively,
    a heterogeneous one as a plan."""
    dead = set(rp.stopped_ranks) if rp is not None else set()
    mode: Mode = "reroute"
    active = tuple(r for r in stage_major_order(current) if r not in dead)
    if not dead:
        try:
            mode, active = "megatron", world_order(current)[1]
        except ValueError:
            mode = "hetero"
    plan_groups = mode != "megatron"
    return RecoveryDecision(
        mode=mode, plan=current, active=active, spares=tuple(sorted(alive - set(active))),
        transfers=kept_in_place(current, dead, stale, partial(_unit_bytes, profile)),
        fallback=None,
        estimated_step_s=t_step_s, reroute=rp if mode == "reroute" else None,
        sync_groups=allreduce_groups(current, profile) if plan_groups else (),
        sync_rounds=allreduce_rounds(current, profile) if plan_groups else (),
        rng_donor=rng_donors(current, holdings))


def _unit_bytes(profile: Profile, unit: StateUnit, kind: str) -> float:
    cost = unit_cost(profile, unit)
    return cost.param_bytes if kind == "params" else cost.optimizer_bytes


def _is_megatron(plan: Plan) -> bool:
    try:
        world_order(plan)
    except ValueError:
        return False
    return True


def _replanned(replan: Candidate, holdings: Holdings, profile: Profile,
               alive: set[int]) -> RecoveryDecision:
    if replan.plan is None or replan.restore is None:
        raise NoRecoveryPlan(f"no layout for the survivors {sorted(alive)}: {replan.reason}")
    plan, restore = replan.plan, replan.restore
    fallback = CHECKPOINT if restore.unrecoverable else None
    try:
        mode: Mode = "megatron"
        active = world_order(plan)[1]
        groups, rounds = (), ()
    except ValueError:  # not a layout megatron expresses
        if fallback:
            raise NoRecoveryPlan(f"some state has no surviving copy and the checkpoint cannot "
                                 f"be loaded into {plan.describe()} (not a megatron layout)")
        mode = "hetero"
        active = stage_major_order(plan)
        groups, rounds = allreduce_groups(plan, profile), allreduce_rounds(plan, profile)
    return RecoveryDecision(
        mode=mode, plan=plan, active=active, spares=tuple(sorted(alive - set(active))),
        transfers=() if fallback else local_copies(plan, holdings, profile) + restore.transfers,
        fallback=fallback, estimated_step_s=replan.t_step_s, sync_groups=groups,
        sync_rounds=rounds, rng_donor=rng_donors(plan, holdings))


def _reason(choice: str | None, fallback: str | None, plans: str | None) -> str:
    if fallback:
        return "some state has no surviving copy: the re-planned layout loads the last checkpoint"
    if choice == REROUTE and plans is not None:
        return f"rerouting wins the score but this model cannot run it ({plans}): re-planning"
    if choice is None:
        return "no candidate is usable by the score: executing the re-plan anyway"
    return "chosen by score"
