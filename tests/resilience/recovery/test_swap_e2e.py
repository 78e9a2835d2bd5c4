"""Swap and fault tolerance together.

A job that swaps activations keeps swapping, within budget and without changing a number, on
the layout a recovery re-plans; and a rank that runs out of device memory mid-step makes
every rank abandon the step and redo it together (never alone: its peers are mid-step).

4 ranks DP2 x PP2 with per-stage swap budgets (700 kB for stage 0, 600 kB for stage 1); rank
3 dies in step 3; a profile with a slow all-reduce makes the re-plan one heterogeneous
pipeline of depth 3 over the survivors (``--no-chameleon-ft-keep-replicas``: the fastest
layout even without replicas; run by the plan runtime, whose steps go through the same
megatron seams). The configured stages no longer exist, so the tightest budget holds on
every stage. Compared with a failure-free run without swap (one process).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from e2e_support import (  # noqa: E402
    FT, assert_losses_match, assert_same_state, combine, faults, job_args, launch, outcome,
    run_reference, write_profile,
)
from rt_support import run_launcher  # noqa: E402

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300), pytest.mark.serial]

ITERS = 8
SWAP = ["--chameleon-swap", "--chameleon-swap-min-tensor-bytes", "1024",
        "--chameleon-swap-budget-bytes-per-stage", "700000",
        "--chameleon-swap-budget-bytes-per-stage", "600000"]


def test_swap_keeps_working_on_a_re_planned_heterogeneous_layout(tmp_path: Path) -> None:
    (tmp_path / "reference").mkdir()
    ref_losses, ref_dump = run_reference(tmp_path / "reference", ITERS)
    profile = write_profile(tmp_path / "p.json", favour="pp", tp=1)
    run = tmp_path / "run"
    run.mkdir()
    recs, dumps, log = launch(run, 4, [
        "--pipeline-model-parallel-size", "2", *FT, "--chameleon-ft-startup-timeout-s", "120",
        "--chameleon-ft-strategy", "replan", "--chameleon-ft-profile", str(profile), *SWAP,
        "--no-chameleon-ft-keep-replicas",
        *faults("rank=3,iteration=3,phase=forward,kind=exit")], timeout_s=240, iters=ITERS)
    assert assert_losses_match(recs, ref_losses) == list(range(1, ITERS + 1)), log[-4000:]
    (recovery,) = [r for r in recs if r["event"] == "recovery"]
    lay = recovery["layout_after"]
    assert lay["mode"] == "hetero" and [len(p["stages"]) for p in lay["pipelines"]] == [3], lay
    swap = {r["iteration"]: r["swap"] for r in recs if r["event"] == "iteration"}
    assert swap[2]["budget_bytes"] == 700000  # rank 0: stage 0 of the launch's PP2
    after = [swap[i] for i in range(recovery["redo_iteration"] + 1, ITERS + 1)]
    for s in after:  # rank 0: stage 0 of the depth-3 pipeline
        assert s["budget_bytes"] == 600000 and s["plan_version"] >= 1, s
        assert s["swapped_out_bytes"] > 0 and s["swapped_in_bytes"] == s["swapped_out_bytes"]
        assert s["peak_resident_saved_bytes"] <= s["budget_bytes"], s
        assert s["unmatched"] == 0 and s["live_entries"] == 0 and s["host_buffers_live"] == 0
    stages = [r[0] for r in lay["pipelines"][0]["stages"]]
    assert_same_state(combine([ref_dump]), combine([{**dumps[r], "dp_rank": 0} for r in stages]),
                      iters=ITERS)


PP2 = ["--pipeline-model-parallel-size", "2"]
ONE_BUDGET = ["--chameleon-swap", "--chameleon-swap-min-tensor-bytes", "1024",
              "--chameleon-swap-budget-bytes", "700000"]


def test_out_of_memory_mid_step_is_redone_by_every_rank_together(tmp_path: Path) -> None:
    """PP2: rank 0 (stage 0) runs out of memory in the backward of step 3, after stage 1 has
    sent it gradients. Both ranks abandon step 3 and redo it in the same layout, with the
    lowered budget on rank 0; every loss and the final state as without the error."""
    (tmp_path / "reference").mkdir()
    ref_losses, ref_dump = run_reference(tmp_path / "reference", ITERS)
    run = tmp_path / "run"
    run.mkdir()
    recs, dumps, log = launch(run, 2, [
        *PP2, *FT, "--chameleon-ft-startup-timeout-s", "120", *ONE_BUDGET,
        *faults("rank=0,iteration=3,phase=backward,kind=oom")], timeout_s=200, iters=ITERS)
    assert assert_losses_match(recs, ref_losses) == list(range(1, ITERS + 1)), log[-4000:]
    (recovery,) = [r for r in recs if r["event"] == "recovery"]
    assert recovery["cause"] == "oom" and recovery["failures"] == [], recovery
    assert recovery["redo_iteration"] == 3 and recovery["migrated_bytes"] == 0
    assert recovery["layout_after"]["mode"] == "megatron"
    assert (recovery["layout_after"]["pp"], recovery["layout_after"]["dp"]) == (2, 1)
    swap = {r["iteration"]: r["swap"] for r in recs if r["event"] == "iteration"}
    assert swap[2]["budget_bytes"] == 700000
    for i in range(3, ITERS + 1):  # rank 0's budget, lowered by oom_backoff 0.8
        assert swap[i]["budget_bytes"] == 560000, (i, swap[i])
        assert swap[i]["peak_resident_saved_bytes"] <= swap[i]["budget_bytes"]
    assert_same_state(combine([ref_dump]), combine([dumps[0], dumps[1]]), iters=ITERS)


def test_without_fault_tolerance_a_shared_step_is_not_redone_alone(tmp_path: Path) -> None:
    """The same error without --chameleon-ft: no rank can make the others redo the step, so
    the job ends with a message that says so (a rank redoing it alone would hang or mix the
    steps of its peers)."""
    args = job_args(tmp_path, 2, [*PP2, *ONE_BUDGET, "--oom-at", "0:3"])
    code, _ = run_launcher(["--standalone", *args], tmp_path / "log", timeout_s=150)
    log = (tmp_path / "log").read_text()
    assert code != 0, log[-3000:]
    assert "StepNotRedone: rank 0: step 3 failed (OutOfMemoryError" in log, log[-3000:]
    assert "needs every rank of the job: run under chameleon-run with --chameleon-ft" in log
    outcome(tmp_path)  # no process left behind


FF_PEAK = 2508800
"""Eq. 14's largest stage of the failure-free DP2 x PP2 layout of this model (bytes)."""


