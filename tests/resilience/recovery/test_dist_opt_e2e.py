"""In-memory recovery of a job with megatron's distributed optimizer (chameleon-run, CPU gloo).

Its optimizer state is sharded over the data-parallel ranks, so a dead rank's shard has no
copy in any survivor's optimizer: each rank keeps its shard and its predecessor's in host
memory (``shard_replica``), refreshed every ``--chameleon-ft-shard-replica-interval`` steps.
4 ranks, DP2 x PP2 (8 with TP2, bf16), rank 0 dies in backward at step ``FAIL``: the
survivors rebuild every unit from their copies and rank 0's replica, re-plan, and resume at
the copies' step. With
a copy of the last step nothing is redone; with an older one the steps since are redone.
Every loss (redone ones included) is the failure-free run's, the final weights and
optimizer state too, and no checkpoint directory is given.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from e2e_support import (  # noqa: E402
    FT, ITERS, assert_resumed_from_copies, assert_same_state, deep_plans, faults, launch,
    run_reference, summed, write_profile,
)

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(480), pytest.mark.serial]

FAIL = 7
BF16_RTOL, STATE_RTOL = 1e-3, 0.1
"""As in ``test_configs_e2e``: bf16 losses against the one-process run, bf16 final state."""


def combine_pieces(dumps: dict) -> dict[str, dict]:
    """Whole-model sums from every rank's pieces: a weight's from one holder per TP rank
    (its TP shards added, a replicated one counted once), the optimizer state's sums of
    squares added over the pieces (each element is owned once per data-parallel group)."""
    total: dict[str, dict] = {}
    weights: dict[tuple[str, int], float] = {}
    for dump in dumps.values():
        if dump.get("spare"):
            continue
        assert dump["pieces"], dump
        for key, v in dump["sums"].items():
            if not v["sharded"] and dump["tp_rank"] != 0:
                continue
            weights[(key, dump["tp_rank"])] = v["param"]
            acc = total.setdefault(key, {"step": None})
            for k in summed(v):
                if k != "param":
                    acc[k] = acc.get(k, 0.0) + v[k]
            acc["step"] = v["step"] if v["step"] is not None else acc["step"]
    for (key, _), value in weights.items():
        total[key]["param"] = total[key].get("param", 0.0) + value
    return total


def recover(tmp_path: Path, interval: int, flags: tuple[str, ...], rtol: float,
            state_rtol: float, *, tp: int = 1, strategy: str = "adaptive",
            mode: str = "megatron", favour: str = "dp",
            job_only: tuple[str, ...] = ()) -> dict:
    """The job on 4 x ``tp`` ranks (DP2 x PP2 x TP ``tp``); rank 0 dies at step FAIL, and
    the job goes on in ``mode`` (megatron, reroute or hetero)."""
    flags = ("--use-distributed-optimizer", *flags)
    (tmp_path / "reference").mkdir()
    ref_losses, ref_dump = run_reference(tmp_path / "reference", flags=flags)
    job = tmp_path / "job"
    job.mkdir()
    profile = write_profile(job / "profile.json", favour=favour, tp=tp)
    recs, dumps, log = launch(job, 4 * tp, [
        *flags, *job_only, "--pipeline-model-parallel-size", "2",
        "--tensor-model-parallel-size", str(tp), "--chameleon-ft-strategy", strategy, *FT,
        "--chameleon-ft-startup-timeout-s", "120", "--chameleon-ft-profile", str(profile),
        "--chameleon-ft-shard-replica-interval", str(interval), *deep_plans(favour),
        *faults(f"rank=0,iteration={FAIL},phase=backward,kind=exit")], timeout_s=400)
    seen = [r["iteration"] for r in recs if r["event"] == "iteration"]
    for r in recs:
        if r["event"] == "iteration":
            want = ref_losses[r["iteration"]]
            assert abs(r["loss"] - want) <= rtol * abs(want), (r["iteration"], r["loss"], want)
    (done,) = [r for r in recs if r["event"] == "recovery"]
    assert (done["failed_ranks"], done["fallback"]) == ([0], None), log[-4000:]
    resumed = assert_resumed_from_copies(done, newest=FAIL - 1 - (FAIL - 1) % interval,
                                         interval=interval, failed=0, fail_at=FAIL)
    assert done["layout_after"]["mode"] == mode, done["layout_after"]
    assert seen == [*range(1, FAIL), *range(resumed + 1, ITERS + 1)], seen
    assert_same_state(combine_pieces({0: ref_dump}), combine_pieces(dumps), rtol=state_rtol)
    return done


@pytest.mark.parametrize("interval", [1, 4])
def test_the_distributed_optimizer_recovers_from_its_shard_copies(tmp_path: Path,
                                                                  interval: int) -> None:
    recover(tmp_path, interval, (), rtol=1e-4, state_rtol=1e-4)


def test_a_bf16_distributed_optimizer_recovers_from_its_shard_copies(tmp_path: Path) -> None:
    recover(tmp_path, 1, ("--bf16",), rtol=BF16_RTOL, state_rtol=STATE_RTOL)


def test_an_moe_job_with_the_distributed_optimizer_recovers(tmp_path: Path) -> None:
    """An MoE model's expert weights and their Adam state travel as pieces too, and a
    rerouted plan shards the experts of the stage two ranks share between them (megatron's
    distributed optimizer is Adam only: SGD is not one of its configurations). The MoE job
    re-planned onto a megatron layout is the TP2 one below."""
    recover(tmp_path, 2, ("--num-experts", "4", "--disable-bias-linear"), rtol=1e-4,
            state_rtol=1e-4, strategy="reroute", mode="reroute", favour="pp")


@pytest.mark.parametrize("strategy,mode", [("adaptive", "megatron"), ("reroute", "reroute")])
def test_a_bf16_tp2_distributed_optimizer_job_recovers(tmp_path: Path, strategy: str,
                                                       mode: str) -> None:
    """8 ranks, TP2 x PP2 x DP2, bf16. Adaptive (the profile favours data parallelism)
    re-plans onto a megatron layout; forced, the job reroutes around the dead TP group (its
    partner waits as a spare), the plan runtime sharding each part of a stage over its
    holders. (A re-plan onto a heterogeneous pipeline at TP2: the MoE job's below; each
    strategy once over the two models keeps CI short.)"""
    done = recover(tmp_path, 1, ("--bf16",), rtol=BF16_RTOL, state_rtol=STATE_RTOL, tp=2,
                   strategy=strategy, mode=mode, favour="dp" if mode == "megatron" else "pp")
    assert done["decision"]["executed"] == ("replan" if mode == "megatron" else strategy), done


def test_a_bf16_tp2_moe_distributed_optimizer_job_re_plans(tmp_path: Path) -> None:
    """The same with MoE (4 experts, sequence parallelism: megatron-core's MoE at TP > 1
    needs it), forced to re-plan onto one heterogeneous pipeline: the plan splits the experts
    over each stage's TP group and shards them with the rest of their part."""
    done = recover(tmp_path, 1, ("--bf16", "--num-experts", "4", "--disable-bias-linear"),
                   rtol=BF16_RTOL, state_rtol=STATE_RTOL, tp=2, strategy="replan",
                   mode="hetero", favour="pp", job_only=("--sequence-parallel",))
    assert done["decision"]["executed"] == "replan", done


