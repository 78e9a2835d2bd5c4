"""Rerouting and heterogeneous plans on Megatron-LM's own pretrain_gpt.py (a patched copy of
the real checkout) under chameleon-run on CPU ranks, against Megatron-LM's failure-free run
of the same job: after a failure the decision center's choice runs through the plan runtime
(``training.lm_plan``) with Megatron-LM's data in its sample order, each step once, with
the failure-free losses."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import test_megatron_lm_ft as lm_ft  # noqa: E402
from test_megatron_lm_ft import (  # noqa: E402
    BF16_TOLERANCE,
    JOIN_ITERS,
    JOIN_JOB,
    MODEL,
    TOLERANCE,
    iterations,
    killed_against_plain,
    launch,
    recoveries,
)

from lm_support import needs_real  # noqa: E402

pytestmark = [needs_real, pytest.mark.serial, pytest.mark.timeout(600)]
checkout, reference, join_reference = lm_ft.checkout, lm_ft.reference, lm_ft.join_reference
"""The fixtures: a patched copy of the checkout, Megatron-LM's failure-free runs of JOB and
of JOIN_JOB."""


def killed(checkout, reference, tmp_path, *flags: str,
           fault: str = "rank=1,iteration=3,phase=forward,kind=exit",
           ) -> tuple[list[dict], dict, list[dict]]:
    """The 4-rank job (PP2 x DP2) with rank 1 killed (by default in step 3): every step
    once, each loss the failure-free one. (steps, the recovery, every record)."""
    losses, _, _ = reference
    records, log = launch(checkout, tmp_path / "ft.jsonl", 4, "--chameleon-ft",
                          "--chameleon-inject-fault", fault, *flags)
    steps = iterations(records)
    assert [r["iteration"] for r in steps] == [1, 2, 3, 4, 5, 6], log[-4000:]
    for r in steps:
        assert r["loss"] == pytest.approx(losses[r["iteration"]], abs=TOLERANCE), r["iteration"]
    (done,) = recoveries(records)
    return steps, done, records


@pytest.mark.parametrize("strategy,mode", [("reroute", "reroute"), ("replan", "hetero")])
def test_a_plan_runs_on_megatron_lms_loop_with_the_failure_free_losses(
        checkout, reference, tmp_path, strategy, mode):
    steps, done, records = killed(checkout, reference, tmp_path,
                                  "--chameleon-ft-strategy", strategy)
    assert done["decision"]["executed"] == strategy
    assert done["layout_after"]["mode"] == mode, done["layout_after"]
    assert [r["world_size"] for r in steps] == [4, 4, 3, 3, 3, 3]
    assert all(r["layout"].get("plan") == done["layout_after"]["plan"] for r in steps[2:])
    # the evaluations due after steps 3 and 6 and the end-of-job ones wait for a megatron
    # layout: each is recorded, once
    deferred = [(r["iteration"], r["work"]) for r in records if r["event"] == "deferred"]
    assert deferred == [(3, "eval"), (6, "eval"), (6, "final-eval"), (6, "final-test")]


def test_a_checkpoint_cut_off_by_a_failure_is_deferred_when_a_plan_follows(
        checkout, reference, tmp_path):
    """Rank 1 dies in the checkpoint after step 2 (a megatron layout); the forced re-plan
    runs a plan, so the save the survivors agreed to redo is deferred (a record), not run
    through Megatron-LM's save with the plan's model; every step once after it."""
    steps, done, records = killed(checkout, reference, tmp_path, "--chameleon-ft-strategy",
                                  "replan", "--save", str(tmp_path / "ckpt"),
                                  "--save-interval", "2",
                                  fault="rank=1,iteration=2,phase=save,kind=exit")
    assert done["layout_after"]["mode"] == "hetero", done["layout_after"]
    deferred = [(r["iteration"], r["work"]) for r in records if r["event"] == "deferred"]
    assert deferred[0] == (2, "save") and (4, "save") in deferred, deferred
    assert [r["world_size"] for r in steps] == [4, 4, 3, 3, 3, 3]


def test_eight_ranks_replan_onto_every_survivor(checkout, tmp_path):
    """PP2 x DP4 on 8 ranks, 8 microbatches of one sample per step; rank 5 dies in step 2.
    No megatron layout over 7 ranks divides this model and global batch; the re-plan runs
    pipelines of different depths over all 7 (three of depth 2, one of depth 1), with the
    failure-free losses."""
    job = [*MODEL, "--pipeline-model-parallel-size", "2", "--micro-batch-size", "1"]
    steps, done = killed_against_plain(checkout, tmp_path, job,
                                       "rank=5,iteration=2,phase=forward,kind=exit",
                                       abs=TOLERANCE, nproc=8,
                                       ft=("--chameleon-ft-strategy", "replan"))
    lay = done["layout_after"]
    assert lay["mode"] == "hetero" and sorted(lay["ranks"]) == [0, 1, 2, 3, 4, 6, 7], lay
    assert [r["world_size"] for r in steps] == [8, 7, 7, 7, 7, 7]


def test_adaptive_choice_is_recorded_and_a_second_failure_inside_the_plan_recovers(
        checkout, reference, tmp_path):
    """Adaptive: the decision records both strategies' scores and runs its choice; rank 2
    then dies inside that layout (step 5) and the job still runs every step once with the
    failure-free losses."""
    losses, _, _ = reference
    records, log = launch(checkout, tmp_path / "ft.jsonl", 4, "--chameleon-ft",
                          "--chameleon-inject-fault", "rank=1,iteration=3,phase=forward,kind=exit",
                          "--chameleon-inject-fault", "rank=2,iteration=5,phase=forward,kind=exit")
    steps = iterations(records)
    assert [r["iteration"] for r in steps] == [1, 2, 3, 4, 5, 6], log[-4000:]
    for r in steps:
        assert r["loss"] == pytest.approx(losses[r["iteration"]], abs=TOLERANCE), r["iteration"]
    first, second = recoveries(records)
    scored = {c["name"]: c.get("score") for c in first["decision"]["candidates"]}
    assert set(scored) == {"reroute", "replan"} and all(scored.values()), scored
    assert first["decision"]["executed"] == first["decision"]["choice"]
    assert second["failed_ranks"] == [2]


@pytest.mark.parametrize("strategy", ["reroute", "replan"])
def test_a_bf16_tensor_parallel_distributed_optimizer_job_runs_each_strategy(
        checkout, tmp_path, strategy):
    """TP2 x DP2 in bf16 with the distributed optimizer on 4 ranks; rank 3 dies in step 4.
    Its optimizer shard lives on in the host copies of step 2: the job rolls back there and
    redoes the steps since in the layout the strategy takes, each loss the failure-free one
    (bf16 tolerance)."""
    job = [*MODEL, "--tensor-model-parallel-size", "2", "--bf16", "--use-distributed-optimizer"]
    plain = iterations(launch(checkout, tmp_path / "plain.jsonl", 4, ft=False, job=job)[0])
    records, log = launch(checkout, tmp_path / "ft.jsonl", 4, "--chameleon-ft",
                          "--chameleon-ft-strategy", strategy,
                          "--chameleon-ft-shard-replica-interval", "2",
                          "--chameleon-inject-fault", "rank=3,iteration=4,phase=forward,kind=exit",
                          job=job)
    want = {r["iteration"]: r["loss"] for r in plain}
    steps = iterations(records)
    (done,) = recoveries(records)
    resumed = done["state_from"]["iteration"]
    assert resumed in (2, 0), done["state_from"]  # 0: step 2's copies were still in flight
    assert [r["iteration"] for r in steps] == [1, 2, 3, *range(resumed + 1, 7)], log[-4000:]
    for got in steps:
        assert got["loss"] == pytest.approx(want[got["iteration"]], rel=BF16_TOLERANCE), got
    assert done["decision"]["executed"] == strategy, done["decision"]


def test_a_respawned_worker_joins_a_plan_and_the_layout_grows_back(checkout, join_reference,
                                                                   tmp_path):
    """PP2 x DP2, rank 3 dies in step 3 and is restarted as a joiner; the survivors run the
    forced re-plan (a heterogeneous plan over 3 ranks) and admit the joiner between two of
    its steps: four ranks again in a megatron layout (Megatron-LM's train() re-entered),
    every step once with the failure-free losses."""
    plain, _ = join_reference
    records, log = launch(checkout, tmp_path / "ft.jsonl", 4, "--chameleon-ft",
                          "--chameleon-ft-strategy", "replan",
                          *(a for a in lm_ft.JOIN_FT if a not in lm_ft.MEGATRON_ONLY
                            and a != "--chameleon-ft"),
                          "--chameleon-ft-respawns", "1", "--chameleon-ft-respawn-delay-s", "0",
                          job=JOIN_JOB)
    steps = iterations(records)
    assert [r["iteration"] for r in steps] == list(range(1, JOIN_ITERS + 1)), log[-4000:]
    for got, want in zip(steps, iterations(plain)):
        assert got["loss"] == pytest.approx(want["loss"], abs=TOLERANCE), got["iteration"]
    failure, join = recoveries(records)
    assert failure["layout_after"]["mode"] == "hetero", failure["layout_after"]
    assert (join["cause"], join["joined"], join["layout_after"]["mode"]) == ("join", [4],
                                                                             "megatron")
    assert sorted(join["layout_after"]["ranks"]) == [0, 1, 2, 4]
    assert {r["world_size"] for r in steps if r["iteration"] >= join["redo_iteration"]} == {4}
