"""Baselines that are not in-memory re-planning: checkpoint-restart and Bamboo-like
redundant computation. Costs come from the same profile and performance model.

* Checkpoint-restart trains a uniform (megatron-native) layout and writes a checkpoint
  every interval (the stall is modelled by the engine). A failure costs detection,
  ``restart_s`` and the work since the last checkpoint; the job restarts on the best
  uniform layout of the intact TP groups. A repair is taken by a planned restart (write a
  checkpoint, restart) when Eq. 8 says the faster layout pays for it.
* Redundant computation: every stage also runs the forward pass of the next stage in its
  pipeline (ring order) and holds that stage's state, so the failed stage's predecessor
  takes over at once (its time becomes both stages' work). A second failure that cannot
  be absorbed (predecessor down or already covering) falls back to a re-plan over the
  intact groups, redundancy kept; a repaired stage is re-admitted (its and its replica's
  state copied back, then regroup).
"""

from __future__ import annotations

from typing import Sequence

from chameleon_megatron.resilience.decision.candidates import Candidate, replan_candidate
from chameleon_megatron.resilience.decision.layout import Plan
from chameleon_megatron.resilience.decision.mtbf import MtbfEstimator
from chameleon_megatron.resilience.decision.perf_model import (
    hop_s,
    in_flight,
    plan_step,
    stage_cost,
    sync_s,
)
from chameleon_megatron.resilience.decision.planner import Planner
from chameleon_megatron.resilience.decision.profile import Profile
from chameleon_megatron.resilience.decision.restorer import assign_slots, live_holdings
from chameleon_megatron.resilience.decision.schedule import pipeline_time
from chameleon_megatron.resilience.decision.selector import select
from chameleon_megatron.sim.engine import Reaction
from chameleon_megatron.sim.traces import Event


class CheckpointRestart:
    name = "checkpoint_restart"

    def __init__(self, *, plan: Plan, units: Sequence[tuple[int, ...]], planner: Planner,
                 estimator: MtbfEstimator, detect_s: float, restart_s: float,
                 write_s: float) -> None:
        if not planner.options.uniform:
            raise ValueError("checkpoint-restart needs a planner restricted to uniform plans")
        self.plan, self.units, self.planner = plan, tuple(units), planner
        self.estimator = estimator
        self.detect_s, self.restart_s, self.write_s = detect_s, restart_s, write_s
        self.down: set[int] = set()
        self.failures: list[float] = []
        self._step: float | None = self._time(plan)

    def _time(self, plan: Plan) -> float:
        return plan_step(plan, self.planner.profile).t_step_s

    def step_s(self) -> float | None:
        return self._step

    def _best_uniform(self) -> Plan | None:
        healthy = [g for g in self.units if not self.down.intersection(g)]
        result = self.planner.search(len(healthy)) if healthy else None
        if result is None or result.pipelines is None:
            return None
        return assign_slots(result.pipelines, healthy, {}, self.planner.profile)

    def react(self, event: Event, now_s: float) -> Reaction:
        record = {"kind": event.kind, "rank": event.rank}
        if event.kind == "fail":
            self.down.add(event.rank)
            self.failures.append(now_s)
            if event.rank not in set(self.plan.ranks()) and self._step is not None:
                return Reaction(downtime_s=0.0, reset_progress=False)
            plan = self._best_uniform()
            if plan is None:
                self._step = None
                return Reaction(0.0, True, rollback=True, record={**record, "choice": "down"})
            self.plan, self._step = plan, self._time(plan)
            return Reaction(self.detect_s + self.restart_s, True, rollback=True,
                            record={**record, "choice": "restart"})
        self.down.discard(event.rank)
        plan = self._best_uniform()
        if plan is None:
            return Reaction(0.0, False)
        restart = Candidate(name="restart", feasible=True, reason="ok", t_step_s=self._time(plan),
                            t_transition_s=self.write_s + self.restart_s, plan=plan)
        if self._step is not None:
            stay = Candidate(name="stay", feasible=True, reason="ok", t_step_s=self._step,
                             t_transition_s=0.0, plan=self.plan)
            choice = select([stay, restart], d_s=self.estimator.expected_s(self.failures, now_s),
                            batch=self.planner.profile.global_batch_size).chosen
            if choice is stay:
                return Reaction(0.0, False)
        self.plan, self._step = plan, restart.t_step_s
        return Reaction(restart.t_transition_s or 0.0, True, record={**record, "choice": "restart"})


