"""The checkpoint-restart baseline of ``scripts/bench_vs_restart.py`` really restarts: run
small through the script's own functions, a worker killed in step 6 makes torchrun restart
every worker, which load the checkpoint of step 3 (every 3 steps), redo steps 4 and 5 and
finish all 7."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench_vs_restart import Job, failure_costs, restart_baseline  # noqa: E402
from dist_utils import TINY  # noqa: E402
from job_watch import Kill  # noqa: E402

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(240), pytest.mark.serial]


def test_restart_baseline_loads_the_checkpoint_and_redoes_the_steps_after_it(
        tmp_path: Path) -> None:
    job = Job(model=tuple(TINY), nproc=2, iters=7, timeout_s=180)
    kills = (Kill(step=6, rank=1),)
    trace = restart_baseline(job, tmp_path, kills, interval=3)
    done = [it for _, it in trace.iterations()]
    assert done == [1, 2, 3, 4, 5, 4, 5, 6, 7], done  # two runs in one metrics file
    runs = [r["run_id"] for _, r in trace.records if r["event"] == "run"]
    assert len(runs) == 2, runs
    [cost] = failure_costs(trace, kills)
    assert (cost.step, cost.resumed_from, cost.redone) == (6, 3, (4, 5)), cost
    assert 0 < cost.downtime_s < cost.back_s, cost
    assert (tmp_path / "ckpt-restart" / "latest_checkpointed_iteration.txt").read_text() == "7\n"
