"""Losing the job store (node 0 with its agent): a majority of the surviving nodes resumes
the job from its last checkpoint among themselves, without anyone relaunching it; a minority
stops.

Unit tests of the relaunch rule (who survives, the new launch's arguments, the refusals), and
end to end: two chameleon-run nodes of two workers each (static rendezvous, DP2 x PP2,
checkpoints every 2 steps); once the checkpoint of step 4 exists, node 0 (agent and workers)
is killed. Node 1's agent finds the store gone; alone it holds no majority of the launch's
agents, so it stops with status 75. The majority's resume runs over real links in
``test_partition.py``.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.distributed.run as torchrun

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from e2e_support import FT, job_args, leftover  # noqa: E402
from rt_support import free_port, start_launcher, stop  # noqa: E402

from chameleon_megatron.resilience.store.job_store import JobStore
from chameleon_megatron.resilience.launch.nodes import NodeWatch
from chameleon_megatron.resilience.launch.quorum import CUT_OFF_EXIT
from chameleon_megatron.resilience.launch.store_loss import StoreLost, relaunch_args

pytestmark = [pytest.mark.timeout(300), pytest.mark.serial]

ITERS = 16


def _args(*flags: str, training: tuple[str, ...] = ("--save", "/ckpt")) -> argparse.Namespace:
    return torchrun.parse_args(["--nnodes=3", "--nproc-per-node=2", "--master-addr=10.0.0.1",
                                "--master-port=29500", *flags, "train.py",
                                "--pipeline-model-parallel-size", "2", *training])


def test_every_survivor_derives_the_same_relaunch() -> None:
    survivors = [(1, "10.0.0.2"), (2, "10.0.0.3")]
    first = relaunch_args(_args("--node-rank=1"), StoreLost(survivors, 1, "Broken pipe", launch_agents=3))
    second = relaunch_args(_args("--node-rank=2"), StoreLost(survivors, 2, "Broken pipe", launch_agents=3))
    for new, rank in ((first, 0), (second, 1)):
        assert (new.nnodes, new.node_rank, new.master_addr, new.master_port) == (
            "2", rank, "10.0.0.2", 29500)
        assert new.training_script_args[-2:] == ["--load", "/ckpt"]
    kept = relaunch_args(_args(training=("--save", "/a", "--load", "/b")),
                         StoreLost(survivors, 1, "x", launch_agents=3))
    assert kept.training_script_args.count("--load") == 1  # its own --load stays


@pytest.mark.parametrize("flags, training, survivors, message", [
    (("--rdzv-backend=c10d", "--rdzv-endpoint=h:1"), ("--save", "/c"), [(1, "a")],
     "--rdzv-backend=c10d: the survivors relaunch by themselves only from a static"),
    ((), (), [(1, "a")], "no checkpoint directory"),
    ((), ("--save", "/c", "--tensor-model-parallel-size", "4"), [(1, "a")],
     r"1 surviving nodes x 2 workers = 2 ranks: not a multiple of TP x PP = 8"),
    ((), ("--save", "/c"), [(2, "a")], "group rank 1.* is not among the survivors"),
])
def test_a_relaunch_that_cannot_work_is_refused(flags, training, survivors, message) -> None:
    with pytest.raises(ValueError, match=message):
        relaunch_args(_args(*flags, training=training), StoreLost(survivors, 1, "x", launch_agents=3))


def test_survivors_are_the_launch_agents_still_training_but_the_host() -> None:
    job = JobStore(dist.HashStore(), "run")
    watch = {g: NodeWatch(job, g, 4, [g], timeout_s=10.0, addr=f"10.0.0.{g}") for g in range(4)}
    for now in (0.0, 1.0):
        for g in (3, 2, 0, 1):
            watch[g].tick(now, node=f"n{g}", finished=g == 3 and now == 1.0)
    # agent 2 falls silent; 3 finished (its workers exited): neither is a survivor
    watch[1].tick(12.0, node="n1", finished=False)
    assert watch[1].launch_survivors() == [(1, "10.0.0.1")]
    assert watch[2].launch_survivors() == [(1, "10.0.0.1"), (2, "10.0.0.2")]


def _kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants (a lost node: agent and workers)."""
    def descendants(p: int) -> list[int]:
        found = []
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                children = (task / "children").read_text().split()
            except OSError:
                continue
            for child in map(int, children):
                found += [child, *descendants(child)]
        return found
    for victim in [pid, *descendants(pid)]:
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.multiproc
def test_a_lone_surviving_node_stops_when_node_0_is_lost(tmp_path: Path) -> None:
    """Two nodes; node 0 (the store's host) is killed after the checkpoint of step 4. Node 1
    cannot tell that from a cut link, and alone it is no majority of the launch's two agents
    (``quorum``): it stops its workers and exits 75 with one line, rather than resume a job
    that node 0 might still be training. (A majority resumes: ``test_partition``.)"""
    ckpt = tmp_path / "ckpt"
    rdzv = ["--nnodes=2", "--master-addr=127.0.0.1", f"--master-port={free_port()}",
            "--rdzv-id=rt-store"]
    args = job_args(tmp_path, 2, [
        "--pipeline-model-parallel-size", "2", "--save", str(ckpt), "--save-interval", "2",
        *FT, "--chameleon-ft-startup-timeout-s", "120", "--pace-s", "0.3"], ITERS)
    node0 = start_launcher(["--node-rank=0", *rdzv, *args], tmp_path / "log0")
    node1 = start_launcher(["--node-rank=1", *rdzv, *args], tmp_path / "log")
    try:
        tracker = ckpt / "latest_checkpointed_iteration.txt"
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline and node1.poll() is None and not (
                tracker.exists() and int(tracker.read_text() or 0) >= 4):
            time.sleep(0.05)
        _kill_tree(node0.pid)
        code = node1.wait(timeout=200)
    finally:
        stop(node0)
        stop(node1)
    log = (tmp_path / "log").read_text()
    assert code == CUT_OFF_EXIT, log[-6000:]
    (line,) = [ln for ln in log.splitlines() if "error: cut off from the job" in ln]
    assert "holds 1 of the launch's 2 agents (no majority)" in line, line
    assert '"event": "relaunch"' not in log
    assert not leftover(tmp_path), "workers left behind"
