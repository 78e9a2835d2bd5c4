"""Survivors regroup in-process under chameleon-run: two failures in sequence (each time the
world's rank 0), a spare waiting out one generation and joining the next, megatron's parallel
state rebuilt for the new layout each time.

Run as a script, this file is the worker program of the test.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rt_support import guard_worker, run_launcher  # noqa: E402

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(150), pytest.mark.serial]

DIES_IN = {0: 0, 1: 1}
"""generation -> launch rank that exits during it (both are rank 0 of their world)."""
ACTIVE = 2
"""The stand-in decision: the first two members are active (TP1 x PP2), the rest spares."""


def worker_main(out: Path) -> int:
    guard_worker(120)
    import datetime

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from chameleon_megatron.megatron import groups
    from chameleon_megatron.resilience.config import ResilienceConfig
    from chameleon_megatron.resilience.recovery.detector import FailureDetector, is_communication_error
    from chameleon_megatron.resilience.store.job_store import JobStore
    from chameleon_megatron.resilience.recovery.regroup import (
        agree_membership, join_world, wait_as_spare,
    )

    me = int(os.environ["RANK"])
    job = JobStore.from_env()
    detector = FailureDetector(job, me, ResilienceConfig(startup_timeout_s=30))
    detector.beat()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    groups.build_uniform(tp=1, pp=2, timeout_s=3)
    assert groups.set_timeouts(3) > 1  # the default group too (started with 30 s)
    members, generation, active, log = tuple(range(4)), 0, True, []
    while True:
        if active:
            world = torch.ones(1)
            dist.all_reduce(world)
            log.append({"gen": generation, "world": dist.get_world_size(), "sum": world.item(),
                        "rank": dist.get_rank(), "pp": ps.get_pipeline_model_parallel_world_size(),
                        "dp": ps.get_data_parallel_world_size()})
            if DIES_IN.get(generation) == me:
                time.sleep(0.3)
                os._exit(3)
            if generation not in DIES_IN:
                break
            try:
                while True:  # "train" until the failure surfaces
                    dist.all_reduce(torch.ones(1))
                    time.sleep(0.05)
            except RuntimeError as exc:
                assert is_communication_error(exc), exc
            assert detector.wait_for_events(timeout_s=20).failures, "no failure announced"
        else:
            log.append({"gen": generation, "spare": True})
            if wait_as_spare(job, generation, active=members[:ACTIVE],
                             on_wait=detector.beat) == "done":
                break
            detector.new_failures()
        generation += 1
        membership = agree_membership(job, generation, me, members, timeout_s=30,
                                      on_wait=detector.beat)
        members = membership.members
        log[-1]["next_members"] = list(members)
        active = me in members[:ACTIVE]
        if active:
            join_world(job, membership, members.index(me), ACTIVE, backend="gloo", timeout_s=3)
            groups.build_uniform(tp=1, pp=2, timeout_s=3)
    job.mark_done()
    (out / f"{me}.json").write_text(json.dumps(log))
    return 0


def test_two_failures_in_sequence_with_a_spare_rejoining(tmp_path: Path) -> None:
    args = ["--standalone", "--nproc-per-node=4", "--monitor-interval=0.1", __file__,
            str(tmp_path), "--chameleon-ft"]
    code, _ = run_launcher(args, tmp_path / "log", timeout_s=140)
    log = (tmp_path / "log").read_text()
    assert code == 0, log[-4000:]
    first = {"gen": 0, "world": 4, "sum": 4.0, "pp": 2, "dp": 2}
    rank2 = json.loads((tmp_path / "2.json").read_text())
    rank3 = json.loads((tmp_path / "3.json").read_text())
    assert not (tmp_path / "0.json").exists() and not (tmp_path / "1.json").exists()
    assert rank2 == [
        {**first, "rank": 2, "next_members": [1, 2, 3]},
        {"gen": 1, "world": 2, "sum": 2.0, "rank": 1, "pp": 2, "dp": 1, "next_members": [2, 3]},
        {"gen": 2, "world": 2, "sum": 2.0, "rank": 0, "pp": 2, "dp": 1},
    ], log[-4000:]
    assert rank3 == [
        {**first, "rank": 3, "next_members": [1, 2, 3]},
        {"gen": 1, "spare": True, "next_members": [2, 3]},
        {"gen": 2, "world": 2, "sum": 2.0, "rank": 1, "pp": 2, "dp": 1},
    ], log[-4000:]


if __name__ == "__main__":
    sys.exit(worker_main(Path(sys.argv[1])))
