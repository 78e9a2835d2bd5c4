"""The worker processes of one node's agent, each watched on its own.

A worker that exits non-zero or dies of a signal is announced once in the job store; one
silent past its heartbeat deadline is killed (its whole session) and announced; with
``ft.respawns`` a failed worker's slot is started again after ``ft.respawn_delay_s`` as a
joiner (a fresh launch-rank id, see ``joiners.py``), while the budget lasts and the job is not
done. Shared by the launching agent (``agent.py``: workers started by torchrun) and the agent
of a node that joins a running job (``join_node.py``: every worker a joiner).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Callable

from chameleon_megatron.resilience.config import ResilienceConfig
from chameleon_megatron.resilience.launch.nodes import NodeWatch
from chameleon_megatron.resilience.store.announce import FailureRecord, announce
from chameleon_megatron.resilience.store.env import BEAT_DIR_ENV, JOIN_ENV
from chameleon_megatron.resilience.store.exits import WORKER_LEFT_EXIT
from chameleon_megatron.resilience.store.heartbeat import (
    STACKS_GRACE_S, STACKS_SIGNAL, overdue, read_beats,
)
from chameleon_megatron.resilience.store.job_store import JobStore
from chameleon_megatron.resilience.store.joiners import allocate_join_id

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerSlot:
    """How a worker of one local slot is started."""

    local_rank: int
    args: tuple[str, ...]
    """Command line."""
    env: dict[str, str]
    """Whole environment; ``WORLD_SIZE`` is the launch's (join ids start there); ``RANK``
    the launched worker's (a joining node's slots have none)."""
    stdout: str = ""
    """Log file to append to; empty: the agent's own stream."""
    stderr: str = ""


@dataclass
class Member:
    """One worker process: a launched worker, or a joiner."""

    rank: int
    """Launch rank; a joiner's join id."""
    slot: WorkerSlot
    proc: subprocess.Popen
    started_at: float
    joiner: bool = False
    logs: list[IO[str]] = field(default_factory=list)
    """Log files this pool opened (closed when the process exits)."""
    exitcode: int | None = None
    """Popen's exit status (negative for a signal), once it has exited."""

    def finish(self, code: int) -> None:
        self.exitcode = code
        for log in self.logs:
            log.close()


