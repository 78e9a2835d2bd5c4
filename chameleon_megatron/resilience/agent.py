"""The elastic agent of chameleon-run: a failed worker is announced, the survivors keep running.

torchrun's ``LocalElasticAgent`` stops every worker as soon as one exits non-zero. This
subclass replaces only the monitoring step: each worker process is polled on its own; a
failure (exit code or signal) is announced once in the job store, which this agent (node 0's)
hosts and which therefore outlives every worker; a worker silent past its heartbeat deadline
is killed and announced; an agent whose own beat stops (a lost node) is announced with all its
ranks by the others. The agent reports its workers healthy while any runs, then waits until
every agent is finished or lost, so the store stays up as long as anyone trains.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import time
from typing import Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from chameleon_megatron.resilience.announce import FailureRecord, announce
from chameleon_megatron.resilience.config import ResilienceConfig
from chameleon_megatron.resilience.heartbeat import overdue, read_beats
from chameleon_megatron.resilience.job_store import JobStore
from chameleon_megatron.resilience.nodes import NodeWatch

logger = logging.getLogger(__name__)


class ChameleonAgent(LocalElasticAgent):
    """A ``LocalElasticAgent`` whose workers outlive each other's failures."""

    def __init__(self, *args: Any, ft: ResilienceConfig, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._ft = ft
        self._node = f"{socket.gethostname()}:{os.getpid()}"
        self._job: JobStore | None = None
        self._nodes: NodeWatch | None = None
        self._exitcodes: dict[int, int] = {}
        """local rank -> exit status (Popen's: negative for a signal), once it has exited."""
        self._started_at = 0.0

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        self._job = JobStore.connect(worker_group.master_addr, worker_group.master_port,
                                     worker_group.spec.rdzv_handler.get_run_id())
        self._nodes = NodeWatch(self._job, worker_group.group_rank, worker_group.group_world_size,
                                [w.global_rank for w in worker_group.workers],
                                timeout_s=self._ft.node_timeout_s)
        self._exitcodes = {}
        self._started_at = time.time()
        pids = super()._start_workers(worker_group)
        if not hasattr(self._pcontext, "subprocess_handlers"):
            raise ValueError("--chameleon-ft needs workers started as commands, not --run-path")
        return pids

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        job, nodes = self._job, self._nodes
        assert job is not None and nodes is not None, "workers not started"
        now = time.time()
        self._reap(job, worker_group, now)
        self._kill_silent(job, worker_group, now)
        for record in nodes.tick(now, node=self._node, finished=self._all_exited()):
            if announce(job, record):
                logger.error("node lost: rank %d announced failed (%s)", record.rank, record.node)
        if not self._all_exited() or not nodes.job_finished():
            return RunResult(state=WorkerState.HEALTHY)
        return self._result(worker_group)

    def _exit_barrier(self) -> None:
        """Already done in ``_monitor_workers`` (a barrier that tolerates lost nodes)."""

    def _handlers(self) -> dict[int, Any]:
        return self._pcontext.subprocess_handlers  # type: ignore[union-attr]

    def _all_exited(self) -> bool:
        return len(self._exitcodes) == len(self._handlers())

    def _reap(self, job: JobStore, worker_group: WorkerGroup, now: float) -> None:
        """Record each newly exited worker; announce it unless it exited cleanly."""
        for local_rank, handler in self._handlers().items():
            code = handler.proc.poll()
            if code is None or local_rank in self._exitcodes:
                continue
            self._exitcodes[local_rank] = code
            if code == 0:
                continue
            rank = worker_group.workers[local_rank].global_rank
            record = FailureRecord(
                rank=rank, time=now, node=self._node,
                reason="signal" if code < 0 else "exit",
                exitcode=None if code < 0 else code,
                signal=signal.Signals(-code).name if code < 0 else None,
            )
            if announce(job, record):
                logger.error("worker failed: %s", record.to_json())

    def _kill_silent(self, job: JobStore, worker_group: WorkerGroup, now: float) -> None:
        """Kill and announce running workers whose heartbeat deadline has passed."""
        running = {worker_group.workers[lr].global_rank: lr for lr in self._handlers()
                   if lr not in self._exitcodes}
        beats = read_beats(job, running)
        late = overdue(beats, running, now=now, started_at=self._started_at,
                       startup_timeout_s=self._ft.startup_timeout_s)
        for rank, last_seen in late.items():
            proc = self._handlers()[running[rank]].proc
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: the worker and its children
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:  # stuck in the kernel; count it dead anyway
                logger.error("rank %d did not exit after SIGKILL", rank)
            code = proc.returncode
            self._exitcodes[running[rank]] = -signal.SIGKILL if code is None else code
            record = FailureRecord(rank=rank, time=now, reason="heartbeat", node=self._node,
                                   signal="SIGKILL", last_seen=last_seen)
            if announce(job, record):
                logger.error("worker silent for %.1f s (last beat: %s), killed: %s",
                             now - last_seen, beats.get(rank), record.to_json())

    def _result(self, worker_group: WorkerGroup) -> RunResult:
        """Succeeded when any local worker finished cleanly (the job trained to the end)."""
        ranks = {lr: worker_group.workers[lr].global_rank for lr in self._handlers()}
        if any(code == 0 for code in self._exitcodes.values()):
            return RunResult(state=WorkerState.SUCCEEDED,
                             return_values={ranks[lr]: None for lr in ranks})
        failures = {
            ranks[lr]: ProcessFailure(local_rank=lr, pid=h.proc.pid, exitcode=self._exitcodes[lr],
                                      error_file=self._pcontext.error_files[lr])  # type: ignore[union-attr]
            for lr, h in self._handlers().items()
        }
        return RunResult(state=WorkerState.FAILED, failures=failures)
