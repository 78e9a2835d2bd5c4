"""A recovery lets go of the old layout before it builds the new one (issue 25, part 5).

4 ranks, DP2 x PP2; rank 3 exits in backward at step 3. The worker takes weak references to
the layout it trains after every step (engine, runtime, model chunks, a parameter, the
optimizer, the DDP gradient buffers) and lists those still alive as the new layout's model
is built: none may be (the migration reads only the old state's tensors). The job still
trains exactly as the failure-free reference, and its recovery record carries every
survivor's memory peaks.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from e2e_support import (  # noqa: E402
    FT, assert_losses_match, faults, launch, run_reference, write_profile,
)

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(480), pytest.mark.serial]


DIST_OPT = ("--use-distributed-optimizer", "--chameleon-ft-shard-replica-interval", "1")


@pytest.mark.parametrize(("strategy", "flags", "mode"), [
    ("reroute", (), "reroute"),
    ("replan", (), "megatron"),
    # The distributed optimizer's shard views tie the old model to DDP's hooks through
    # autograd (megatron/ddp_release.py): without the release the old layout stays alive.
    ("replan", DIST_OPT, "megatron"),
    ("reroute", DIST_OPT, "reroute"),
])
def test_the_old_layout_is_freed_before_the_new_one_is_built(
        tmp_path: Path, strategy: str, flags: tuple[str, ...], mode: str) -> None:
    (tmp_path / "reference").mkdir()
    ref_losses, _ = run_reference(tmp_path / "reference", flags=flags)
    job = tmp_path / "job"
    job.mkdir()
    profile = write_profile(job / "profile.json", favour="dp", tp=1)
    recs, _, log = launch(job, 4, [
        *flags, "--pipeline-model-parallel-size", "2", "--chameleon-ft-strategy", strategy,
        *FT, "--chameleon-ft-startup-timeout-s", "120", "--chameleon-ft-profile", str(profile),
        "--check-freed", *faults("rank=3,iteration=3,phase=backward,kind=exit")],
        timeout_s=400)
    (rec,) = [r for r in recs if r["event"] == "recovery"]
    assert rec["layout_after"]["mode"] == mode, rec["layout_after"]
    checks = {int(p.stem): json.loads(p.read_text()) for p in (job / "dump").glob("*.freed")}
    assert sorted(checks) == [0, 1, 2], log[-4000:]
    active = rec["layout_after"]["ranks"]
    for rank, found in checks.items():
        assert len(found) == (rank in active), (rank, found)  # one rebuild (spares: none)
        assert all(f == [] for f in found), f"rank {rank}: alive when the new layout was " \
                                            f"built: {found}"
    assert_losses_match(recs, ref_losses)
    memory = rec["memory_peak_bytes"]
    assert memory["ranks"] == [0, 1, 2]
    assert all(v > 0 for window in ("steady", "recovery") for v in memory["host"][window])
