"""In-memory recovery of a --bf16 job under chameleon-run (CPU, gloo), against the
failure-free bf16 run of one process.

4 ranks, DP2 x PP2, bf16 parameters with fp32 main gradients, master weights and Adam
moments: rank 0 dies in backward at step 3. The survivors re-plan onto a uniform layout (the
plan runtime executes fp32 only, so rerouting is scored but not executed), move the bf16
weights, their fp32 master copies and the Adam moments from the surviving replicas, and
redo step 3: every step once, within the bf16 tolerance of the reference, and the final
master weights and Adam moments as in the reference.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from e2e_support import (  # noqa: E402
    FT, ITERS, assert_losses_match, assert_same_state, combine, faults, launch, run_reference,
    write_profile,
)

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(480), pytest.mark.serial]

BF16_RTOL = 1e-3
"""Loss tolerance against the one-process bf16 run (a layout rounds bf16 partial sums
elsewhere; ``tests/training/test_bf16.py`` measured at most 9e-5 between layouts)."""
STATE_RTOL = 0.1
"""Tolerance on the final state's sums of squares. bf16 trajectories drift apart: the
failure-free DP2 x PP2 job ends up to 3.6 % (weights) and 0.6 % (Adam moments) from the
one-process run, this job up to 5 % and 1 % (measured). A state that was not moved shows
in the losses of the redone step and in the Adam step count, which must be exact."""


def test_a_bf16_job_recovers_in_memory(tmp_path: Path) -> None:
    (tmp_path / "reference").mkdir()
    ref_losses, ref_dump = run_reference(tmp_path / "reference", flags=("--bf16",))
    job = tmp_path / "job"
    job.mkdir()
    profile = write_profile(job / "profile.json", favour="dp", tp=1)
    recs, dumps, log = launch(job, 4, [
        "--bf16", "--pipeline-model-parallel-size", "2", *FT,
        "--chameleon-ft-startup-timeout-s", "120", "--chameleon-ft-profile", str(profile),
        *faults("rank=0,iteration=3,phase=backward,kind=exit")], timeout_s=300)
    assert assert_losses_match(recs, ref_losses, rtol=BF16_RTOL) == list(range(1, ITERS + 1)), \
        log[-4000:]
    (done,) = [r for r in recs if r["event"] == "recovery"]
    assert (done["failed_ranks"], done["redo_iteration"], done["fallback"]) == ([0], 3, None)
    assert done["migrated_bytes"] > 0
    decision = done["decision"]
    assert decision["executed"] == "replan" and decision["mode"] == "megatron"
    if decision["choice"] == "reroute":  # scored best, but plans execute fp32 only
        assert "--bf16" in decision["executed_reason"]
    assert_same_state(combine([ref_dump]), combine(list(dumps.values())), rtol=STATE_RTOL)