class WorkerPool:
    """The members of one agent, their failures, and their restarts."""

    def __init__(self, job: JobStore, ft: ResilienceConfig, *, node: str,
                 nodes: NodeWatch) -> None:
        self._job = job
        self._ft = ft
        self._node = node
        self._nodes = nodes
        self.members: dict[int, Member] = {}
        """launch rank (or join id) -> its process."""
        self._restarts: list[tuple[float, Member]] = []
        """(when, failed member) of restarts not yet done."""
        self._respawns_left = ft.respawns
        self._beats = tempfile.TemporaryDirectory(prefix="chameleon-beats-")
        self.beat_dir = Path(self._beats.name)
        """Where the workers write their heartbeats (``BEAT_DIR_ENV``; removed at exit)."""

    def add(self, member: Member) -> None:
        self.members[member.rank] = member

    def poll(self, now: float) -> None:
        """Reap exited workers, kill silent ones, start the restarts that are due."""
        self._reap(now)
        self._kill_silent(now)
        self._respawn_due(now)

    def watch(self, now: float) -> None:
        """One monitoring round of an agent: its workers, then its beat and the other
        agents' (their ranks announced when a node is lost)."""
        self.poll(now)
        for record in self._nodes.tick(now, node=self._node, finished=self.all_exited()):
            if announce(self._job, record):
                logger.error("node lost: rank %d announced failed (%s)", record.rank,
                             record.node)

    def all_exited(self) -> bool:
        """No worker runs and none is waiting to be restarted."""
        return not self._restarts and all(m.exitcode is not None for m in self.members.values())

    def all_left(self) -> bool:
        """Every worker the job went on without (``WORKER_LEFT_EXIT``), none to restart."""
        return self.all_exited() and bool(self.members) and all(
            m.exitcode == WORKER_LEFT_EXIT for m in self.members.values())

    def any_succeeded(self) -> bool:
        return any(m.exitcode == 0 for m in self.members.values())

    def spawn(self, slot: WorkerSlot, now: float, *, replaces: int | None = None) -> Member:
        """Start a joiner in ``slot`` (in place of failed rank ``replaces``, if any)."""
        join_id = allocate_join_id(self._job, int(slot.env["WORLD_SIZE"]))
        # RANK: the launch rank of the slot it restarts; its join id in a joining node's slot
        env = {"RANK": str(join_id), **slot.env, JOIN_ENV: str(join_id),
               BEAT_DIR_ENV: str(self.beat_dir)}
        logs = [_append(slot.stdout), _append(slot.stderr)]
        proc = subprocess.Popen(list(slot.args), env=env, stdout=logs[0], stderr=logs[1],
                                start_new_session=True)  # killable with its children (killpg)
        member = Member(join_id, slot, proc, now, joiner=True,
                        logs=[log for log in logs if log is not None])
        self.add(member)
        self._nodes.add_rank(join_id)
        self._job.store.set(f"join/spawned/{join_id}",
                            json.dumps({"failed": replaces, "time": now, "node": self._node}))
        logger.info({"event": "spawn", "join_id": join_id, "replaces": replaces,
                     "local_rank": slot.local_rank, "pid": proc.pid})
        return member

    def stop_joiners(self, sig: signal.Signals, timeout_s: float,
                     meanwhile: Callable[[], None] = lambda: None) -> None:
        """Stop the running joiners: ``sig``, ``meanwhile()`` (stopping the others), then
        SIGKILL for those still running ``timeout_s`` after the signal."""
        joiners = [m for m in self._running() if m.joiner]
        for member in joiners:
            _signal(member.proc, sig)
        deadline = time.monotonic() + timeout_s
        meanwhile()
        for member in joiners:
            try:
                member.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal(member.proc, signal.SIGKILL)
                member.proc.wait()
            member.finish(member.proc.returncode)

    def kill_all(self) -> None:
        """SIGKILL every running worker's session (this node stops at once)."""
        for member in self._running():
            _signal(member.proc, signal.SIGKILL)
        for member in self._running():
            with contextlib.suppress(subprocess.TimeoutExpired):
                member.proc.wait(timeout=10)
            member.finish(member.proc.returncode if member.proc.returncode is not None
                          else -signal.SIGKILL)
        self._restarts.clear()

    def _running(self) -> list[Member]:
        return [m for m in self.members.values() if m.exitcode is None]

    def _reap(self, now: float) -> None:
        """Record each newly exited worker; announce it unless it exited cleanly."""
        for member in self._running():
            code = member.proc.poll()
            if code is None:
                continue
            member.finish(code)
            # what the worker left in its session (a checkpoint writer's manager, say) ends
            # with it: nobody else would stop it
            _signal(member.proc, signal.SIGKILL)
            if code == 0:
                continue
            self._failed(member, FailureRecord(
                rank=member.rank, time=now, node=self._node,
                reason="signal" if code < 0 else "exit",
                exitcode=None if code < 0 else code,
                signal=signal.Signals(-code).name if code < 0 else None,
            ))

    def _kill_silent(self, now: float) -> None:
        """Kill and announce running workers whose heartbeat deadline has passed."""
        running = self._running()
        beats = read_beats(self.beat_dir, [m.rank for m in running])
        silent = [(member, late) for member in running
                  if (late := overdue(beats, [member.rank], now=now,
                                      started_at=member.started_at,
                                      startup_timeout_s=self._ft.startup_timeout_s))]
        _stacks([member.proc for member, _ in silent])
        for member, late in silent:
            _signal(member.proc, signal.SIGKILL)  # its own session: the worker and its children
            try:
                member.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:  # stuck in the kernel; count it dead anyway
                logger.error("rank %d did not exit after SIGKILL", member.rank)
            code = member.proc.returncode
            member.finish(-signal.SIGKILL if code is None else code)
            last_seen = late[member.rank]
            logger.error("rank %d silent for %.1f s (last beat: %s), killed", member.rank,
                         now - last_seen, beats.get(member.rank))
            self._failed(member, FailureRecord(
                rank=member.rank, time=now, reason="heartbeat", node=self._node,
                signal="SIGKILL", last_seen=last_seen))

    def _failed(self, member: Member, record: FailureRecord) -> None:
        """Announce a failed worker and schedule its restart while the budget lasts."""
        if announce(self._job, record):
            logger.error("worker failed: %s", record.to_json())
        if self._respawns_left > 0 and not self._ended():
            self._respawns_left -= 1
            self._restarts.append((record.time + self._ft.respawn_delay_s, member))

    def _respawn_due(self, now: float) -> None:
        due = [failed for when, failed in self._restarts if when <= now]
        self._restarts = [(when, failed) for when, failed in self._restarts if when > now]
        for failed in due:
            why = self._ended()
            if why:
                logger.info({"event": "respawn_skipped", "failed_rank": failed.rank,
                             "why": why})
                continue
            self.spawn(failed.slot, now, replaces=failed.rank)

    def _ended(self) -> str:
        """Why no worker is restarted any more ("": it still is)."""
        if self._job.is_done():
            return "job done"
        failure = self._job.failure()
        return f"job failed: {failure}" if failure is not None else ""


def _append(path: str) -> IO[str] | None:
    """A worker's log file opened to append; None (inherit the agent's) for a console stream."""
    return open(path, "a") if path else None  # noqa: SIM115 (closed when the worker exits)


def _stacks(procs: list[subprocess.Popen]) -> None:
    """Ask silent workers (not their children) where they hang: their threads' stacks, in
    their logs, before the kill (one grace period for all of them)."""
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, STACKS_SIGNAL)
    if procs:
        time.sleep(STACKS_GRACE_S)


def _signal(proc: subprocess.Popen, sig: signal.Signals) -> None:
    """Signal a worker's whole session (its process group)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
