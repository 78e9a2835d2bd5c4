"""Agent liveness: every agent beats in the job store; one silent too long is a lost node.

Silence is judged by the observer's own clock (how long the beat has not changed), so hosts
need no synchronised clocks. An agent also says in its beat whether all its workers have
exited; the job is finished for the agents when every agent has either said so or been lost.
"""

from __future__ import annotations

import json

from chameleon_megatron.resilience.announce import FailureRecord
from chameleon_megatron.resilience.job_store import JobStore


class NodeWatch:
    """One agent's view of all agents (group ranks 0..group_world_size-1)."""

    def __init__(self, job: JobStore, group_rank: int, group_world_size: int,
                 ranks: list[int], *, timeout_s: float) -> None:
        self._job = job
        self._me = group_rank
        self._size = group_world_size
        self._ranks = ranks
        self._timeout = timeout_s
        self._period = timeout_s / 10
        self._seq = 0
        self._next_at = 0.0
        self._finished_said = False
        self._seen: dict[int, tuple[bytes, float]] = {}
        """group rank -> (its last beat, when this agent first saw that value)."""
        self._lost: set[int] = set()

    def add_rank(self, rank: int) -> None:
        """A worker started later on this node (a restarted one): announced with the others
        if this node is lost."""
        self._ranks = [*self._ranks, rank]
        self._next_at = 0.0  # publish it with the next tick

    def tick(self, now: float, *, node: str, finished: bool) -> list[FailureRecord]:
        """Beat, read the others, and return failure records for newly lost agents' ranks."""
        if now < self._next_at and finished == self._finished_said:
            return []
        self._next_at = now + self._period
        self._finished_said = finished
        self._seq += 1
        beat = {"seq": self._seq, "ranks": self._ranks, "finished": finished, "node": node}
        self._job.store.set(f"agent/{self._me}", json.dumps(beat))
        return [r for g in range(self._size) if g != self._me for r in self._check(g, now, node)]

    def _check(self, g: int, now: float, node: str) -> list[FailureRecord]:
        key = f"agent/{g}"
        if g in self._lost or not self._job.store.check([key]):
            return []
        value = self._job.store.get(key)
        last, since = self._seen.get(g, (b"", now))
        if value != last:
            self._seen[g] = (value, now)
            return []
        beat = json.loads(value)
        if beat["finished"] or now - since <= self._timeout:
            return []
        self._lost.add(g)
        return [FailureRecord(rank=r, time=now, reason="node", node=beat["node"], last_seen=since)
                for r in beat["ranks"]]

    def job_finished(self) -> bool:
        """Every other agent has finished or is lost (this one's own state is the caller's)."""
        for g in range(self._size):
            if g == self._me or g in self._lost:
                continue
            value = self._seen.get(g, (b"", 0.0))[0]
            if not value or not json.loads(value)["finished"]:
                return False
        return True
