"""Replays a trace against one strategy and counts the samples it trains.

Training is counted in whole steps: a step in progress when a failure strikes (or when
the strategy changes the layout) is lost. Checkpoints are taken every ``interval_s`` of
training; writing one stalls training for ``write_s`` (0 for asynchronous snapshots).
A reaction that rolls back returns the sample count to the last completed checkpoint.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

from chameleon_megatron.sim.traces import Event


@dataclass(frozen=True)
class Reaction:
    downtime_s: float
    """Time from the event until training resumes (detection, transition, restart)."""
    reset_progress: bool
    """The step in progress is lost."""
    rollback: bool = False
    """Resume from the last checkpoint: the samples trained since are lost."""
    record: dict[str, Any] | None = None
    """The decision taken, for the report."""


class Strategy(Protocol):
    name: str

    def step_s(self) -> float | None:
        """Current step time; None while the job cannot train."""

    def react(self, event: Event, now_s: float) -> Reaction:
        """Update the strategy's layout for a failure or a repair."""


@dataclass(frozen=True)
class Checkpointing:
    interval_s: float
    write_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.interval_s > 0 or self.write_s < 0:
            raise ValueError(f"checkpoint interval_s={self.interval_s} must be > 0 and "
                             f"write_s={self.write_s} >= 0")


@dataclass
class StrategyResult:
    name: str
    samples: float
    horizon_s: float
    segments: list[tuple[float, float, float]] = field(default_factory=list)
    """(start, end, samples/s averaged over the segment)."""
    records: list[dict[str, Any]] = field(default_factory=list)

    @property
    def avg_throughput(self) -> float:
        return self.samples / self.horizon_s


@dataclass
class _Run:
    """Mutable bookkeeping of one replay (local to ``replay``)."""

    batch: int
    ckpt: Checkpointing
    samples: float = 0.0
    carry_s: float = 0.0
    since_ckpt_s: float = 0.0
    ckpt_samples: float = 0.0

    def progress(self, seconds: float, step_s: float) -> None:
        total = self.carry_s + seconds
        steps = math.floor(total / step_s)
        self.samples += steps * self.batch
        self.carry_s = total - steps * step_s

    def train(self, seconds: float, step_s: float) -> None:
        while seconds > 0:
            to_ckpt = self.ckpt.interval_s - self.since_ckpt_s
            if seconds < to_ckpt:
                self.progress(seconds, step_s)
                self.since_ckpt_s += seconds
                return
            self.progress(to_ckpt, step_s)
            seconds -= to_ckpt
            self.since_ckpt_s = self.ckpt.interval_s
            if seconds < self.ckpt.write_s:
                return  # interrupted while writing: the checkpoint is not complete
            seconds -= self.ckpt.write_s
            self.ckpt_samples, self.since_ckpt_s = self.samples, 0.0


def replay(strategy: Strategy, events: Sequence[Event], *, horizon_s: float, batch: int,
           ckpt: Checkpointing) -> StrategyResult:
    result = StrategyResult(name=strategy.name, samples=0.0, horizon_s=horizon_s)
    run = _Run(batch=batch, ckpt=ckpt)
    now, ready = 0.0, 0.0
    for event in [*events, None]:
        end = horizon_s if event is None else min(event.time_s, horizon_s)
        if ready > now:
            result.segments.append((now, min(ready, end), 0.0))
            now = min(ready, end)
        if end > now:
            before, step = run.samples, strategy.step_s()
            if step is not None:
                run.train(end - now, step)
            result.segments.append((now, end, (run.samples - before) / (end - now)))
            now = end
        if event is None or event.time_s >= horizon_s:
            break
        reaction = strategy.react(event, now)
        if reaction.rollback:
            run.samples, run.since_ckpt_s = run.ckpt_samples, 0.0
        if reaction.reset_progress or reaction.rollback:
            run.carry_s = 0.0
        if reaction.record is not None:
            result.records.append({"time_s": now, **reaction.record})
        ready = now + reaction.downtime_s
    result.samples = run.samples
    return result
