"""Swap and fault tolerance together: a job that swaps activations keeps swapping, within
budget and without changing a number, on the layout a recovery re-plans.

4 ranks DP2 x PP2 with per-stage swap budgets (700 kB for stage 0, 600 kB for stage 1); rank
3 dies in step 3; a profile with a slow all-reduce makes the re-plan one heterogeneous
pipeline of depth 3 over the survivors (run by the plan runtime, whose steps go through the
same megatron seams). The configured stages no longer exist, so the tightest budget holds on
every stage. Compared with a failure-free run without swap (one process).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from e2e_support import (  # noqa: E402
    FT, assert_losses_match, assert_same_state, combine, faults, launch, run_reference,
    write_profile,
)

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]

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
