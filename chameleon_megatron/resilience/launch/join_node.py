"""A node that joins a running chameleon-run job (``--chameleon-ft-join``).

torchrun's rendezvous is closed once the job runs, and a node waiting at it would make
torch's agents restart every worker, so a new (or repaired) node does not go through it:
its agent connects to the job store at the job's rendezvous endpoint (``--master-addr`` /
``--master-port`` for the static backend, ``--rdzv-endpoint`` for c10d) under the job's
``--rdzv-id``, registers as the next agent, and starts ``--nproc-per-node`` workers, each a
joiner with a fresh launch-rank id (``joiners.py``) that the job admits at a step boundary.
From then on it is an agent like the launch's: its workers are a ``WorkerPool``, it beats, it
watches the other agents, and it exits when its workers have and the job is finished.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import socket
import sys
import time
from typing import Iterator

import torch.distributed as dist
import torch.distributed.run as torchrun
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from chameleon_megatron.resilience.config import ResilienceConfig
from chameleon_megatron.resilience.launch.quorum import CUT_OFF_EXIT
from chameleon_megatron.resilience.launch.deadline import Unanswered, within
from chameleon_megatron.resilience.launch.nodes import NodeWatch, read_launch, register_joined_node
from chameleon_megatron.resilience.launch.worker_pool import WorkerPool, WorkerSlot
from chameleon_megatron.resilience.store.env import AGENT_ENV
from chameleon_megatron.resilience.store.job_store import JobStore

logger = logging.getLogger(__name__)

C10D_DEFAULT_PORT = 29400
"""torchrun's default port of a c10d rendezvous endpoint."""


def store_endpoint(args: argparse.Namespace) -> tuple[str, int]:
    """Where the running job's store is, from torchrun's arguments."""
    if args.standalone:
        raise ValueError("--standalone with --chameleon-ft-join: a standalone job's store is "
                         "on a random local port; join with the job's --rdzv-endpoint (or "
                         "--master-addr/--master-port) and --rdzv-id")
    return parse_rendezvous_endpoint(torchrun.get_rdzv_endpoint(args),
                                     default_port=C10D_DEFAULT_PORT)


def run_joining_node(args: argparse.Namespace, ft: ResilienceConfig) -> int:
    """Join the running job with this node's workers; 0 when any of them trained to the end."""
    host, port = store_endpoint(args)
    config, cmd, cmd_args = torchrun.config_from_args(args)
    if not isinstance(cmd, str):
        raise ValueError("--run-path: not supported with --chameleon-ft")
    job = JobStore.connect(host, port, config.run_id, timeout_s=ft.startup_timeout_s)
    launch = read_launch(job, timeout_s=ft.startup_timeout_s)
    group_rank = register_joined_node(job, launch)
    node = f"{socket.gethostname()}:{os.getpid()}"
    nodes = NodeWatch(job, group_rank, launch.nodes, [], timeout_s=ft.node_timeout_s)
    pool = WorkerPool(job, ft, node=node, nodes=nodes)
    logger.info({"event": "node_join", "group_rank": group_rank, "store": f"{host}:{port}",
                 "run_id": config.run_id, "workers": config.nproc_per_node})
    base_env = {**os.environ, AGENT_ENV: "1", "MASTER_ADDR": host, "MASTER_PORT": str(port),
                "TORCHELASTIC_RUN_ID": config.run_id, "WORLD_SIZE": str(launch.world_size),
                "LOCAL_WORLD_SIZE": str(config.nproc_per_node), "GROUP_RANK": str(group_rank)}
    with _exit_on_sigterm():
        try:
            now = time.time()
            for local_rank in range(config.nproc_per_node):
                pool.spawn(WorkerSlot(local_rank, (cmd, *cmd_args),
                                      {**base_env, "LOCAL_RANK": str(local_rank)}), now)
            return _watch(pool, nodes, config.monitor_interval, ft.node_timeout_s)
        finally:
            pool.stop_joiners(signal.SIGTERM, timeout_s=30)


@contextlib.contextmanager
def _exit_on_sigterm() -> Iterator[None]:
    """SIGTERM unwinds (so the workers are stopped) instead of killing this agent alone."""
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _watch(pool: WorkerPool, nodes: NodeWatch, interval_s: float, window_s: float) -> int:
    """Monitor until this node's workers have exited and every other agent is done."""
    while True:
        try:
            within(window_s, lambda: pool.watch(time.time()))
        except (dist.DistNetworkError, Unanswered) as exc:
            if pool.all_exited():  # the host left after the job finished
                return 0 if pool.any_succeeded() else 1
            # node 0 is gone or out of reach; the launch's survivors resume without this
            # node (it was not in their rendezvous): it can join the resumed job
            pool.kill_all()
            logger.error("cut off from the job: job store lost (%s): this node's workers are "
                         "stopped; join the resumed job again with --chameleon-ft-join", exc)
            return CUT_OFF_EXIT
        if pool.all_exited() and nodes.job_finished():
            return 0 if pool.any_succeeded() else 1
        time.sleep(interval_s)