def test_a_rerouted_job_recovers_again_from_the_plans_shard_copies(tmp_path: Path) -> None:
    """4 ranks, DP2 x PP2 (pipelines 0-2 and 1-3), interval 2. Rank 0 dies at step 3: the
    job reroutes (rank 1 alone holds the first stage, ranks 2 and 3 share the last, so the
    plan runtime shards its state between them) and copies its shards around the plan's
    ring. Rank 3 dies at step 6: rank 2 rebuilds the last stage from its own copy of step 4
    and rank 3's replica (on rank 1), the job rolls back to step 4 and redoes steps 5 and 6.
    Every loss and the final state are the failure-free run's."""
    flags = ("--use-distributed-optimizer",)
    (tmp_path / "reference").mkdir()
    ref_losses, ref_dump = run_reference(tmp_path / "reference", flags=flags)
    job = tmp_path / "job"
    job.mkdir()
    profile = write_profile(job / "profile.json", favour="pp", tp=1)
    recs, dumps, log = launch(job, 4, [
        *flags, "--pipeline-model-parallel-size", "2", "--chameleon-ft-strategy", "reroute",
        *FT, "--chameleon-ft-startup-timeout-s", "120", "--chameleon-ft-profile", str(profile),
        "--chameleon-ft-shard-replica-interval", "2",
        *faults("rank=0,iteration=3,phase=backward,kind=exit",
                "rank=3,iteration=6,phase=backward,kind=exit")], timeout_s=400)
    for r in recs:
        if r["event"] == "iteration":
            want = ref_losses[r["iteration"]]
            assert abs(r["loss"] - want) <= 1e-4 * abs(want), (r["iteration"], r["loss"], want)
    first, second = [r for r in recs if r["event"] == "recovery"]
    assert first["layout_after"]["mode"] == "reroute", first["layout_after"]
    # Step 2's copies may still be in flight at step 3 (on a loaded machine): then the job
    # resumes from step 0's.
    before = assert_resumed_from_copies(first, newest=2, interval=2, failed=0, fail_at=3)
    assert (second["failed_ranks"], second["fallback"]) == ([3], None), log[-4000:]
    resumed = assert_resumed_from_copies(second, newest=4, interval=2, failed=3, fail_at=6)
    seen = [r["iteration"] for r in recs if r["event"] == "iteration"]
    assert seen == [1, 2, *range(before + 1, 6), *range(resumed + 1, 9)], seen
    assert_same_state(combine_pieces({0: ref_dump}), combine_pieces(dumps), rtol=1e-4)


