"""The elastic agent of chameleon-run: a failed worker is announced, the survivors keep running.

torchrun's ``LocalElasticAgent`` stops every worker as soon as one exits non-zero. This
subclass replaces only the monitoring step: each worker process is polled on its own; a
failure (exit code or signal) is announced once in the job store, which this agent (node 0's)
hosts and which therefore outlives every worker; a worker silent past its heartbeat deadline
is killed and announced; an agent whose own beat stops (a lost node) is announced with all its
ranks by the others. The agent reports its workers healthy while any runs, then waits until
every agent is finished or lost, so the store stays up as long as anyone trains.

With ``ft.respawns``, a failed worker's slot is restarted after ``ft.respawn_delay_s``: a new
process with the same command line and environment plus a fresh launch-rank id (a joiner, see
``joiners.py``), which the job admits at its next step boundary. Joiners are monitored like
the launched workers, under their join ids.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from typing import IO, Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from chameleon_megatron.resilience.announce import FailureRecord, announce
from chameleon_megatron.resilience.config import ResilienceConfig
from chameleon_megatron.resilience.heartbeat import overdue, read_beats
from chameleon_megatron.resilience.job_store import JobStore
from chameleon_megatron.resilience.joiners import JOIN_ENV, allocate_join_id
from chameleon_megatron.resilience.nodes import NodeWatch

logger = logging.getLogger(__name__)


@dataclass
class _Member:
    """One worker process of this agent: a launched worker, or a joiner restarted in its slot."""

    rank: int
    """Launch rank; a joiner's join id."""
    slot: int
    """Local rank whose command line, environment and log files it uses."""
    proc: subprocess.Popen
    started_at: float
    joiner: bool = False
    logs: list[IO[str]] = field(default_factory=list)
    """A joiner's log files (torch closes the launched workers')."""
    exitcode: int | None = None
    """Popen's exit status (negative for a signal), once it has exited."""

    def finish(self, code: int) -> None:
        self.exitcode = code
        for log in self.logs:
            log.close()


