"""The checkpoint-restart baseline of ``scripts/bench_vs_restart.py`` really restarts: run
small through the script's own functions, a worker killed in step 6 makes torchrun restart
every worker, which load the checkpoint of step 3 (every 3 steps), redo steps 4 and 5 and
finish all 7.

The kill is fired from outside once step 5's record appears; it must land before step 6
completes. With the tiny model's 0.1 s steps a loaded machine lost that race (steps 1-6, then
4-7), so its sequences are 512 tokens long: ~0.5 s steps quiet, far above a kill's latency,
and a checkpoint as small as before."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench_vs_restart import (  # noqa: E402
    Job, check_inputs, failure_costs, restart_baseline, victims, young_interval,
)
from dist_utils import TINY  # noqa: E402
from job_watch import Kill  # noqa: E402


@pytest.mark.multiproc
@pytest.mark.serial
@pytest.mark.timeout(240)
def test_restart_baseline_loads_the_checkpoint_and_redoes_the_steps_after_it(
        tmp_path: Path) -> None:
    model = list(TINY)
    model[model.index("--seq-length") + 1] = "512"
    job = Job(model=tuple(model), nproc=2, iters=7, timeout_s=180)
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


@pytest.mark.parametrize("iters, fail_at, mtbf_s, nproc, message", [
    (36, [8, 20], 0.0, 4, "--mtbf-s=0.0: must be > 0"),
    (36, [8, 40], None, 4, "--fail-at=[8, 40]: each step must be in 3..36"),
    (36, [20, 8], None, 4, "--fail-at=[20, 8]: must be increasing"),
    (36, [8], None, 1, "--nproc=1: must be >= 2"),
])
def test_bad_inputs_are_refused_in_one_line(iters, fail_at, mtbf_s, nproc, message) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        check_inputs(iters, fail_at, mtbf_s, nproc)


def test_young_interval_and_victims() -> None:
    """sqrt(2 x 8 s x 100 s) = 40 s = 10 steps of 4 s; victims spare rank 0 and differ."""
    assert young_interval(8.0, 100.0, 4.0) == 10
    assert young_interval(0.01, 1.0, 10.0) == 1
    assert victims(4, 3) == (3, 1, 2) and victims(8, 3) == (7, 1, 6)