def test_a_failure_while_a_copy_is_in_flight_resumes_from_the_committed_one(
        tmp_path: Path) -> None:
    """4 ranks, DP2 x PP2, interval 2: the copies of step 4 are exchanged on a thread while
    step 5 runs, and rank 0 exits inside that exchange, once its pair is exchanged, before
    the commit. No rank committed step 4's copies (its successor received rank 0's copy, but
    a copy in flight is never read): the job resumes from the copies of step 2, rank 0's
    from its replica, and redoes steps 3 to 5. Every loss and the final state are the
    failure-free run's."""
    flags = ("--use-distributed-optimizer",)
    (tmp_path / "reference").mkdir()
    ref_losses, ref_dump = run_reference(tmp_path / "reference", flags=flags)
    job = tmp_path / "job"
    job.mkdir()
    profile = write_profile(job / "profile.json", favour="dp", tp=1)
    recs, dumps, log = launch(job, 4, [
        *flags, "--pipeline-model-parallel-size", "2", *FT,
        "--chameleon-ft-startup-timeout-s", "120", "--chameleon-ft-profile", str(profile),
        "--chameleon-ft-shard-replica-interval", "2",
        *faults("rank=0,iteration=4,phase=copy,kind=exit")], timeout_s=400)
    for r in recs:
        if r["event"] == "iteration":
            want = ref_losses[r["iteration"]]
            assert abs(r["loss"] - want) <= 1e-4 * abs(want), (r["iteration"], r["loss"], want)
    (done,) = [r for r in recs if r["event"] == "recovery"]
    assert (done["failed_ranks"], done["fallback"]) == ([0], None), log[-4000:]
    assert done["redo_iteration"] == 3 and done["state_from"] == {
        "source": "shard copies", "iteration": 2, "rolled_back_steps": 2,
        "replicas_of": [0]}, done
    seen = [r["iteration"] for r in recs if r["event"] == "iteration"]
    assert seen == [1, 2, 3, 4, *range(3, ITERS + 1)], seen
    assert_same_state(combine_pieces({0: ref_dump}), combine_pieces(dumps), rtol=1e-4)
