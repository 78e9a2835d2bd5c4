"""Rerouting and heterogeneous plans on Megatron-LM's own pretrain_gpt.py (a patched copy of
the real checkout) under chameleon-run on CPU ranks, against Megatron-LM's failure-free run
of the same job: after a failure the decision center's choice runs through the plan runtime
(``training.lm_plan``) with Megatron-LM's data in its sample order, each step once, with
the failure-free losses. Evaluations and checkpoints due while a plan runs are Megatron-LM's
own, run in a megatron layout the job changes to for them (a "work" transition); the plan
runs again after them (a "back" transition)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import test_megatron_lm_ft as lm_ft  # noqa: E402
from test_megatron_lm_ft import (  # noqa: E402
    BF16_TOLERANCE,
    FINAL,
    JOIN_ITERS,
    JOIN_JOB,
    MODEL,
    TOLERANCE,
    VALIDATION,
    WORK,
    changes,
    iterations,
    killed_against_plain,
    launch,
    recoveries,
)

from lm_support import copy_checkout, double_the_loss, needs_real, patch  # noqa: E402

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
    (done,) = changes(records)
    return steps, done, records


def around_work(records: list[dict]) -> list[tuple[str, int, str]]:
    """(cause, the step after which it ran, mode after) of each transition around work."""
    return [(r["cause"], r["redo_iteration"] - 1, r["layout_after"]["mode"])
            for r in recoveries(records) if r["cause"] in WORK]


def assert_evaluations(reference, log: str) -> None:
    """Every validation and end-of-job evaluation ran once, with the failure-free loss."""
    _, validation, finals = reference
    got = dict(VALIDATION.findall(log))
    assert sorted(got) == sorted(validation), got
    for it, loss in got.items():
        assert float(loss) == pytest.approx(float(validation[it]), abs=TOLERANCE), it
    ends = FINAL.findall(log)
    assert [e[:2] for e in ends] == [f[:2] for f in finals], ends
    for (_, which, loss), (_, _, want) in zip(ends, finals):
        assert float(loss) == pytest.approx(float(want), abs=TOLERANCE), which


@pytest.mark.parametrize("strategy,mode", [("reroute", "reroute"), ("replan", "hetero")])
def test_a_plan_runs_on_megatron_lms_loop_with_the_failure_free_losses(
        checkout, reference, tmp_path, strategy, mode):
    """Rank 1 dies in step 3; the strategy's plan runs it. The evaluation after step 3 runs
    in a megatron layout (PP1 x DP2 over two survivors); the plan returns between steps 4
    and 5, the first two steps of that layout, and leaves again for the evaluations after
    step 6. Every evaluation has the failure-free loss."""
    steps, done, records = killed(checkout, reference, tmp_path,
                                  "--chameleon-ft-strategy", strategy)
    assert done["decision"]["executed"] == strategy
    assert done["layout_after"]["mode"] == mode, done["layout_after"]
    assert around_work(records) == [("work", 3, "megatron"), ("back", 4, mode),
                                    ("work", 6, "megatron")]
    assert [r["world_size"] for r in steps] == [4, 4, 3, 2, 3, 3]
    plan = done["layout_after"]["plan"]
    assert [r["layout"].get("plan") == plan for r in steps] == [False, False, True, False,
                                                                 True, True]
    assert_evaluations(reference, (tmp_path / "ft.log").read_text())


def test_evaluations_and_checkpoints_during_a_plan_then_a_fresh_job_resumes_from_one(
        checkout, reference, tmp_path):
    """Rank 1 dies in the checkpoint after step 2 (the survivors agree to redo it; a failure
    in a step before a plan's work: the 0.19 test); the heterogeneous re-plan runs. The checkpoint after step
    2 and the evaluations after step 6 fall inside the plan: each is Megatron-LM's own, in a
    megatron layout the job changes to for it (PP1 x DP2). That layout stays while work
    follows each step (the evaluation after step 3, the save after step 4); the plan runs
    steps 5 and 6. Every checkpoint is written, every evaluation has the failure-free loss.
    A fresh job of Megatron-LM on all 4 ranks (PP2 x DP2, not the layout that saved) then
    loads the checkpoint of step 2 and trains steps 3 to 6 with the failure-free losses."""
    losses, _, _ = reference
    ckpt = tmp_path / "ckpt"
    steps, done, records = killed(checkout, reference, tmp_path, "--chameleon-ft-strategy",
                                  "replan", "--save", str(ckpt), "--save-interval", "2",
                                  fault="rank=1,iteration=2,phase=save,kind=exit")
    assert done["layout_after"]["mode"] == "hetero", done["layout_after"]
    assert around_work(records) == [("work", 2, "megatron"), ("back", 4, "hetero"),
                                    ("work", 6, "megatron")]
    assert [r["world_size"] for r in steps] == [4, 4, 2, 2, 3, 3]  # the save redone only
    assert_evaluations(reference, (tmp_path / "ft.log").read_text())
    assert sorted(p.name for p in ckpt.glob("iter_*")) == [
        "iter_0000002", "iter_0000004", "iter_0000006"]
    (ckpt / "latest_checkpointed_iteration.txt").write_text("2")  # not the final one (6)
    resumed, log = launch(checkout, tmp_path / "resumed.jsonl", 4, "--load", str(ckpt),
                          ft=False)
    again = iterations(resumed)
    assert [r["iteration"] for r in again] == [3, 4, 5, 6], log[-4000:]
    for r in again:
        assert r["loss"] == pytest.approx(losses[r["iteration"]], abs=TOLERANCE), r["iteration"]


OWN_MODEL = ("--qk-layernorm", "--norm-epsilon", "1e-3")
"""Model flags chameleon's own trainer does not read: a plan's stage built from its config
would lack the query/key norms and normalize with another epsilon."""


def test_a_plans_stages_are_megatron_lms_model_and_the_scripts_forward_step(tmp_path):
    """A pretrain_gpt.py with a loss of its own (``double_the_loss``) and model flags
    chameleon's trainer does not read (``OWN_MODEL``). Rank 1 dies in step 3; the forced
    heterogeneous re-plan builds its stages through Megatron-LM's own model builder from
    Megatron-LM's config of the job, and trains them with the script's forward step: every
    step has the failure-free loss of that script."""
    ckpt, env = copy_checkout(tmp_path / "Megatron-LM")
    patch.apply(ckpt)
    double_the_loss(ckpt)
    steps, done = killed_against_plain((ckpt, env), tmp_path, [*lm_ft.JOB, *OWN_MODEL],
                                       "rank=1,iteration=3,phase=forward,kind=exit",
                                       abs=2 * TOLERANCE,
                                       ft=("--chameleon-ft-strategy", "replan"))
    assert done["layout_after"]["mode"] == "hetero", done["layout_after"]
    plan = done["layout_after"]["plan"]
    assert [r["layout"].get("plan") == plan for r in steps] == [False, False, True, False,
                                                                True, True]


def test_swap_keeps_swapping_while_a_plan_runs(checkout, reference, tmp_path):
    """The job swaps activations (``--chameleon-swap``); rank 1 dies in step 3 and the forced
    heterogeneous re-plan runs (steps 3, 5 and 6; step 4 in a megatron layout for the
    evaluation). The first step of each new layout profiles the operator sequence, nothing
    swapped; the next step of the plan swaps on its stages (megatron's schedules over the
    plan's groups, through the same seams). Every loss is the failure-free one."""
    steps, done, _ = killed(checkout, reference, tmp_path, "--chameleon-ft-strategy", "replan",
                            "--chameleon-swap", "--chameleon-swap-min-tensor-bytes", "1024")
    plan = done["layout_after"]["plan"]
    assert [r["layout"].get("plan") == plan for r in steps] == [False, False, True, False,
                                                                True, True]
    swapped = [r["swap"]["swapped_out_bytes"] > 0 for r in steps]
    assert swapped == [False, True, False, False, False, True], swapped
    stages = steps[-1]["swap"]["stages"]
    assert [s["stage"] for s in stages] == [0, 1] and all(
        s["swapped_out_bytes"] > 0 for s in stages), stages


def test_eight_ranks_replan_onto_every_survivor(checkout, tmp_path):
    """PP2 x DP4 on 8 ranks, 8 microbatches of one sample per step; rank 5 dies in step 2.
    No megatron layout over 7 ranks divides this model and global batch; the re-plan runs
    pipelines of different depths over all 7 (three of depth 2, one of depth 1), with the
    failure-free losses. The evaluation after step 3 takes the job to a megatron layout over
    fewer ranks (step 4), and the plan returns for steps 5 and 6."""
    job = [*MODEL, "--pipeline-model-parallel-size", "2", "--micro-batch-size", "1"]
    steps, done = killed_against_plain(checkout, tmp_path, job,
                                       "rank=5,iteration=2,phase=forward,kind=exit",
                                       abs=TOLERANCE, nproc=8,
                                       ft=("--chameleon-ft-strategy", "replan"))
    lay = done["layout_after"]
    assert lay["mode"] == "hetero" and sorted(lay["ranks"]) == [0, 1, 2, 3, 4, 6, 7], lay
    assert [r["iteration"] for r in steps if r["world_size"] == 7] == [2, 3, 5, 6]


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
    first, second = changes(records)
    scored = {c["name"]: c.get("score") for c in first["decision"]["candidates"]}
    assert set(scored) == {"reroute", "replan"} and all(scored.values()), scored
    assert first["decision"]["executed"] == first["decision"]["choice"]
    assert second["failed_ranks"] == [2]


BF16_TP_JOB = [*MODEL, "--tensor-model-parallel-size", "2", "--bf16",
               "--use-distributed-optimizer"]


@pytest.fixture(scope="module")
def bf16_tp_plain(checkout, tmp_path_factory) -> list[dict]:
    """The failure-free BF16_TP_JOB's steps (one run for both strategies)."""
    out = tmp_path_factory.mktemp("bf16_tp_plain") / "plain.jsonl"
    return iterations(launch(checkout, out, 4, ft=False, job=BF16_TP_JOB)[0])


@pytest.mark.parametrize("strategy", ["reroute", "replan"])
def test_a_bf16_tensor_parallel_distributed_optimizer_job_runs_each_strategy(
        checkout, bf16_tp_plain, tmp_path, strategy):
    """TP2 x DP2 in bf16 with the distributed optimizer on 4 ranks; rank 3 dies in step 4.
    Its optimizer shard lives on in the host copies of step 2: the job rolls back there and
    redoes the steps since in the layout the strategy takes, each loss the failure-free one
    (bf16 tolerance)."""
    job, plain = BF16_TP_JOB, bf16_tp_plain
    records, log = launch(checkout, tmp_path / "ft.jsonl", 4, "--chameleon-ft",
                          "--chameleon-ft-strategy", strategy,
                          "--chameleon-ft-shard-replica-interval", "2",
                          "--chameleon-inject-fault", "rank=3,iteration=4,phase=forward,kind=exit",
                          job=job)
    want = {r["iteration"]: r["loss"] for r in plain}
    steps = iterations(records)
    (done,) = changes(records)
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
    failure, join = changes(records)
    assert failure["layout_after"]["mode"] == "hetero", failure["layout_after"]
    assert (join["cause"], join["joined"], join["layout_after"]["mode"]) == ("join", [4],
                                                                             "megatron")
    assert sorted(join["layout_after"]["ranks"]) == [0, 1, 2, 4]
    assert {r["world_size"] for r in steps if r["iteration"] >= join["redo_iteration"]} == {4}
