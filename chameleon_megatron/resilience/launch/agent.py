"""The elastic agent of chameleon-run: a failed worker is announced, the survivors keep running.

torchrun's ``LocalElasticAgent`` stops every worker as soon as one exits non-zero. This
subclass replaces only the monitoring step: its workers are a ``WorkerPool`` (each polled on
its own, failures announced once in the job store, silent ones killed, failed slots
restarted as joiners with ``ft.respawns``); the store is hosted by this agent (node 0's) and
therefore outlives every worker; an agent whose own beat stops (a lost node) is announced
with all its ranks by the others. The agent reports its workers healthy while any runs, then
waits until every agent (including those of nodes that joined later, ``join_node.py``) is
finished or lost, so the store stays up as long as anyone trains. It never restarts the
worker group: a node waiting at the rendezvous is told to join with ``--chameleon-ft-join``.
When the store itself is lost (node 0 gone, or its link: a store call unanswered for
``ft.node_timeout_s``), it kills its workers and raises ``StoreLost`` with the surviving
agents it knows of; the launcher resumes the job from its checkpoint (``store_loss.py``)
when they are a majority, else the node is cut off and stops (``quorum.py``). Node 0's
agent, which hosts the store, stops its node the same way once it has lost more than half
of the launch's agents.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from chameleon_megatron.megatron import torch_seams
from chameleon_megatron.resilience.config import ResilienceConfig
from chameleon_megatron.resilience.launch import quorum
from chameleon_megatron.resilience.launch.deadline import Unanswered, within
from chameleon_megatron.resilience.launch.nodes import NodeWatch, publish_launch
from chameleon_megatron.resilience.launch.store_loss import StoreLost
from chameleon_megatron.resilience.launch.worker_pool import Member, WorkerPool, WorkerSlot
from chameleon_megatron.resilience.store.env import BEAT_DIR_ENV
from chameleon_megatron.resilience.store.job_store import JobStore

logger = logging.getLogger(__name__)


class ChameleonAgent(LocalElasticAgent):
    """A ``LocalElasticAgent`` whose workers outlive each other's failures."""

    def __init__(self, *args: Any, ft: ResilienceConfig, **kwargs: Any) -> None:
        torch_seams.check_agent_hooks(LocalElasticAgent)
        super().__init__(*args, **kwargs)
        self._ft = ft
        self._node = f"{socket.gethostname()}:{os.getpid()}"
        self._nodes: NodeWatch | None = None
        self._pool: WorkerPool | None = None
        self._told_waiting = False

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        job = JobStore.connect(worker_group.master_addr, worker_group.master_port,
                               worker_group.spec.rdzv_handler.get_run_id())
        publish_launch(job, world_size=worker_group.workers[0].world_size,
                       nodes=worker_group.group_world_size)
        addr = worker_group.spec.local_addr or reachable_addr(worker_group.master_addr,
                                                              worker_group.master_port)
        self._nodes = NodeWatch(job, worker_group.group_rank, worker_group.group_world_size,
                                [w.global_rank for w in worker_group.workers],
                                timeout_s=self._ft.node_timeout_s, addr=addr)
        self._pool = WorkerPool(job, self._ft, node=self._node, nodes=self._nodes)
        os.environ[BEAT_DIR_ENV] = str(self._pool.beat_dir)  # torchrun's workers inherit it
        started_at = time.time()
        pids = super()._start_workers(worker_group)
        started = torch_seams.started_workers(self)
        for w in worker_group.workers:
            proc, env, stdout, stderr = started[w.local_rank]
            slot = WorkerSlot(w.local_rank, tuple(proc.args), {**os.environ, **env}, stdout,
                              stderr)
            self._pool.add(Member(w.global_rank, slot, proc, started_at))
        return pids

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        pool, nodes = self._pool, self._nodes
        assert pool is not None and nodes is not None, "workers not started"
        try:
            within(self._ft.node_timeout_s, lambda: pool.watch(time.time()))
        except (dist.DistNetworkError, Unanswered) as exc:
            if pool.all_exited():  # the host left after the job finished
                return self._result(pool)
            pool.kill_all()  # before anything else: they must not write past this point
            raise StoreLost(nodes.launch_survivors(), worker_group.group_rank, str(exc),
                            launch_agents=nodes.launch_agents) from exc
        if worker_group.group_rank == 0:  # the store's host
            verdict = quorum.store_side(nodes.launch_agents, nodes.lost_launch_agents())
            if not verdict.go_on:
                pool.kill_all()
                raise quorum.CutOff("the other launch agents are silent", verdict)
        elif pool.all_left():  # not the store's host: nothing keeps this node up
            raise quorum.CutOff("every worker of this node was declared failed (the job went "
                                "on without them)", quorum.left_behind())
        if not pool.all_exited() or not nodes.job_finished():
            return RunResult(state=WorkerState.HEALTHY)
        return self._result(pool)

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        """Reached only for a node waiting at the rendezvous (max restarts is 0): restarting
        every worker would undo in-process recovery, so the node is told how to join."""
        if not self._told_waiting:
            logger.error("a node is waiting at the rendezvous: the workers are not restarted; "
                         "start it with --chameleon-ft-join to join the running job")
            self._told_waiting = True

    def _exit_barrier(self) -> None:
        """Already done in ``_monitor_workers`` (a barrier that tolerates lost nodes)."""

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        """Stop the joiners too (torch's process context knows only the launched workers)."""
        if self._pool is None:
            super()._shutdown(death_sig, timeout)
            return
        self._pool.stop_joiners(death_sig, timeout,
                                meanwhile=lambda: super(ChameleonAgent, self)._shutdown(
                                    death_sig, timeout))

    def _result(self, pool: WorkerPool) -> RunResult:
        """Succeeded when any local worker finished cleanly (the job trained to the end)."""
        if pool.any_succeeded():
            return RunResult(state=WorkerState.SUCCEEDED,
                             return_values=dict.fromkeys(pool.members))
        failures = {
            m.rank: ProcessFailure(local_rank=m.slot.local_rank, pid=m.proc.pid,
                                   exitcode=m.exitcode,
                                   error_file=torch_seams.error_file(self, m.slot.local_rank))
            for m in pool.members.values()
        }
        return RunResult(state=WorkerState.FAILED, failures=failures)


def reachable_addr(host: str, port: int) -> str:
    """This machine's address on the route to ``host`` (what the other nodes can reach; a
    UDP "connection" sends nothing)."""
    family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(sockaddr)
        return probe.getsockname()[0]