def _replan(tmp: Path, memory: float, swap: list[str]) -> tuple[list, dict]:
    profile = write_profile(tmp / "p.json", favour="pp", tp=1, device_memory_bytes=memory)
    recs, dumps, log = launch(tmp, 4, [
        *PP2, *FT, "--chameleon-ft-startup-timeout-s", "120", "--chameleon-ft-strategy",
        "replan", "--chameleon-ft-profile", str(profile), "--no-chameleon-ft-keep-replicas",
        *swap,
        *faults("rank=3,iteration=3,phase=forward,kind=exit")], timeout_s=240, iters=ITERS)
    (recovery,) = [r for r in recs if r["event"] == "recovery"]
    return recs, recovery


def test_a_re_plan_over_device_memory_swaps_to_fit_and_computes_the_same(tmp_path):
    """Device memory that the failure-free layout just fits: the best re-plan over the three
    survivors (one pipeline, layers 2-1-1) is over memory on its first stage, and swapping
    makes it fit at a small stall, so the decision center takes it with that stage's budget;
    the stage swaps within it. With the memory raised, the same re-plan without swap: the
    losses are bitwise those of that run."""
    (tmp_path / "tight").mkdir()
    tight, rec = _replan(tmp_path / "tight", FF_PEAK, [
        "--chameleon-swap", "--chameleon-swap-budget-fraction", "1.0"])
    assert rec["layout_after"]["pipelines"][0]["layers"] == [2, 1, 1], rec["layout_after"]
    (stage0,) = rec["decision"]["swap"]
    assert stage0["stage"] == 0 and 0 < stage0["fraction"] < 1 and stage0["stall_s"] >= 0
    assert stage0["ranks"] == [0], "rank 0 keeps its stage"
    after = [r["swap"] for r in tight if r["event"] == "iteration"
             and r["iteration"] > rec["redo_iteration"]]
    assert after
    for s in after:
        first = s["stages"][0]
        assert first["budget_bytes"] == int(stage0["fraction"] * first["peak_saved_bytes"])
        assert first["swapped_out_bytes"] > 0
        assert first["peak_resident_saved_bytes"] <= first["budget_bytes"]
        assert all(st["swapped_out_bytes"] == 0 for st in s["stages"][1:])  # they fit

    (tmp_path / "roomy").mkdir()
    roomy, rec2 = _replan(tmp_path / "roomy", 1e12, [])
    assert rec2["layout_after"]["pipelines"] == rec["layout_after"]["pipelines"]
    assert rec2["decision"]["swap"] == []
    loss = {r["iteration"]: r["loss"] for r in tight if r["event"] == "iteration"}
    assert loss == {r["iteration"]: r["loss"] for r in roomy if r["event"] == "iteration"}


HALF = ["--chameleon-swap", "--chameleon-swap-min-tensor-bytes", "1024",
        "--chameleon-swap-budget-fraction", "0.5"]


@pytest.mark.parametrize("flags", [("--bf16",), ("--bf16", "--use-distributed-optimizer")])
def test_swap_changes_no_number_of_a_recovered_bf16_job(tmp_path, flags):
    """A bf16 job re-planned onto a heterogeneous pipeline (the plan runtime), without and
    with the distributed optimizer (its state rebuilt from the shard copies, the steps since
    them redone, then sharded by the plan): with every stage swapping half its saved
    activations, every loss is bitwise the one of the same job without swap, before and
    after the recovery, and the stages swap after it."""
    runs = {}
    for name, swap in (("plain", []), ("swap", HALF)):
        (tmp_path / name).mkdir()
        recs, rec = _replan(tmp_path / name, 1e12, [*flags, *swap])
        assert rec["layout_after"]["mode"] == "hetero", rec["layout_after"]
        runs[name] = recs

    def losses(recs: list) -> list:
        return [(r["iteration"], r["loss"]) for r in recs if r["event"] == "iteration"]
    assert losses(runs["swap"]) == losses(runs["plain"]) and len(losses(runs["swap"])) >= ITERS
    after = [r["swap"] for r in runs["swap"] if r["event"] == "iteration"
             and r["iteration"] > rec["redo_iteration"]]
    assert after and all(s["swapped_out_bytes"] > 0 for s in after), after
