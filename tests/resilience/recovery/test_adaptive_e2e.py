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
  two steps with the spare, and the job grows to 4 depth-1 pipelines without losing a step;
  the same with a new node instead (a second chameleon-run with --chameleon-ft-join).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from e2e_support import (  # noqa: E402
    FT, assert_losses_match, assert_same_state, combine, failure_story, faults, job_args, launch,
    outcome, records, run_reference, write_profile,
)
from rt_support import free_port, start_launcher, stop  # noqa: E402

from chameleon_megatron.resilience.store.announce import read_failures
from chameleon_megatron.resilience.store.job_store import JobStore

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(480), pytest.mark.serial]

ITERS = 14
BATCH = ("--micro-batch-size", "1", "--global-batch-size", "16", "--eval-interval", "5",
         "--eval-iters", "1")
EIGHT = ["--pipeline-model-parallel-size", "2", *BATCH, *FT,
         "--chameleon-ft-startup-timeout-s", "200", "--chameleon-ft-min-pg-timeout-s", "10"]
"""Heartbeat 20 s: these jobs lose ranks by exits only (announced at once, so no wait is
longer for it), and a CI machine running the soak beside them once stalled a healthy rank
in a step for 10 s, which the default heartbeat took for a hang."""
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
    assert first["failed_ranks"] == [5], failure_story(log)
    assert first["decision"]["choice"] == "reroute", first["decision"]
    assert first["layout_after"]["mode"] == "reroute"
    assert second["failed_ranks"] == [1] and second["decision"]["choice"] == "replan"
    # rank 0 had precomputed every single failure of the rerouted layout between steps 3
    # and 7: the re-plan was looked up, not searched
    assert second["decision"]["decision_from"] == "cache", second["decision"]
    pipes = second["layout_after"]["pipelines"]
    assert sorted((len(p["stages"]), p["microbatches"]) for p in pipes) == [(2, 6), (4, 10)]
    deep = next(p for p in pipes if len(p["stages"]) == 4)
    assert_same_state(combine([ref_dump]), replica(dumps, [s[0] for s in deep["stages"]]),
                      iters=ITERS)


REJOIN_ITERS = 45
PACE_S = 0.3
"""45 steps of at least 0.3 s: the restarted worker (~5-10 s to start up) joins in time
(measured: by step 13)."""


@pytest.fixture(scope="module")
def rejoin_reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[int, float], dict]:
    return run_reference(tmp_path_factory.mktemp("rejoin-reference"), REJOIN_ITERS)


def rejoin_flags(tmp: Path) -> list[str]:
    """4 ranks DP2 x PP2, long prior MTBF, slow stage hops; rank 3 dies in step 3."""
    profile = write_profile(tmp / "p.json", favour="dp", tp=1)
    return ["--pipeline-model-parallel-size", "2", *FT, "--chameleon-ft-startup-timeout-s",
            "120", "--chameleon-ft-profile", str(profile), "--chameleon-ft-mtbf-prior-s", "1e9",
            "--pace-s", str(PACE_S), *faults("rank=3,iteration=3,phase=forward,kind=exit")]


def assert_grown_back(recs: list[dict], dumps: dict, ref_losses: dict, log: str) -> None:
    """Rank 3 fails: re-plan onto two depth-1 pipelines (ranks 0, 1 hold half the model each
    and get the other half; rank 2 a spare); joiner 4 (launch world size + 0) joins between
    two steps with the spare: 4 depth-1 pipelines, every step once, losses as the reference."""
    assert assert_losses_match(recs, ref_losses) == list(range(1, REJOIN_ITERS + 1)), log[-4000:]
    failure, join = recoveries(recs)
    assert failure["cause"] == "failure" and failure["failed_ranks"] == [3]
    assert failure["decision"]["strategy"] == "adaptive"
    assert failure["decision"]["choice"] == "replan", failure["decision"]
    lay = failure["layout_after"]
    assert (lay["mode"], lay["ranks"], failure["spares"]) == ("megatron", [0, 1], [2])
    assert join["cause"] == "join" and join["joined"] == [4] and join["failed_ranks"] == []
    assert sorted(join["layout_after"]["ranks"]) == [0, 1, 2, 4]
    assert join["redo_iteration"] > 3 and join["migrated_bytes"] > 0
    grown = [r for r in recs if r["event"] == "iteration" and r["world_size"] == 4
             and r["iteration"] >= join["redo_iteration"]]
    assert grown and grown[-1]["iteration"] == REJOIN_ITERS
    assert 4 in dumps and dumps[4] != {"spare": True}


def test_long_mtbf_re_plans_and_a_restarted_worker_rejoins(rejoin_reference,
                                                            tmp_path: Path) -> None:
    ref_losses, _ = rejoin_reference
    recs, dumps, log = launch(tmp_path, 4, [
        *rejoin_flags(tmp_path), "--chameleon-ft-respawns", "1",
        "--chameleon-ft-respawn-delay-s", "0"], timeout_s=300, iters=REJOIN_ITERS)
    assert_grown_back(recs, dumps, ref_losses, log)


def test_long_mtbf_re_plans_and_a_new_node_joins(rejoin_reference, tmp_path: Path) -> None:
    """The same job on a static rendezvous; once rank 3's failure is announced, a second
    chameleon-run (one worker, --chameleon-ft-join) joins it through the job store."""
    ref_losses, _ = rejoin_reference
    port = free_port()
    rdzv = ["--nnodes=1", "--master-addr=127.0.0.1", f"--master-port={port}", "--rdzv-id=rt-join"]
    args = job_args(tmp_path, 4, rejoin_flags(tmp_path), REJOIN_ITERS)
    node0 = start_launcher([*rdzv, *args], tmp_path / "log")
    node1 = None
    try:
        job = JobStore.connect("127.0.0.1", port, "rt-join", timeout_s=60)
        deadline = time.monotonic() + 120
        while not read_failures(job) and time.monotonic() < deadline and node0.poll() is None:
            time.sleep(0.1)
        assert read_failures(job), (tmp_path / "log").read_text()[-4000:]
        one = [a.replace("--nproc-per-node=4", "--nproc-per-node=1") for a in args]
        node1 = start_launcher([*rdzv, *one, "--chameleon-ft-join"], tmp_path / "log1")
        assert node0.wait(timeout=240) == 0, (tmp_path / "log").read_text()[-6000:]
        assert node1.wait(timeout=60) == 0, (tmp_path / "log1").read_text()[-6000:]
    finally:
        for proc in (node0, node1):
            if proc is not None:
                stop(proc)
    recs, dumps, log = outcome(tmp_path)
    assert_grown_back(recs, dumps, ref_losses, log + (tmp_path / "log1").read_text())
    # the node registered after the launch's one agent
    assert '"event": "node_join", "group_rank": 1' in (tmp_path / "log1").read_text()
