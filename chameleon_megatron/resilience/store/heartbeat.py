"""Per-rank heartbeats in the job store, and the rule that declares a silent rank failed.

A worker beats at least once per step and says, with each beat, how long it may stay silent
(its heartbeat timeout, derived from its measured step time). Its agent, on the same host,
compares the beat with its own clock; a rank that has not beaten yet is allowed the start-up
timeout from its start.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from typing import Iterable, Mapping

from chameleon_megatron.resilience.store.job_store import JobStore


@dataclass(frozen=True)
class Beat:
    """The last sign of life of one rank."""

    time: float
    """Unix seconds of the beat (the worker's host clock, which is also its agent's)."""
    timeout_s: float
    """How long the rank may stay silent after this beat."""
    iteration: int | None = None
    """The step it was at, for the log."""


class Heartbeat:
    """The worker side: ``beat`` once per step (and while waiting in recovery)."""

    def __init__(self, job: JobStore, rank: int) -> None:
        self._job = job
        self._key = f"hb/{rank}"

    def beat(self, timeout_s: float, iteration: int | None = None) -> None:
        beat = Beat(time=time.time(), timeout_s=timeout_s, iteration=iteration)
        self._job.store.set(self._key, json.dumps(asdict(beat)))


def read_beats(job: JobStore, ranks: Iterable[int]) -> dict[int, Beat]:
    """The last beat of each rank that has beaten at least once."""
    out = {}
    for rank in ranks:
        key = f"hb/{rank}"
        if job.store.check([key]):
            out[rank] = Beat(**json.loads(job.store.get(key)))
    return out


def overdue(beats: Mapping[int, Beat], ranks: Iterable[int], *, now: float, started_at: float,
            startup_timeout_s: float) -> dict[int, float]:
    """Ranks silent past their deadline, each with its last sign of life (pure)."""
    late = {}
    for rank in ranks:
        beat = beats.get(rank)
        last, allowed = (started_at, startup_timeout_s) if beat is None else (beat.time, beat.timeout_s)
        if now - last > allowed:
            late[rank] = last
    return late
