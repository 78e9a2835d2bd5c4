"""Agent liveness: every agent beats in the job store; one silent too long is a lost node.

Silence is judged by the observer's own clock (how long the beat has not changed), so hosts
need no synchronised clocks. An agent also says in its beat whether all its workers have
exited; the job is finished for the agents when every agent has either said so or been lost.
The launch's agents are group ranks 0..nodes-1 (torchrun's); an agent of a node that joins
the running job later registers the next number (``register_joined_node``), and every agent
watches it from its next beat on.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import torch.distributed as dist

from chameleon_megatron.resilience.store.announce import FailureRecord
from chameleon_megatron.resilience.store.job_store import JobStore

_LAUNCH = "launch"
_JOINED = "agent/joined"


@dataclass(frozen=True)
class Launch:
    """What the launch's agents publish for nodes that join later."""

    world_size: int
    """Workers started by the launch (join ids start here)."""
    nodes: int
    """Agents of the launch."""


def publish_launch(job: JobStore, *, world_size: int, nodes: int) -> None:
    """Written by every agent of the launch (the same value)."""
    job.store.set(_LAUNCH, json.dumps({"world_size": world_size, "nodes": nodes}))


def read_launch(job: JobStore, *, timeout_s: float, poll_s: float = 0.2) -> Launch:
    """The launch a joining node joins; RuntimeError when none is published in time."""
    deadline = time.monotonic() + timeout_s
    while not job.store.check([_LAUNCH]):
        if time.monotonic() > deadline:
            raise RuntimeError(f"no chameleon-run job with run id {job.run_id!r} in the job "
                               f"store after {timeout_s:.0f} s (is --rdzv-id the job's?)")
        time.sleep(poll_s)
    return Launch(**json.loads(job.store.get(_LAUNCH)))


def register_joined_node(job: JobStore, launch: Launch) -> int:
    """A group rank for a node joining the running job: after the launch's and earlier
    joiners', never reused."""
    return launch.nodes + job.store.add(_JOINED, 1) - 1


def node_ranks(job: JobStore) -> list[list[int]]:
    """The launch ranks of each node, from its agent's last beat (none when the job was not
    started by chameleon-run's agents)."""
    if not job.store.check([_LAUNCH]):
        return []
    count = json.loads(job.store.get(_LAUNCH))["nodes"] + job.counter(_JOINED)
    keys = [f"agent/{g}" for g in range(count)]
    return [json.loads(job.store.get(k))["ranks"] for k in keys if job.store.check([k])]


class NodeWatch:
    """One agent's view of all agents: the launch's, and those that joined since."""

    def __init__(self, job: JobStore, group_rank: int, launch_nodes: int,
                 ranks: list[int], *, timeout_s: float, addr: str = "") -> None:
        self._job = job
        self._addr = addr
        """This agent's address as the other nodes reach it (published in its beat)."""
        self._me = group_rank
        self._launch_nodes = launch_nodes
        self._size = launch_nodes
        self._ranks = ranks
        self._timeout = timeout_s
        self._period = timeout_s / 10
        self._seq = 0
        self._next_at = 0.0
        self._finished_said = False
        self._seen: dict[int, tuple[bytes, float]] = {}
        """group rank -> (its last beat, b"" before the first; when first seen so)."""
        self._lost: set[int] = set()
        self._store_gone = False

    def add_rank(self, rank: int) -> None:
        """A worker started later on this node (a joiner): announced with the others if
        this node is lost."""
        self._ranks = [*self._ranks, rank]
        self._next_at = 0.0  # publish it with the next tick

    def tick(self, now: float, *, node: str, finished: bool) -> list[FailureRecord]:
        """Beat, read the others, and return failure records for newly lost agents' ranks."""
        if now < self._next_at and finished == self._finished_said:
            return []
        self._next_at = now + self._period
        self._finished_said = finished
        self._seq += 1
        beat = {"seq": self._seq, "ranks": self._ranks, "finished": finished, "node": node,
                "addr": self._addr}
        try:
            self._job.store.set(f"agent/{self._me}", json.dumps(beat))
            self._size = self._launch_nodes + self._job.counter(_JOINED)
            return [r for g in range(self._size) if g != self._me for r in self._check(g, now)]
        except dist.DistError:
            if not finished:
                raise
            # the host's agent left once every agent had said it finished, before this
            # one read that: nothing is left to wait for
            self._store_gone = True
            return []

    def _check(self, g: int, now: float) -> list[FailureRecord]:
        """Failure records for agent ``g``'s ranks once it is silent past the timeout (none
        for an agent that registered but never beat)."""
        key = f"agent/{g}"
        if g in self._lost:
            return []
        value = self._job.store.get(key) if self._job.store.check([key]) else b""
        last, since = self._seen.get(g, (None, now))
        if value != last:
            self._seen[g] = (value, now)
            return []
        if now - since <= self._timeout or (value and json.loads(value)["finished"]):
            return []
        self._lost.add(g)
        if not value:
            return []
        beat = json.loads(value)
        return [FailureRecord(rank=r, time=now, reason="node", node=beat["node"], last_seen=since)
                for r in beat["ranks"]]

    @property
    def launch_agents(self) -> int:
        return self._launch_nodes

    def lost_launch_agents(self) -> int:
        """How many of the launch's agents this one has declared lost."""
        return sum(1 for g in self._lost if g < self._launch_nodes)

    def job_finished(self) -> bool:
        """Every other agent has finished or is lost (this one's own state is the caller's)."""
        if self._store_gone:
            return True
        for g in range(self._size):
            if g == self._me or g in self._lost:
                continue
            value = self._seen.get(g, (b"", 0.0))[0]
            if not value or not json.loads(value)["finished"]:
                return False
        return True

    def launch_survivors(self, *, host: int = 0) -> list[tuple[int, str]]:
        """(group rank, address) of the launch's agents still training, as this agent last
        saw them, without the store's ``host``: this one and every other that was neither
        lost nor finished. Used once the store is gone, so every survivor computes the same
        list from the beats it had read."""
        alive = []
        for g in range(self._launch_nodes):
            if g == host or g in self._lost:
                continue
            if g == self._me:
                alive.append((g, self._addr))
                continue
            value = self._seen.get(g, (b"", 0.0))[0]
            beat = json.loads(value) if value else None
            if beat is not None and not beat["finished"]:
                alive.append((g, beat["addr"]))
        return alive
