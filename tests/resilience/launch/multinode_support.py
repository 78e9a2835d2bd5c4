"""Multi-node jobs over network-namespace hosts: ``scripts/launch_multinode.sh`` on each host,
the recovery tests' worker as the entry (shared by the partition tests and
``scripts/bench_link_blackout.py``)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterator, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from e2e_support import FT, job_args, records  # noqa: E402
from netns_support import Host  # noqa: E402
from rt_support import REPO, stop, worker_env  # noqa: E402

ITERS = 16
WINDOW_S = 10.0
"""--chameleon-ft-node-timeout-s: how long an agent may go unheard."""
BATCH = ["--global-batch-size", "12"]
"""Divisible by 2 x 3 and 2 x 2 data-parallel ranks of micro-batch 2."""


def start_node(host: Host, tmp: Path, node_rank: int, nnodes: int, master: Host, port: int,
               flags: list[str], iters: int = ITERS) -> subprocess.Popen:
    """``scripts/launch_multinode.sh`` on ``host`` as README documents it: one gloo worker,
    the recovery tests' worker as the entry."""
    preset = tmp / "preset.yaml"
    preset.write_text("megatron:\n  distributed_backend: gloo\n")
    log = open(tmp / f"log{node_rank}", "w")  # noqa: SIM115 (the process owns it)
    worker = job_args(tmp, 1, [*BATCH, *FT, "--chameleon-ft-node-timeout-s", str(WINDOW_S),
                               "--chameleon-ft-startup-timeout-s", "120", "--pace-s", "0.3",
                               *flags], iters)
    entry, trainer = worker[2], worker[3:]  # (after chameleon-run's own options)
    env = {**host.env(worker_env()), "NNODES": str(nnodes), "NODE_RANK": str(node_rank),
           "RDZV_ENDPOINT": f"{master.addr}:{port}", "RDZV_ID": "partition", "BACKEND": "gloo",
           "PYTHON": sys.executable, "CHAMELEON_ENTRY": entry}
    argv = ["bash", str(REPO / "scripts" / "launch_multinode.sh"), "1", str(preset), *trainer]
    return subprocess.Popen(host.command(argv), cwd=REPO, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)


@contextlib.contextmanager
def running(tmp: Path, on: Sequence[Host], port: int, flags: Sequence[str], *,
            iters: int = ITERS) -> Iterator[list[subprocess.Popen]]:
    """One node per host of ``on`` (node ranks in that order, the first host the rendezvous
    master), each ended with ``stop`` on exit, and so is any the caller appends."""
    procs = [start_node(h, tmp, i, len(on), on[0], port, list(flags), iters)
             for i, h in enumerate(on)]
    try:
        yield procs
    finally:
        for p in procs:
            stop(p)


def wait_for_step(tmp: Path, step: int, procs: list[subprocess.Popen]) -> None:
    """Until the job has recorded ``step`` steps (every launcher still running)."""
    wait_for(lambda: len(iterations(tmp)) >= step, 200, procs)


def wait_for(done: Callable[[], bool], timeout_s: float,
             procs: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "the job did not get there in time"
        assert all(p.poll() is None for p in procs), [p.poll() for p in procs]
        time.sleep(0.05)


def iterations(tmp: Path) -> list[int]:
    metrics = tmp / "metrics.jsonl"
    if not metrics.exists():
        return []
    return [r["iteration"] for r in records(metrics) if r["event"] == "iteration"]
