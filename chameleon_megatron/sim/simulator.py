"""Replays one failure trace against every strategy on the same cluster and profile."""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from chameleon_megatron.resilience.decision.layout import Plan, UniformLayout
from chameleon_megatron.resilience.decision.mtbf import MtbfEstimator
from chameleon_megatron.resilience.decision.perf_model import plan_step
from chameleon_megatron.resilience.decision.planner import Planner, SearchOptions
from chameleon_megatron.resilience.decision.profile import Profile, load_profile
from chameleon_megatron.sim.baselines import CheckpointRestart, RedundantComputation
from chameleon_megatron.sim.config import SimConfig
from chameleon_megatron.sim.engine import Checkpointing, Reaction, Strategy, StrategyResult, replay
from chameleon_megatron.sim.strategies import InMemoryStrategy
from chameleon_megatron.sim.traces import Event, check_trace, draw_trace, load_trace

Progress = Callable[[float, str], None]
"""Told (fraction of the whole simulation done, strategy being replayed) as it goes."""


@dataclass(frozen=True)
class Setup:
    profile: Profile
    plan: Plan
    units: tuple[tuple[int, ...], ...]
    events: tuple[Event, ...]


def setup(config: SimConfig, profile: Profile | None = None,
          events: Sequence[Event] | None = None) -> Setup:
    """Profile (with the config's overrides), initial plan, TP groups and the trace."""
    prof = profile or load_profile(config.profile)
    changes: dict[str, Any] = {}
    if config.global_batch_size is not None:
        changes["global_batch_size"] = config.global_batch_size
    if config.regroup_s is not None:
        changes["regroup_s"] = config.regroup_s
    if config.device_memory_bytes is not None:
        changes["device_memory_bytes"] = config.device_memory_bytes
    prof = dataclasses.replace(prof, swap_bandwidth_Bps=0.0, **changes)
    if prof.tp != config.tp:
        raise ValueError(f"sim.tp={config.tp} differs from the profile's tp={prof.tp}")
    layout = UniformLayout(tp=config.tp, pp=config.pp, dp=config.dp, vpp=config.vpp)
    plan = layout.to_plan(prof.num_layers, prof.global_microbatches)
    if events is None:
        events = load_trace(config.trace) if config.trace else draw_trace(
            layout.world_size, config.horizon_s, config.mtbf_s, config.repair_s, config.seed)
    return Setup(prof, plan, layout.tp_groups(), check_trace(events, layout.world_size))


def make_strategy(name: str, config: SimConfig, s: Setup, planner: Planner) -> Strategy:
    estimator = MtbfEstimator(prior_s=config.mtbf_prior_s or config.mtbf_s,
                              prior_weight=config.mtbf_prior_weight)
    common = dict(plan=s.plan, units=s.units, detect_s=config.detect_s, restart_s=config.restart_s)
    if name == "checkpoint_restart":
        uniform = Planner(s.profile, dataclasses.replace(planner.options, uniform=True))
        return CheckpointRestart(planner=uniform, estimator=estimator,
                                 write_s=config.checkpoint_write_s, **common)
    if name == "redundant":
        return RedundantComputation(planner=planner, **common)
    if name == "chameleon_swap":
        swapping = dataclasses.replace(s.profile, swap_bandwidth_Bps=config.swap_bandwidth_Bps)
        planner = Planner(swapping, planner.options)
    policy = {"chameleon": "adaptive", "chameleon_swap": "adaptive", "reroute": "reroute",
              "replan": "replan"}[name]
    return InMemoryStrategy(name, policy, planner=planner,  # type: ignore[arg-type]
                            estimator=estimator, **common)


@dataclass(frozen=True)
class _Reporting:
    """A strategy whose reactions also report how far through the trace the replay is
    (reactions are where the time goes: each may search for a plan)."""

    inner: Strategy
    progress: Progress
    done: float
    """Fraction of the simulation done before this strategy's replay."""
    share: float
    """This replay's share of the simulation."""
    horizon_s: float

    @property
    def name(self) -> str:
        return self.inner.name

    def step_s(self) -> float | None:
        return self.inner.step_s()

    def react(self, event: Event, now_s: float) -> Reaction:
        reaction = self.inner.react(event, now_s)
        self.progress(self.done + self.share * min(now_s / self.horizon_s, 1.0), self.name)
        return reaction


def simulate(config: SimConfig, profile: Profile | None = None,
             events: Sequence[Event] | None = None, progress: Progress | None = None,
             ) -> tuple[dict[str, Any], dict[str, StrategyResult]]:
    """(JSON report, per-strategy results with their throughput segments). ``progress``:
    called after each event of each replay and once at the end with 1.0."""
    s = setup(config, profile, events)
    options = SearchOptions(min_depth=config.min_depth, max_depth=config.max_depth,
                            time_limit_s=config.search_time_limit_s)
    planner = Planner(s.profile, options)
    ff_step = plan_step(s.plan, s.profile).t_step_s
    batch = s.profile.global_batch_size
    ff = batch / ff_step
    results: dict[str, StrategyResult] = {}
    notes = []
    share = 1.0 / max(len(config.strategies), 1)
    for k, name in enumerate(config.strategies):
        strategy = make_strategy(name, config, s, planner)
        write = config.checkpoint_write_s if name == "checkpoint_restart" else 0.0
        replayed: Strategy = strategy if progress is None else _Reporting(
            strategy, progress, k * share, share, config.horizon_s)
        results[name] = replay(replayed, s.events, horizon_s=config.horizon_s, batch=batch,
                               ckpt=Checkpointing(config.checkpoint_interval, write))
        if isinstance(strategy, RedundantComputation) and not strategy.fits_memory:
            notes.append("redundant: a stage with its successor's replica exceeds device memory; "
                         "its figures assume the memory were there")
    report: dict[str, Any] = {
        "devices": len(s.plan.ranks()), "profile": s.profile.name,
        "layout": {"tp": config.tp, "pp": config.pp, "dp": config.dp, "vpp": config.vpp},
        "horizon_s": config.horizon_s, "mtbf_s": config.mtbf_s, "repair_s": config.repair_s,
        "failures": sum(e.kind == "fail" for e in s.events if e.time_s < config.horizon_s),
        "repairs": sum(e.kind == "repair" for e in s.events if e.time_s < config.horizon_s),
        "checkpoint_interval_s": config.checkpoint_interval,
        "failure_free": {"t_step_s": ff_step, "throughput": ff},
        "strategies": {
            name: {
                "avg_throughput": r.avg_throughput,
                "gap_to_failure_free": 1 - r.avg_throughput / ff,
                "time_lost_s": config.horizon_s * (1 - r.avg_throughput / ff),
                "choices": dict(Counter(str(rec.get("choice")) for rec in r.records)),
            }
            for name, r in results.items()
        },
        "notes": notes,
    }
    if progress is not None and config.strategies:
        progress(1.0, config.strategies[-1])
    cham = results.get("chameleon")
    if cham is not None:
        report["ratios"] = {
            f"chameleon/{k}": cham.avg_throughput / r.avg_throughput
            for k, r in results.items() if k != "chameleon" and r.avg_throughput > 0
        }
    return report, results
