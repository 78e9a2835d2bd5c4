"""Recovery end to end under chameleon-run (CPU, gloo), against a failure-free run.

Two jobs, each with several failures, and one failure-free reference (one process; losses and
initial weights do not depend on the layout, so every layout must reproduce its numbers):

* 4 ranks, DP2 x PP2: rank 0 dies in backward; rank 2 dies during that recovery (the
  survivors retry from the state they held); rank 3 hangs later and is found by its heartbeat.
  Everything recovers in memory: every step once, every loss and, at the end, every weight and
  Adam moment as in the reference.
* 8 ranks, TP2 x PP2 x DP2: rank 5 dies in its optimizer step (the others have applied that
  step: it is kept, not redone); the intact TP groups form one heterogeneous pipeline, a
  spare waits; later both ranks of its last stage die: no copy is left, the survivors load
  the last checkpoint (taken before the plan: plans take none) into a megatron layout.

The re-plan is made deterministic by a profile whose links favour depth-1 pipelines (4 ranks)
or one deep pipeline (8 ranks). The worker is ``recovery_worker.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from e2e_support import (  # noqa: E402
    FT, ITERS, SHORT_WINDOW, assert_losses_match, assert_same_state, combine, faults, job_args,
    launch, records, run_reference, write_profile,
)
from rt_support import run_launcher  # noqa: E402

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(480), pytest.mark.serial]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[int, float], dict]:
    return run_reference(tmp_path_factory.mktemp("reference"))


def launch_four(tmp: Path, *fault_specs: str,
                extra: tuple[str, ...] = ()) -> tuple[list, dict, str]:
    """4 ranks, DP2 x PP2, a profile that favours depth-1 pipelines, ``fault_specs``."""
    profile = write_profile(tmp / "profile.json", favour="dp", tp=1)
    return launch(tmp, 4, [
        "--pipeline-model-parallel-size", "2", *FT, "--chameleon-ft-startup-timeout-s", "120",
        "--chameleon-ft-profile", str(profile), *extra, *faults(*fault_specs)], timeout_s=300)


def test_four_ranks_recover_in_memory_from_three_failures(reference, tmp_path: Path,
                                                          busy_cores: int) -> None:
    """Run with every core busy: slowness must not be taken for failure."""
    ref_losses, ref_dump = reference
    recs, dumps, log = launch_four(
        tmp_path, "rank=0,iteration=3,phase=backward,kind=exit",
        "rank=2,iteration=3,phase=recovery,kind=exit", "rank=3,iteration=6,phase=forward,kind=hang")
    assert assert_losses_match(recs, ref_losses) == list(range(1, ITERS + 1)), log[-4000:]
    first, second = [r for r in recs if r["event"] == "recovery"]
    # generation 1 failed when rank 2 died in it; generation 2 recovered from the old state
    assert (first["generation"], first["failed_ranks"], first["redo_iteration"]) == (2, [0, 2], 3)
    assert first["fallback"] is None and first["migrated_bytes"] > 0
    lay = first["layout_after"]
    assert (lay["tp"], lay["pp"], lay["dp"], sorted(lay["ranks"])) == (1, 1, 2, [1, 3])
    decision = first["decision"]
    assert [c["name"] for c in decision["candidates"]] == ["reroute", "replan"]
    assert decision["D_s"] > 0 and decision["choice"] in ("reroute", "replan")
    assert decision["executed"] == "replan" and decision["transfers"] > 0
    assert set(first["phases_s"]) == {"detect", "decide", "regroup", "migrate", "total"}
    assert first["phases_s"]["total"] >= max(first["phases_s"][p] for p in ("decide", "regroup"))
    assert (second["failed_ranks"], second["redo_iteration"]) == ([3], 6)
    assert second["failures"][0]["reason"] == "heartbeat"
    assert second["layout_after"]["ranks"] == [1] and second["spares"] == []
    assert sorted(dumps) == [1]
    assert_same_state(combine([ref_dump]), combine([dumps[1]]))


def test_eight_ranks_keep_an_applied_step_and_fall_back_to_the_checkpoint(
        reference, tmp_path: Path) -> None:
    """TP2 x PP2 x DP2. Rank 5 fails after applying step 3: kept; its TP group is broken,
    so the three intact ones form one heterogeneous pipeline (rank 4 a spare; the fastest
    layout, taken without replicas: --no-chameleon-ft-keep-replicas), which takes
    no checkpoint (step 4's is skipped). Ranks 6 and 7, a whole stage, die in step 6: its
    layers have no copy left, so the job falls back to the checkpoint of step 2 on a megatron
    layout and redoes steps 3 to 5."""
    ref_losses, ref_dump = reference
    profile = write_profile(tmp_path / "profile.json", favour="pp", tp=2)
    recs, dumps, log = launch(tmp_path, 8, [
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
        "--save", str(tmp_path / "ckpt"), "--save-interval", "2",
        *FT, "--chameleon-ft-startup-timeout-s", "200", "--chameleon-ft-profile", str(profile),
        "--no-chameleon-ft-keep-replicas",
        *faults("rank=5,iteration=3,phase=optimizer,kind=exception",
                "rank=6,iteration=6,phase=forward,kind=exit",
                "rank=7,iteration=6,phase=forward,kind=exit")], timeout_s=420)
    assert assert_losses_match(recs, ref_losses) == [1, 2, 4, 5, 3, 4, 5, 6, 7, 8], log[-4000:]
    first, second = [r for r in recs if r["event"] == "recovery"]
    assert (first["failed_ranks"], first["redo_iteration"], first["fallback"]) == ([5], 4, None)
    lay = first["layout_after"]
    assert lay["mode"] == "hetero" and first["spares"] == [4], lay
    assert [st for p in lay["pipelines"] for st in p["stages"]] == [[0, 1], [2, 3], [6, 7]]
    assert (second["failed_ranks"], second["redo_iteration"]) == ([6, 7], 3)
    assert second["fallback"] == "checkpoint" and "output" in second["decision"]["lost"]
    assert second["state_from"] == {"source": "checkpoint"}
    lay = second["layout_after"]
    assert (lay["mode"], lay["tp"], lay["pp"], lay["dp"], second["spares"]) == (
        "megatron", 2, 2, 1, [4])
    assert sorted(dumps) == [0, 1, 2, 3, 4] and dumps[4] == {"spare": True}
    assert_same_state(combine([ref_dump]), combine([dumps[r] for r in range(4)]))


def test_the_spares_go_on_when_every_active_rank_fails(reference, tmp_path: Path) -> None:
    """DP2 x PP2 on a profile where every link is slow: rank 3 dies in step 3 and the
    survivors re-plan onto one rank (0; the fastest layout, taken without replicas:
    --no-chameleon-ft-keep-replicas), ranks 1 and 2 wait as spares. Rank 0 dies in step
    6: no active rank is left to open the next generation, so the spares open it (before,
    they waited for an invitation that never came and the job stalled: soak seed 611463).
    They hold no state: they load step 4's checkpoint (one of them trains, as before) and
    redo steps 5 to 8, with the reference's losses and final state."""
    ref_losses, ref_dump = reference
    profile = write_profile(tmp_path / "profile.json", favour="dp", tp=1,
                            allreduce_bandwidth_Bps=1e3)
    recs, dumps, log = launch(tmp_path, 4, [
        "--pipeline-model-parallel-size", "2", "--save", str(tmp_path / "ckpt"),
        "--save-interval", "2", *FT, "--chameleon-ft-startup-timeout-s", "120",
        "--chameleon-ft-profile", str(profile), "--no-chameleon-ft-keep-replicas",
        *faults("rank=3,iteration=3,phase=forward,kind=exit",
                "rank=0,iteration=6,phase=forward,kind=exit")], timeout_s=300)
    assert assert_losses_match(recs, ref_losses) == [1, 2, 3, 4, 5, 5, 6, 7, 8], log[-4000:]
    first, second = [r for r in recs if r["event"] == "recovery"]
    assert (first["failed_ranks"], first["layout_after"]["ranks"], first["spares"]) == (
        [3], [0], [1, 2]), first
    assert (second["failed_ranks"], second["redo_iteration"], second["fallback"]) == (
        [0], 5, "checkpoint"), second
    assert second["state_from"] == {"source": "checkpoint"}
    assert "actives_lost" in log
    survivors = second["layout_after"]["ranks"]  # one again, the other a spare
    assert sorted(survivors + second["spares"]) == [1, 2], second
    assert_same_state(combine([ref_dump]), combine([dumps[r] for r in survivors]))


def test_a_kept_layout_refreshes_the_survivor_that_missed_the_last_step(
        reference, tmp_path: Path) -> None:
    """DP2 x PP2, pipelines (0, 2) and (1, 3). Rank 3 dies after step 3's gradient
    all-reduce, before the optimizer's norm: 0 and 2 apply step 3, its pipeline peer 1
    cannot (the norm's all-reduce meets the dead rank). Rerouting keeps the layout: rank 1
    keeps its stage but receives the state of step 3 from rank 0 (with its own, stale by a
    step, step 4's loss is 4.8e-3 off)."""
    ref_losses, ref_dump = reference
    recs, dumps, log = launch_four(tmp_path, "rank=3,iteration=3,phase=grads,kind=exit",
                                   extra=("--chameleon-ft-strategy", "reroute"))
    # step 3 is kept, not redone (its record is lost with the step's end)
    assert assert_losses_match(recs, ref_losses) == [1, 2, *range(4, ITERS + 1)], log[-4000:]
    (rec,) = [r for r in recs if r["event"] == "recovery"]
    assert (rec["failed_ranks"], rec["redo_iteration"]) == ([3], 4), rec
    assert rec["decision"]["executed"] == "reroute" and rec["decision"]["stale"] == [1]
    assert rec["decision"]["transfers"] == 6 and rec["migrated_bytes"] > 0, rec["decision"]
    assert_same_state(combine([ref_dump]), combine([{**dumps[r], "dp_rank": 0} for r in (1, 2)]))


def test_a_slow_rank_is_not_a_failed_one(reference, tmp_path: Path) -> None:
    """DP2: rank 1 stops 6 s in step 3, longer than the group timeout (4 s) and shorter
    than its heartbeat (8 s), by 2 s each way. Rank 0's all-reduce times out with nothing
    announced: every rank abandons step 3 and redoes it in the same layout; nobody is
    declared failed."""
    ref_losses, ref_dump = reference
    recs, dumps, log = launch(tmp_path, 2, [
        *FT, "--chameleon-ft-min-pg-timeout-s", "4", "--chameleon-ft-pg-timeout-factor", "1",
        "--chameleon-ft-startup-timeout-s", "120", "--stall-at", "1:3:6"], timeout_s=150)
    assert assert_losses_match(recs, ref_losses) == list(range(1, ITERS + 1)), log[-4000:]
    (recovery,) = [r for r in recs if r["event"] == "recovery"]
    assert recovery["cause"] == "timeout" and recovery["failures"] == []
    assert recovery["redo_iteration"] == 3 and recovery["layout_after"]["dp"] == 2
    assert "worker failed" not in log
    assert_same_state(combine([ref_dump]), combine([dumps[0], dumps[1]]))


def test_a_recovery_that_times_out_on_a_slow_rank_is_retried(reference, tmp_path: Path) -> None:
    """DP2 x PP2: rank 0 dies in backward of step 3; in that recovery rank 1 stops for
    16 s after regrouping, past the 12 s recovery window (4 x the 3 s group timeout). The
    others' migration times out with nobody failing: they ask for a retry, and all meet
    under the next generation with a doubled window. Rank 1 is not declared failed; the job
    recovers in memory and matches the reference."""
    ref_losses, ref_dump = reference
    recs, dumps, log = launch_four(
        tmp_path, "rank=0,iteration=3,phase=backward,kind=exit",
        "rank=1,iteration=3,phase=recovery,kind=slow,seconds=16", extra=tuple(SHORT_WINDOW))
    assert assert_losses_match(recs, ref_losses) == list(range(1, ITERS + 1)), log[-4000:]
    (recovery,) = [r for r in recs if r["event"] == "recovery"]
    assert recovery["failed_ranks"] == [0] and recovery["generation"] >= 2, recovery
    assert recovery["fallback"] is None and recovery["phases_s"]["total"] > 16
    assert '"event": "recovery_retry"' in log and '"next_window_s": 24.0' in log
    assert log.count("worker failed") == 1  # rank 0's exit only: rank 1 was slow, not dead
    survivors = recovery["layout_after"]["ranks"]
    assert 1 in survivors
    assert_same_state(combine([ref_dump]), combine([dumps[r] for r in survivors]))


def test_with_no_retries_left_a_recovery_that_times_out_ends_the_job(tmp_path: Path) -> None:
    """The same slow recovery with ``--chameleon-ft-recovery-retries 0``: the ranks whose
    attempt timed out with no rank failing give up (RecoveryFailed naming the bound) instead
    of retrying, and the job ends."""
    profile = write_profile(tmp_path / "profile.json", favour="dp", tp=1)
    code, _ = run_launcher(["--standalone", *job_args(tmp_path, 4, [
        "--pipeline-model-parallel-size", "2", *FT, "--chameleon-ft-startup-timeout-s", "120",
        "--chameleon-ft-profile", str(profile), "--chameleon-ft-recovery-retries", "0",
        *SHORT_WINDOW,
        *faults("rank=0,iteration=3,phase=backward,kind=exit",
                "rank=1,iteration=3,phase=recovery,kind=slow,seconds=16")])],
        tmp_path / "log", timeout_s=300)
    log = (tmp_path / "log").read_text()
    assert code != 0, log[-4000:]
    assert "RecoveryFailed: generation 1: recovery failed 1 times with no rank failing" in log


def test_detection_takes_under_a_second_at_start_up_and_at_steady_state(
        reference, tmp_path: Path) -> None:
    """Rank 3 exits in step 2, before any step time is known (the groups still have the
    120 s start-up timeout); rank 1 exits in step 6, at steady state. Each time the
    survivors leave the step within 1 s of the agent's announcement: its watcher interrupts
    their blocked operations instead of letting them wait out a timeout."""
    ref_losses, _ = reference
    recs, _, log = launch_four(
        tmp_path, "rank=3,iteration=2,phase=forward,kind=exit",
        "rank=1,iteration=6,phase=backward,kind=exit")
    assert assert_losses_match(recs, ref_losses) == list(range(1, ITERS + 1)), log[-4000:]
    first, second = [r for r in recs if r["event"] == "recovery"]
    assert (first["failed_ranks"], first["redo_iteration"]) == ([3], 2)
    assert (second["failed_ranks"], second["redo_iteration"]) == ([1], 6)
    for recovery in (first, second):
        assert recovery["phases_s"]["detect"] < 1.0, recovery["phases_s"]
    assert '"event": "failure_seen"' in log and '"event": "timeouts"' in log


def test_successive_failures_move_between_execution_modes(tmp_path: Path) -> None:
    """Megatron's layout (DP2 x PP2, 10 microbatches) -> rank 3 dies: three depth-1
    pipelines with 4/3/3 microbatches (the heterogeneous runtime) -> rank 2 dies: DP2 again
    (megatron's parallel state, rebuilt after the runtime). Every step once, as the
    reference of the same global batch."""
    batch = ("--micro-batch-size", "1", "--global-batch-size", "10")
    (tmp_path / "reference").mkdir()
    ref_losses, ref_dump = run_reference(tmp_path / "reference", flags=batch)
    profile = write_profile(tmp_path / "profile.json", favour="dp", tp=1, micro_batch_size=1,
                            global_batch_size=10)
    recs, dumps, log = launch(tmp_path, 4, [
        "--pipeline-model-parallel-size", "2", *batch, *FT,
        "--chameleon-ft-startup-timeout-s", "120", "--chameleon-ft-profile", str(profile),
        *faults("rank=3,iteration=3,phase=forward,kind=exit",
                "rank=2,iteration=6,phase=backward,kind=exit")], timeout_s=300)
    assert assert_losses_match(recs, ref_losses) == list(range(1, ITERS + 1)), log[-4000:]
    layouts = [r["layout_after"] for r in recs if r["event"] == "recovery"]
    assert [(lay["mode"], lay["plan"]) for lay in layouts] == [
        ("hetero", "1x(d1,m4) + 2x(d1,m3), tp1"), ("megatron", "2x(d1,m5), tp1")], layouts
    assert_same_state(combine([ref_dump]), combine([dumps[0], dumps[1]]))


def test_failures_during_evaluation_and_checkpoint_save_are_recovered(
        tmp_path: Path, busy_cores: int) -> None:
    """DP2 x PP2 (12 microbatches), evaluation after steps 3 and 6, checkpoints after steps
    4 and 8: rank 1 dies as the evaluation after step 3 starts, rank 2 as the checkpoint of
    step 4 starts (its peers are inside that collective work). Each time the survivors
    recover (depth-1 pipelines: DP3, then DP2) and redo the evaluation or the checkpoint in
    the new layout; every step runs once and every loss, training and evaluation, is the
    reference's; both checkpoints are complete. Every core is busy meanwhile."""
    flags = ("--micro-batch-size", "1", "--global-batch-size", "12", "--eval-interval", "3",
             "--eval-iters", "1")
    (tmp_path / "reference").mkdir()
    ref_losses, ref_dump = run_reference(tmp_path / "reference", flags=flags)
    ref_evals = _evals(tmp_path / "reference" / "metrics.jsonl")
    profile = write_profile(tmp_path / "profile.json", favour="dp", tp=1, micro_batch_size=1,
                            global_batch_size=12)
    ckpt = tmp_path / "ckpt"
    recs, dumps, log = launch(tmp_path, 4, [
        "--pipeline-model-parallel-size", "2", *flags, "--save", str(ckpt),
        "--save-interval", "4", *FT, "--chameleon-ft-startup-timeout-s", "120",
        "--chameleon-ft-profile", str(profile),
        *faults("rank=1,iteration=3,phase=eval,kind=exit",
                "rank=2,iteration=4,phase=save,kind=exit")], timeout_s=300)
    assert assert_losses_match(recs, ref_losses) == list(range(1, ITERS + 1)), log[-4000:]
    got = {r["iteration"]: r["loss"] for r in recs if r["event"] == "eval"}
    assert sorted(got) == sorted(ref_evals) == [3, 6], (got, ref_evals)
    for it, loss in got.items():
        assert abs(loss - ref_evals[it]) <= 1e-4 * abs(ref_evals[it]), (it, loss, ref_evals[it])
    first, second = [r for r in recs if r["event"] == "recovery"]
    assert (first["failed_ranks"], first["redo_iteration"]) == ([1], 4)
    assert (second["failed_ranks"], second["redo_iteration"]) == ([2], 5)
    assert [(r["layout_after"]["mode"], r["layout_after"]["dp"]) for r in (first, second)] \
        == [("megatron", 3), ("megatron", 2)]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(ITERS)
    for it in (4, ITERS):
        done = {p.name for p in (ckpt / f"iter_{it:07d}").iterdir()}
        assert {"metadata.json", ".metadata"} <= done, (it, done)
    survivors = second["layout_after"]["ranks"]
    assert_same_state(combine([ref_dump]), combine([dumps[r] for r in survivors]))


def _evals(metrics: Path) -> dict[int, float]:
    return {r["iteration"]: r["loss"] for r in records(metrics) if r["event"] == "eval"}
