"""Failure announcements: agents write one record per failed rank, workers read them in order.

Records live in the job store, so they survive the worker that failed. Each rank is announced
at most once (the first agent to claim it wins), in a global order that every reader sees the
same: ``fail/count`` counts them and ``fail/<i>`` names the i-th failed rank.
"""

from __future__ import annotations

import datetime
import json
import os
import time
from dataclasses import asdict, dataclass
from typing import Callable, Iterable, Literal

from chameleon_megatron.resilience.store.job_store import JobStore

Reason = Literal["exit", "signal", "heartbeat", "node", "regroup_timeout"]


@dataclass(frozen=True)
class FailureRecord:
    """One failed rank: who, when (unix seconds), and how it was seen."""

    rank: int
    """Launch rank of the failed process."""
    time: float
    """When the failure was observed (the exit seen, or the heartbeat deadline passed)."""
    reason: Reason
    """exit: non-zero exit; signal: killed by a signal; heartbeat: silent too long (then
    killed); node: its agent went silent (whole node lost); regroup_timeout: suspected, as
    it neither joined a generation nor was announced within the regroup window (it may be
    alive and slow: it leaves when it finds out, and may come back as a joiner)."""
    exitcode: int | None = None
    signal: str | None = None
    node: str = ""
    """Host (and pid) of the agent that saw it (for a suspicion: the rank that raised it)."""
    last_seen: float | None = None
    """For heartbeat and node failures: the last sign of life, the best estimate of when it
    really failed."""

    @property
    def failed_at(self) -> float:
        """Best estimate of when the rank stopped working (the start of detection latency)."""
        return self.time if self.last_seen is None else self.last_seen

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> FailureRecord:
        return cls(**json.loads(text))


def announce(job: JobStore, record: FailureRecord) -> bool:
    """Publish ``record`` unless its rank was already announced; True when this call did."""
    payload = record.to_json() + f"#{os.getpid()}"  # unique, so compare_set tells the winner
    current = job.store.compare_set(f"fail/rank/{record.rank}", "", payload)
    if current.decode() != payload:
        return False
    index = job.store.add("fail/count", 1) - 1
    job.store.set(f"fail/{index}", str(record.rank))
    return True


def failure_count(job: JobStore) -> int:
    """How many ranks have been announced failed so far (non-blocking)."""
    return job.counter("fail/count")


def read_failures(job: JobStore, start: int = 0, wait_s: float = 10.0) -> list[FailureRecord]:
    """Announced failures from index ``start`` on, in announcement order."""
    out = []
    for i in range(start, failure_count(job)):
        # the counter is bumped before the index key is written: wait for it briefly
        job.store.wait([f"fail/{i}"], datetime.timedelta(seconds=wait_s))
        rank = int(job.store.get(f"fail/{i}"))
        text = job.store.get(f"fail/rank/{rank}").decode()
        out.append(FailureRecord.from_json(text.rsplit("#", 1)[0]))
    return out


def failed_ranks(job: JobStore) -> frozenset[int]:
    return frozenset(r.rank for r in read_failures(job))


def first_failed_at(job: JobStore, ranks: Iterable[int], default: float) -> float:
    """When the first of ``ranks`` failed (``default``: none of them is announced)."""
    ranks = set(ranks)
    return min((f.failed_at for f in read_failures(job) if f.rank in ranks), default=default)


def wait_for_failure(job: JobStore, count: int, timeout_s: float,
                     on_wait: Callable[[], None]) -> bool:
    """Whether a failure beyond the first ``count`` is (or gets, within ``timeout_s``)
    announced; ``on_wait`` is called between polls."""
    deadline = time.monotonic() + timeout_s
    while failure_count(job) <= count:
        if time.monotonic() > deadline:
            return False
        on_wait()
        time.sleep(0.05)
    return True


@dataclass(frozen=True)
class AbandonRecord:
    """A live rank that cannot finish a step (e.g. out of device memory): every rank of the
    job abandons that step and redoes it in the same layout. Nobody failed."""

    rank: int
    """Launch rank of the process that asked."""
    iteration: int
    """The step abandoned (1-based)."""
    reason: str
    """Why, e.g. "oom"; becomes the recovery's cause."""
    time: float

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


def announce_abandon(job: JobStore, record: AbandonRecord) -> None:
    index = job.store.add("abandon/count", 1) - 1
    job.store.set(f"abandon/{index}", record.to_json())


def abandon_count(job: JobStore) -> int:
    return job.counter("abandon/count")


def read_abandons(job: JobStore, start: int = 0, wait_s: float = 10.0) -> list[AbandonRecord]:
    """Abandoned steps from index ``start`` on, in announcement order."""
    out = []
    for i in range(start, abandon_count(job)):
        job.store.wait([f"abandon/{i}"], datetime.timedelta(seconds=wait_s))
        out.append(AbandonRecord(**json.loads(job.store.get(f"abandon/{i}"))))
    return out
