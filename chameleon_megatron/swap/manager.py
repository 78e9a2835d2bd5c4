"""The swap life cycle of one rank: profile -> plan -> execute, re-profiling on change.

Stage adjusting: a step runs the full profiler when there is no plan yet, when the
previous step's lightweight signature differed from the one the plan was built from,
after an out-of-memory error and after a granularity switch; otherwise the lightweight
profiler. A plan is built at the end of each full step and used from the next, so after a
change in step s the new plan is in use in step s + 2. A full step keeps executing the old
plan (matching is fuzzy) and the budget guard, so memory stays bounded while profiling.

With ``granularity: auto`` the end of each step also feeds the stage-adjusting rule
(``stage_adjust.py``). A switch decided in step s sets the tracker's granularity for step
s + 1 and drops the plan, whose stages are keyed at the old granularity (nothing would
match): step s + 1 profiles fully under the old plan's budget, and the new plan is in use
in step s + 2.

OOM (GPU): an out-of-memory error inside a step lowers the enforced budget and the next
plan's by ``oom_backoff`` (never below what the profile says is achievable) and schedules a
re-profile; the error is re-raised (the step's graph, and with it every saved tensor, is
thrown away), and ``oom_retry`` says, for that step only, whether redoing it can succeed:
the plugin then asks the trainer to redo it, on every rank together. A swap-in that runs
out of memory evicts storages whose copy out frees memory now and retries in the executor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterator

import torch

from chameleon_megatron.swap.budget import BudgetSpec, resolve_budget
from chameleon_megatron.swap.config import SwapConfig
from chameleon_megatron.swap.cost import ProfilerCost
from chameleon_megatron.swap.executor import StepCounters, SwapExecutor
from chameleon_megatron.swap.matching import MatchIndex
from chameleon_megatron.swap.policy import SwapPolicy, generate_policy, min_feasible_budget
from chameleon_megatron.swap.profile import StepProfile
from chameleon_megatron.swap.recompute import choose_recompute
from chameleon_megatron.swap.signature import StepSignature, changed_stages
from chameleon_megatron.swap.stage import coarsen
from chameleon_megatron.swap.stage_adjust import (
    AdjustRule,
    Granularity,
    GranularityDecision,
    StageObservation,
    choose_granularity,
    observe,
)
from chameleon_megatron.swap.threshold import smallest_worth_swapping

logger = logging.getLogger(__name__)


@dataclass
class RunTotals:
    """Accumulated over the run for the end-of-run summary."""

    steps: int = 0
    full_steps: int = 0
    plans: int = 0
    changes: int = 0
    swapped_out_bytes: int = 0
    swapped_in_bytes: int = 0
    peak_resident_saved_bytes: int = 0
    """Over the steps that executed a plan."""
    peak_saved_bytes: int = 0
    """Without swap, over all steps."""
    matched: int = 0
    planned: int = 0
    blocking_swapins: int = 0
    forced_swaps: int = 0
    ooms: int = 0
    switches: int = 0
    """Granularity switches."""
    profiler_s: float = 0.0
    plan_s: float = 0.0

    SUMMED: ClassVar[tuple[str, ...]] = ("swapped_out_bytes", "swapped_in_bytes", "matched",
                                         "blocking_swapins", "forced_swaps")
    """Step counters (``StepCounters``) that add up over the run."""


class SwapManager:
    """Drives one executor through the steps of a run."""

    def __init__(self, config: SwapConfig, executor: SwapExecutor, *, budget: BudgetSpec,
                 bandwidth_bps: float, cost: ProfilerCost, rank: int = 0,
                 rule: AdjustRule = AdjustRule(), oom_factor: float = 1.0,
                 recompute: Callable[[int], None] | None = None, speaks: bool = True) -> None:
        """``oom_factor``: the budget factor earlier out-of-memory errors left (a manager
        rebuilt with its model keeps lowering from there); ``recompute``: makes the model
        recompute the first k transformer layers of each chunk (None: it cannot);
        ``speaks``: whether this rank logs its stage's records (one rank per stage does)."""
        self.config = config
        self.executor = executor
        self.budget = budget
        self.bandwidth_bps = bandwidth_bps
        self.cost = cost
        self.rank = rank
        self.speaks = speaks
        self.rule = rule
        # The one place that sets the granularity (auto starts per layer, then ``_switch``).
        executor.tracker.granularity = "microbatch" if config.granularity == "microbatch" \
            else "layer"
        self.plan: SwapPolicy | None = None
        self.plan_version = 0
        self.profile: StepProfile | None = None
        """The profile the plan was built from."""
        self.reference: StepSignature | None = None
        """Signature of the step the plan was built from."""
        self.previous: StepSignature | None = None
        """Signature of the previous training step."""
        self.reprofile: str | None = "initial"
        """Why the next step profiles fully (None: it runs lightweight)."""
        self.oom_factor = oom_factor
        self.recompute = recompute
        self.recompute_layers = 0
        """Leading layers of each chunk recomputed instead of swapped (``recompute``)."""
        self.recompute_base: float | None = None
        """The budget in bytes (before OOM backoff) that recomputing was chosen to meet."""
        self.guard: int | None = None
        """Budget enforced until the next plan: lowered after an OOM (the next plan is built
        lower too), the dropped plan's after a granularity switch."""
        self.oom_retry = False
        """Whether the last OOM lowered the budget, so redoing the step can succeed."""
        self.layer_reference: StepSignature | None = None
        """Per-layer signature of the last per-layer profile: the plan's reference at layer
        granularity; per microbatch, the one layer granularity would have taken (the step
        after each per-layer change). None: this step's becomes it."""
        self.observed: list[StageObservation] = []
        """Auto granularity: steps observed since the last switch (the rule's span at most)."""
        self.last_metrics: dict[str, Any] = {}
        self.totals = RunTotals()
        self._warned_floor = False

    @contextlib.contextmanager
    def step(self, iteration: int) -> Iterator[None]:
        """Context around one training step's forward-backward."""
        full = self.reprofile is not None
        self.oom_retry = False
        ex = self.executor
        ex.begin_step(profile="full" if full else "light")
        if full:
            ex.copier.reset_peaks()
        ex.budget = self._guard_budget()
        ex.tracker.sync = ex.copier.sync_device if full else None  # exact segment times
        try:
            with ex.hooks():
                yield
        except torch.OutOfMemoryError:
            self._on_oom(iteration)
            raise
        finally:
            counters = ex.end_step()
            ex.tracker.sync = None
        self._finish(iteration, full, counters)

    def _guard_budget(self) -> int | None:
        if self.guard is not None:
            return self.guard
        if self.plan is not None:
            return self.plan.budget_bytes
        spec = self.budget
        if spec.absolute_bytes is not None:
            return max(int(spec.absolute_bytes * self.oom_factor), 1)
        in_use = self.executor.copier.memory_in_use()
        if spec.device_fraction is not None and in_use is not None:
            # Before the first plan: what the device fraction leaves beside what is held now.
            share = spec.device_fraction * spec.device_total_bytes * self.oom_factor
            return max(int(share) - in_use, 1)
        return None

    def _finish(self, iteration: int, full: bool, counters: StepCounters) -> None:
        ex = self.executor
        start = time.perf_counter()
        layers = ex.tracker.layer_signature()
        signature = layers if ex.tracker.step_granularity == "layer" else coarsen(layers)
        tolerance = self.config.size_tolerance
        # Reported: a change since the previous step. Acted on: a change since the plan's step.
        changed = () if self.previous is None else changed_stages(
            self.previous, signature, tolerance)
        stale = self.reference is not None and bool(changed_stages(
            self.reference, signature, tolerance))
        self.previous = signature
        switch = self._adjust(layers)
        # A switch drops the plan: a profile keyed at the old granularity is of no use.
        profile = ex.recorder.finish(ex.tracker.segments, ex.op_names, signature,
                                     ex.copier.memory_summary()) \
            if full and switch is None else None
        profiler_s = time.perf_counter() - start + counters.packs * (
            self.cost.full_s if full else self.cost.light_s)
        used = (self.plan, self.plan_version if self.plan is not None else 0,
                ex.tracker.step_granularity)
        plan_s = 0.0
        if profile is not None:
            start = time.perf_counter()
            self._adopt(profile, iteration)
            plan_s = time.perf_counter() - start
        elif stale:
            self.reprofile = "change"
        if changed:
            self._log(logging.INFO, "swap_change", iteration, stages=len(changed),
                      first=changed[0])
        if switch is not None:
            self._switch(switch, layers, iteration)
        self.last_metrics = self._metrics(used, full, counters, bool(changed), profiler_s, plan_s)
        self._accumulate(counters, full, bool(changed), profiler_s, plan_s, used[0])

    def _adopt(self, profile: StepProfile, iteration: int) -> None:
        cfg = self.config
        wanted = resolve_budget(self.budget, profile, oom_factor=self.oom_factor)
        if self.recompute_base is not None:  # the budget recompute was chosen for, in bytes
            wanted = max(int(self.recompute_base * self.oom_factor), 1)
        min_bytes = cfg.min_tensor_bytes if cfg.min_tensor_bytes is not None else \
            smallest_worth_swapping(profile, budget_bytes=wanted, bandwidth_bps=self.bandwidth_bps)
        floor = min_feasible_budget(profile, min_bytes)
        budget = self._achievable(wanted, floor)
        plan = generate_policy(profile, budget_bytes=budget, bandwidth_bps=self.bandwidth_bps,
                               min_bytes=min_bytes, time_limit_s=cfg.plan_time_limit_s)
        recompute = self._recompute_instead(profile, plan, wanted, min_bytes, iteration)
        if budget > wanted and not recompute:
            self._warn_floor(wanted, floor, iteration)
        self.executor.min_bytes = min_bytes
        self.executor.set_policy(plan, MatchIndex(profile.records))
        # Host buffers (page-locked on GPU) for the plan's swaps now, not in the forward.
        self.executor.pool.reserve(d.nbytes for d in plan.decisions)
        self.plan, self.profile, self.guard = plan, profile, None
        self.plan_version += 1
        self.reference = profile.signature
        if self.executor.tracker.step_granularity == "layer":
            self.layer_reference = profile.signature
        self._log(logging.WARNING if plan.expected_stall_s > 0 else logging.INFO, "swap_plan",
                  iteration, reason=self.reprofile, version=self.plan_version,
                  budget_bytes=plan.budget_bytes, no_swap_peak_bytes=plan.no_swap_peak_bytes,
                  planned_peak_bytes=plan.planned_peak_bytes,
                  planned_out_bytes=plan.planned_out_bytes, tensors=len(plan.decisions),
                  expected_stall_s=plan.expected_stall_s, optimal=plan.optimal)
        self.reprofile = "recompute" if recompute else None

    def _log(self, level: int, event: str, iteration: int, **fields: Any) -> None:
        """One structured record of this stage (from the rank that speaks for it)."""
        if self.speaks:
            logger.log(level, {"event": event, "rank": self.rank, "iteration": iteration,
                               **fields})

    def _achievable(self, budget: int, floor: int) -> int:
        """``budget``, or the least achievable one (``floor``) when it is lower: after an
        OOM (the backoff went too far), or by default; ``strict`` keeps the budget (and the
        policy refuses it)."""
        if budget >= floor or (self.config.strict and self.oom_factor == 1.0):
            return budget
        return floor

    def _warn_floor(self, budget: int, floor: int, iteration: int) -> None:
        if self.oom_factor == 1.0 and not self._warned_floor and self.speaks:
            self._warned_floor = True
            logger.warning("swap budget %d bytes is below the least achievable %d bytes "
                           "(rank %d, iteration %d): swapping what can be swapped; "
                           "--chameleon-swap-strict makes this an error", budget, floor,
                           self.rank, iteration)

    def _recompute_instead(self, profile: StepProfile, plan: SwapPolicy, wanted: int,
                           min_bytes: int, iteration: int) -> bool:
        """Offload or recompute: when swapping stalls, or cannot meet ``wanted``, and
        recomputing leading layers of each chunk costs less (``recompute.py``), turn that on
        for the next steps; True when it did (a new sequence: profile again)."""
        short = plan.budget_bytes > wanted
        if self.recompute is None or self.recompute_layers or not self.config.recompute or \
                (plan.expected_stall_s <= 0 and not short):
            return False
        choice = choose_recompute(profile, budget_bytes=wanted, bandwidth_bps=self.bandwidth_bps,
                                  min_bytes=min_bytes)
        if choice is None or choice.layers == 0 or \
                (not short and choice.cost_s >= plan.expected_stall_s):
            return False
        self.recompute(choice.layers)
        self.recompute_layers = choice.layers
        # A fraction of the next profile's (smaller) peak would chase it down: keep bytes.
        self.recompute_base = wanted / self.oom_factor
        self._log(logging.INFO, "swap_recompute", iteration, layers_per_chunk=choice.layers,
                  swap_stall_s=plan.expected_stall_s, budget_met_by_swap=not short,
                  expected_stall_s=choice.stall_s, recompute_s=choice.recompute_s)
        return True

    def _adjust(self, layers: StepSignature) -> GranularityDecision | None:
        """Auto granularity: observe this step; the rule's decision when it switches."""
        if self.config.granularity != "auto":
            return None
        seen = observe(self.layer_reference, layers, self.config.size_tolerance)
        if self.layer_reference is None:
            self.layer_reference = layers
        elif seen.layer_changed:
            self.layer_reference = None  # re-profiled in the next step at layer granularity
        span = max(self.rule.window, self.rule.calm)
        self.observed = (self.observed + [seen])[-span:]
        decision = choose_granularity(self.executor.tracker.granularity, self.observed,
                                      self.rule)
        return decision if decision.switch else None

    def _switch(self, decision: GranularityDecision, layers: StepSignature,
                iteration: int) -> None:
        """Use ``decision.granularity`` from the next step, which profiles fully."""
        tracker = self.executor.tracker
        before, tracker.granularity = tracker.granularity, decision.granularity
        self.previous = layers if decision.granularity == "layer" else coarsen(layers)
        # The plan's stages are keyed at the old granularity, so none would match: drop it,
        # keeping its budget until the re-profile builds the next plan.
        if self.plan is not None and self.guard is None:
            self.guard = self.plan.budget_bytes
        self.plan = self.profile = self.reference = None
        self.executor.set_policy(None, None)
        self.reprofile = "granularity"
        self.observed = []
        self.totals.switches += 1
        self._log(logging.INFO, "swap_granularity", iteration, **{
            "from": before, "to": decision.granularity, "reason": decision.reason,
            "hidden_reprofiles": decision.hidden, "steps": decision.steps})

    def _on_oom(self, iteration: int) -> None:
        # Nothing to evict: the step's graph is being thrown away, and its saved tensors
        # (resident or on host) go with it.
        backoff = self.config.oom_backoff
        self.oom_factor *= backoff
        self.reprofile = "oom"
        self.totals.ooms += 1
        before = self.executor.budget
        floor = self.plan.min_budget_bytes if self.plan is not None else 1
        if before is not None:
            self.guard = max(int(before * backoff), floor)
        # Without a budget yet (an OOM while profiling the first step under a fractional
        # budget) or already at the least achievable one, a redo would fail the same way.
        self.oom_retry = before is not None and self.guard < before
        # Every rank that ran out says so: it is this rank's event, not its stage's.
        logger.warning({"event": "swap_oom", "rank": self.rank, "iteration": iteration,
                        "budget_before": before, "budget_now": self.guard,
                        "redo": self.oom_retry})

    def _metrics(self, used: tuple[SwapPolicy | None, int, Granularity], full: bool,
                 c: StepCounters, changed: bool, profiler_s: float,
                 plan_s: float) -> dict[str, Any]:
        plan, version, granularity = used
        return {
            "mode": "full" if full else "light",
            "granularity": granularity,
            "plan_version": version,
            "budget_bytes": self.executor.budget,
            "min_tensor_bytes": self.executor.min_bytes,
            "recompute_layers": self.recompute_layers,
            "planned_out_bytes": plan.planned_out_bytes if plan else 0,
            "planned_tensors": len(plan.decisions) if plan else 0,
            "expected_stall_s": plan.expected_stall_s if plan else 0.0,
            **dataclasses.asdict(c),
            "sequence_changed": changed,
            "profiler_s": profiler_s,
            "plan_s": plan_s,
            "live_entries": self.executor.live_entries,
            "host_buffers_live": self.executor.pool.live,
            "host_bytes": self.executor.pool.held_bytes,
        }

    def _accumulate(self, c: StepCounters, full: bool, changed: bool, profiler_s: float,
                    plan_s: float, plan: SwapPolicy | None) -> None:
        t = self.totals
        t.steps += 1
        t.full_steps += full
        t.plans = self.plan_version
        t.changes += changed
        for name in RunTotals.SUMMED:
            setattr(t, name, getattr(t, name) + getattr(c, name))
        if plan is not None:  # a profiling step without a plan swaps nothing
            t.peak_resident_saved_bytes = max(t.peak_resident_saved_bytes,
                                              c.peak_resident_saved_bytes)
        t.peak_saved_bytes = max(t.peak_saved_bytes, c.peak_saved_bytes)
        t.planned += len(plan.decisions) if plan else 0
        t.profiler_s += profiler_s
        t.plan_s += plan_s