def redundant_step(plan: Plan, absorbed: dict[tuple[int, int], int],
                   profile: Profile) -> tuple[float, bool]:
    """(step time, fits memory) with every stage also computing its successor's forward;
    ``absorbed[(pipeline, stage)] = p``: that failed stage's work runs on stage p."""
    hop = hop_s(profile)
    times, grad, fits = [], 0.0, True
    for j, pipe in enumerate(plan.pipelines):
        # each live stage with the failed stages it runs (a merged stage keeps its place)
        groups = [[h] + [s for s in range(pipe.depth) if absorbed.get((j, s)) == h]
                  for h in range(pipe.depth) if (j, h) not in absorbed]
        costs = [stage_cost(profile, [u for s in g for u in pipe.stage_units(s)]) for g in groups]
        n = len(costs)
        redundant = n > 1
        fwd = [c.forward_s + (costs[(k + 1) % n].forward_s if redundant else 0.0)
               for k, c in enumerate(costs)]
        bwd = [c.backward_s for c in costs]
        times.append(pipeline_time(fwd, bwd, pipe.microbatches, hop))
        for k, c in enumerate(costs):
            replica = costs[(k + 1) % n].static_bytes if redundant else 0.0
            mem = c.static_bytes + replica + in_flight(n, k, pipe.microbatches) * c.activation_bytes
            fits = fits and mem <= profile.device_memory_bytes
            grad = max(grad, c.grad_bytes)
    total = max(times) + sync_s(profile, len(plan.pipelines), grad) + profile.step_overhead_s
    return total, fits


class RedundantComputation:
    name = "redundant"

    def __init__(self, *, plan: Plan, units: Sequence[tuple[int, ...]], planner: Planner,
                 detect_s: float, restart_s: float) -> None:
        self.plan, self.units, self.planner = plan, tuple(units), planner
        self.detect_s, self.restart_s = detect_s, restart_s
        self.down: set[int] = set()
        self.absorbed: dict[tuple[int, int], int] = {}
        self._step, self.fits_memory = redundant_step(plan, {}, planner.profile)

    def step_s(self) -> float | None:
        return self._step

    def _slot(self, rank: int) -> tuple[int, int] | None:
        for j, s, _, r in self.plan.slots():
            if r == rank:
                return j, s
        return None

    def _update(self) -> None:
        self._step, fits = redundant_step(self.plan, self.absorbed, self.planner.profile)
        self.fits_memory = self.fits_memory and fits

    def react(self, event: Event, now_s: float) -> Reaction:
        slot = self._slot(event.rank)
        record = {"kind": event.kind, "rank": event.rank}
        if event.kind == "fail":
            self.down.add(event.rank)
            if slot is None or slot in self.absorbed:
                return Reaction(0.0, False)  # a spare, or a stage already taken over
            j, s = slot
            depth = self.plan.pipelines[j].depth
            pred = (s - 1) % depth
            involved = set(self.absorbed) | {(jj, h) for (jj, _), h in self.absorbed.items()}
            pred_ranks = self.plan.pipelines[j].stages[pred].ranks
            if depth > 1 and not {slot, (j, pred)} & involved \
                    and not self.down.intersection(pred_ranks):
                self.absorbed[slot] = pred
                self._update()
                return Reaction(self.detect_s, True, record={**record, "choice": "absorb"})
            return self._replan(record)
        self.down.discard(event.rank)
        if slot in self.absorbed and not self.down.intersection(
                self.plan.pipelines[slot[0]].stages[slot[1]].ranks):
            j, s = slot
            pipe = self.plan.pipelines[j]
            profile = self.planner.profile
            moved = sum(stage_cost(profile, pipe.stage_units(k)).state_bytes
                        for k in (s, (s + 1) % pipe.depth))  # the stage and its replica
            del self.absorbed[slot]
            self._update()
            return Reaction(profile.regroup_s + moved / profile.transfer_bandwidth_Bps, True,
                            record={**record, "choice": "readmit"})
        return Reaction(0.0, False)

    def _replan(self, record: dict) -> Reaction:
        healthy = [g for g in self.units if not self.down.intersection(g)]
        cand = replan_candidate(live_holdings(self.plan, self.down), healthy, self.planner)
        self.absorbed = {}
        if cand.feasible:
            self.plan = cand.plan  # type: ignore[assignment]
            self._update()
            return Reaction(self.detect_s + (cand.t_transition_s or 0.0), True,
                            record={**record, "choice": "replan"})
        result = self.planner.search(len(healthy)) if healthy else None
        if result is None or result.pipelines is None:
            self._step = None
            return Reaction(0.0, True, rollback=True, record={**record, "choice": "down"})
        self.plan = assign_slots(result.pipelines, healthy, {}, self.planner.profile)
        self._update()
        return Reaction(self.detect_s + self.restart_s, True, rollback=True,
                        record={**record, "choice": "restart"})