class ChameleonAgent(LocalElasticAgent):
    """A ``LocalElasticAgent`` whose workers outlive each other's failures."""

    def __init__(self, *args: Any, ft: ResilienceConfig, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._ft = ft
        self._node = f"{socket.gethostname()}:{os.getpid()}"
        self._job: JobStore | None = None
        self._nodes: NodeWatch | None = None
        self._members: dict[int, _Member] = {}
        """launch rank (or join id) -> its process."""
        self._restarts: list[tuple[float, _Member]] = []
        """(when, failed member) of restarts not yet done."""
        self._respawns_left = ft.respawns

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        self._job = JobStore.connect(worker_group.master_addr, worker_group.master_port,
                                     worker_group.spec.rdzv_handler.get_run_id())
        self._nodes = NodeWatch(self._job, worker_group.group_rank, worker_group.group_world_size,
                                [w.global_rank for w in worker_group.workers],
                                timeout_s=self._ft.node_timeout_s)
        self._restarts = []
        started_at = time.time()
        pids = super()._start_workers(worker_group)
        if not hasattr(self._pcontext, "subprocess_handlers"):
            raise ValueError("--chameleon-ft needs workers started as commands, not --run-path")
        handlers = self._pcontext.subprocess_handlers
        self._members = {w.global_rank: _Member(w.global_rank, w.local_rank,
                                                handlers[w.local_rank].proc, started_at)
                         for w in worker_group.workers}
        return pids

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        job, nodes = self._job, self._nodes
        assert job is not None and nodes is not None, "workers not started"
        now = time.time()
        self._reap(job, now)
        self._kill_silent(job, now)
        self._respawn_due(job, now)
        for record in nodes.tick(now, node=self._node, finished=self._all_exited()):
            if announce(job, record):
                logger.error("node lost: rank %d announced failed (%s)", record.rank, record.node)
        if not self._all_exited() or not nodes.job_finished():
            return RunResult(state=WorkerState.HEALTHY)
        return self._result()

    def _exit_barrier(self) -> None:
        """Already done in ``_monitor_workers`` (a barrier that tolerates lost nodes)."""

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        """Stop the joiners too (torch's process context knows only the launched workers)."""
        joiners = [m for m in self._members.values() if m.joiner and m.exitcode is None]
        for member in joiners:
            _signal(member.proc, death_sig)
        super()._shutdown(death_sig, timeout)
        deadline = time.monotonic() + timeout
        for member in joiners:
            try:
                member.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal(member.proc, signal.SIGKILL)
                member.proc.wait()
            member.finish(member.proc.returncode)

    def _all_exited(self) -> bool:
        """No worker runs and none is waiting to be restarted."""
        return not self._restarts and all(m.exitcode is not None for m in self._members.values())

    def _running(self) -> list[_Member]:
        return [m for m in self._members.values() if m.exitcode is None]

    def _reap(self, job: JobStore, now: float) -> None:
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
            self._failed(job, member, FailureRecord(
                rank=member.rank, time=now, node=self._node,
                reason="signal" if code < 0 else "exit",
                exitcode=None if code < 0 else code,
                signal=signal.Signals(-code).name if code < 0 else None,
            ))

    def _kill_silent(self, job: JobStore, now: float) -> None:
        """Kill and announce running workers whose heartbeat deadline has passed."""
        running = self._running()
        beats = read_beats(job, [m.rank for m in running])
        for member in running:
            late = overdue(beats, [member.rank], now=now, started_at=member.started_at,
                           startup_timeout_s=self._ft.startup_timeout_s)
            if not late:
                continue
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
            self._failed(job, member, FailureRecord(
                rank=member.rank, time=now, reason="heartbeat", node=self._node,
                signal="SIGKILL", last_seen=last_seen))

    def _failed(self, job: JobStore, member: _Member, record: FailureRecord) -> None:
        """Announce a failed worker and schedule its restart while the budget lasts."""
        if announce(job, record):
            logger.error("worker failed: %s", record.to_json())
        if self._respawns_left > 0 and not job.is_done():
            self._respawns_left -= 1
            self._restarts.append((record.time + self._ft.respawn_delay_s, member))

    def _respawn_due(self, job: JobStore, now: float) -> None:
        due = [failed for when, failed in self._restarts if when <= now]
        self._restarts = [(when, failed) for when, failed in self._restarts if when > now]
        for failed in due:
            if job.is_done():
                logger.info({"event": "respawn_skipped", "failed_rank": failed.rank,
                             "why": "job done"})
                continue
            self._respawn(job, failed, now)

    def _respawn(self, job: JobStore, failed: _Member, now: float) -> None:
        """Start ``failed``'s command line again as a joiner with a fresh launch-rank id."""
        pcontext = self._pcontext
        assert pcontext is not None, "workers not started"
        env = {**os.environ, **pcontext.envs[failed.slot]}
        join_id = allocate_join_id(job, int(env["WORLD_SIZE"]))
        env[JOIN_ENV] = str(join_id)
        logs = [_append(pcontext.stdouts[failed.slot]), _append(pcontext.stderrs[failed.slot])]
        proc = subprocess.Popen(failed.proc.args, env=env, stdout=logs[0], stderr=logs[1],
                                start_new_session=True)  # killable with its children (killpg)
        self._members[join_id] = _Member(join_id, failed.slot, proc, now, joiner=True,
                                         logs=[log for log in logs if log is not None])
        assert self._nodes is not None, "workers not started"
        self._nodes.add_rank(join_id)
        job.store.set(f"join/spawned/{join_id}",
                      json.dumps({"failed": failed.rank, "time": now, "node": self._node}))
        logger.info({"event": "respawn", "failed_rank": failed.rank, "join_id": join_id,
                     "delay_s": self._ft.respawn_delay_s, "pid": proc.pid})

    def _result(self) -> RunResult:
        """Succeeded when any local worker finished cleanly (the job trained to the end)."""
        if any(m.exitcode == 0 for m in self._members.values()):
            return RunResult(state=WorkerState.SUCCEEDED,
                             return_values=dict.fromkeys(self._members))
        error_files = self._pcontext.error_files  # type: ignore[union-attr]
        failures = {
            m.rank: ProcessFailure(local_rank=m.slot, pid=m.proc.pid, exitcode=m.exitcode,
                                   error_file=error_files[m.slot])
            for m in self._members.values()
        }
        return RunResult(state=WorkerState.FAILED, failures=failures)


def _append(path: str) -> IO[str] | None:
    """A worker's log file opened to append; None (inherit the agent's) for a console stream."""
    return open(path, "a") if path else None  # noqa: SIM115 (closed when the joiner exits)


def _signal(proc: subprocess.Popen, sig: signal.Signals) -> None:
    """Signal a worker's whole session (its process group)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
