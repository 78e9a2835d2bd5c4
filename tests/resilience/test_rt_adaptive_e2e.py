"""Rerouting and heterogeneous re-plans executed in the live job (CPU, gloo, chameleon-run).

Every job is compared with a failure-free run in one process over the same global batch
(losses and initial weights do not depend on the layout): every iteration once, each loss
within 1e-4 relative, and at the end every weight and Adam moment.

* 8 ranks, PP2 x DP4, 16 microbatches: rank 5 dies in step 3.
  - forced rerouting: the layout is kept; rank 5's four microbatches go to its same-stage
    peers, for the 11 remaining steps;
  - forced re-plan: a profile with cheap all-reduce and slower stage hops makes the best plan
    for 7 ranks two depth-2 pipelines (4 microbatches each) and three depth-1 ones (3, 3, 2);
  - adaptive (prior MTBF 300 s; a profile where a re-plan after the first failure needs a
    60 s migration): the job reroutes; when rank 1 dies in step 7, pipeline 1 is gone and a
    re-plan without migration (depths 4 and 2, 10 and 6 microbatches) wins: it runs.
* 4 ranks, DP2 x PP2, long prior MTBF: rank 3 dies in step 3, the job re-plans (two
  depth-1 pipelines, rank 2 a spare); its agent restarts the worker, which joins between
  two steps with the spare, and the job grows to 4 depth-1 pipelines without losing a step.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_rt_recovery_e2e import (  # noqa: E402
    FT, assert_losses_match, assert_same_state, combine, faults, launch, records,
    run_reference, write_profile,
)

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(480)]

ITERS = 14
BATCH = ("--micro-batch-size", "1", "--global-batch-size", "16", "--eval-interval", "5",
         "--eval-iters", "1")
EIGHT = ["--pipeline-model-parallel-size", "2", *BATCH, *FT,
         "--chameleon-ft-startup-timeout-s", "200"]
PROFILE_8 = {"micro_batch_size": 1, "global_batch_size": 16}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[int, float], dict]:
    tmp = tmp_path_factory.mktemp("reference")
    losses, dump = run_reference(tmp, ITERS, BATCH)
    return losses, dump, evals(records(tmp / "metrics.jsonl"))


def evals(recs: list[dict]) -> dict[int, float]:
    return {r["iteration"]: r["loss"] for r in recs if r["event"] == "eval"}


def assert_evals_match(recs: list[dict], want: dict[int, float]) -> None:
    """Evaluation (forward only, through the layout in use) gives the reference's loss."""
    got = evals(recs)
    assert sorted(got) == sorted(want) == [5, 10], (got, want)
    for it, loss in got.items():
        assert abs(loss - want[it]) <= 1e-4 * abs(want[it]), (it, loss, want[it])


def run_eight(tmp: Path, strategy: str, profile: Path, *extra: str) -> tuple[list, dict, str]:
    return launch(tmp, 8, [*EIGHT, "--chameleon-ft-strategy", strategy,
                           "--chameleon-ft-profile", str(profile), *extra,
                           *faults("rank=5,iteration=3,phase=forward,kind=exit")],
                  timeout_s=420, iters=ITERS)


def replica(dumps: dict, ranks: list[int]) -> dict:
    """Whole-model sums from ``ranks``, which hold every layer once between them."""
    return combine([{**dumps[r], "dp_rank": 0} for r in ranks])


def recoveries(recs: list[dict]) -> list[dict]:
    return [r for r in recs if r["event"] == "recovery"]


def test_forced_rerouting_keeps_the_layout(reference, tmp_path: Path) -> None:
    ref_losses, ref_dump, ref_evals = reference
    profile = write_profile(tmp_path / "p.json", favour="pp", tp=1, **PROFILE_8)
    recs, dumps, log = run_eight(tmp_path, "reroute", profile)
    assert assert_losses_match(recs, ref_losses) == list(range(1, ITERS + 1)), log[-4000:]
    (rec,) = recoveries(recs)
    assert rec["decision"]["choice"] == "reroute" and rec["decision"]["strategy"] == "reroute"
    lay = rec["layout_after"]
    assert (lay["mode"], lay["rerouted"], lay["ranks"]) == ("reroute", [5], [0, 1, 2, 3, 4, 6, 7])
    assert rec["migrated_bytes"] == 0 and rec["redo_iteration"] == 3
    after = [r for r in recs if r["event"] == "iteration" and r["iteration"] >= 3]
    assert len(after) >= 10 and all(r["layout"].get("rerouted") == [5] for r in after)
    assert_evals_match(recs, ref_evals)
    # estimator feedback: the rerouted layout's measured step against its estimate
    (est,) = [r for r in recs if r["event"] == "estimator"]
    assert est["rerouted"] and est["measured_s"] > 0 and est["estimated_s"] > 0
    # pipeline 0 (ranks 0, 4) is a whole replica; pipeline 1 lost its last stage
    assert_same_state(combine([ref_dump]), replica(dumps, [0, 4]), iters=ITERS)
    assert sorted(dumps) == [0, 1, 2, 3, 4, 6, 7]


def test_forced_heterogeneous_re_plan(reference, tmp_path: Path) -> None:
    ref_losses, ref_dump, ref_evals = reference
    profile = write_profile(tmp_path / "p.json", favour="none", tp=1, p2p_bandwidth_Bps=1e9,
                            **PROFILE_8)
    recs, dumps, log = run_eight(tmp_path, "replan", profile)
    assert assert_losses_match(recs, ref_losses) == list(range(1, ITERS + 1)), log[-4000:]
    (rec,) = recoveries(recs)
    assert rec["decision"]["executed"] == "replan" and rec["layout_after"]["mode"] == "hetero"
    pipes = rec["layout_after"]["pipelines"]
    assert sorted((len(p["stages"]), p["microbatches"]) for p in pipes) == [
        (1, 2), (1, 3), (1, 3), (2, 4), (2, 4)]
    assert rec["migrated_bytes"] > 0 and rec["spares"] == []
    assert_evals_match(recs, ref_evals)
    depth_one = [p["stages"][0][0] for p in pipes if len(p["stages"]) == 1]
    for rank in depth_one:  # a depth-1 pipeline holds the whole model
        assert_same_state(combine([ref_dump]), replica(dumps, [rank]), iters=ITERS)


def test_adaptive_reroutes_then_re_plans(reference, tmp_path: Path) -> None:
    ref_losses, ref_dump, _ = reference
    profile = write_profile(tmp_path / "p.json", favour="none", tp=1, p2p_bandwidth_Bps=1e9,
                            allreduce_bandwidth_Bps=1e7, transfer_bandwidth_Bps=1e4,
                            regroup_s=0.01, seconds_per_flop=1e-9, **PROFILE_8)
    recs, dumps, log = run_eight(tmp_path, "adaptive", profile, "--chameleon-ft-mtbf-prior-s",
                                 "300", *faults("rank=1,iteration=7,phase=forward,kind=exit"))
    assert assert_losses_match(recs, ref_losses) == list(range(1, ITERS + 1)), log[-4000:]
    first, second = recoveries(recs)
    assert first["decision"]["choice"] == "reroute", first["decision"]
    assert first["layout_after"]["mode"] == "reroute"
    assert second["failed_ranks"] == [1] and second["decision"]["choice"] == "replan"
    pipes = second["layout_after"]["pipelines"]
    assert sorted((len(p["stages"]), p["microbatches"]) for p in pipes) == [(2, 6), (4, 10)]
    deep = next(p for p in pipes if len(p["stages"]) == 4)
    assert_same_state(combine([ref_dump]), replica(dumps, [s[0] for s in deep["stages"]]),
                      iters=ITERS)


REJOIN_ITERS = 45
PACE_S = 0.3
"""45 steps of at least 0.3 s: the restarted worker (~5-10 s to start up) joins in time
(measured: by step 13)."""


def test_long_mtbf_re_plans_and_a_restarted_worker_rejoins(tmp_path: Path) -> None:
    (tmp_path / "reference").mkdir()
    ref_losses, ref_dump = run_reference(tmp_path / "reference", REJOIN_ITERS)
    profile = write_profile(tmp_path / "p.json", favour="dp", tp=1)
    run = tmp_path / "run"
    run.mkdir()
    recs, dumps, log = launch(run, 4, [
        "--pipeline-model-parallel-size", "2", *FT, "--chameleon-ft-startup-timeout-s", "120",
        "--chameleon-ft-profile", str(profile), "--chameleon-ft-mtbf-prior-s", "1e9",
        "--chameleon-ft-respawns", "1", "--chameleon-ft-respawn-delay-s", "0",
        "--pace-s", str(PACE_S),
        *faults("rank=3,iteration=3,phase=forward,kind=exit")], timeout_s=300,
        iters=REJOIN_ITERS)
    assert assert_losses_match(recs, ref_losses) == list(range(1, REJOIN_ITERS + 1)), log[-4000:]
    failure, join = recoveries(recs)
    assert failure["cause"] == "failure" and failure["failed_ranks"] == [3]
    assert failure["decision"]["strategy"] == "adaptive"
    assert failure["decision"]["choice"] == "replan", failure["decision"]
    # slow stage hops: two depth-1 pipelines (ranks 0, 1 hold half the model each and get
    # the other half); rank 2 waits as a spare
    lay = failure["layout_after"]
    assert (lay["mode"], lay["ranks"], failure["spares"]) == ("megatron", [0, 1], [2])
    # the restarted worker (launch rank 4: world size + 0) joins between two steps
    assert join["cause"] == "join" and join["joined"] == [4] and join["failed_ranks"] == []
    assert sorted(join["layout_after"]["ranks"]) == [0, 1, 2, 4]
    assert join["redo_iteration"] > 3 and join["migrated_bytes"] > 0
    grown = [r for r in recs if r["event"] == "iteration" and r["world_size"] == 4
             and r["iteration"] >= join["redo_iteration"]]
    assert grown and grown[-1]["iteration"] == REJOIN_ITERS
    assert 4 in dumps and dumps[4] != {"spare": True}
