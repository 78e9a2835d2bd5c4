"""megatron-core's current release (0.19.x) through every seam the project patches, on CPU.

``scripts/setup_env.sh`` installs it apart from ``.venv``'s site-packages, into
``.venv/megatron-core-next`` (its Python 3.11 wheel declares Requires-Python >= 3.12; pip
installs it with --ignore-requires-python, compiled dataset helpers included), and these
tests put it first on PYTHONPATH of the processes they start. What that proves: the
project's Python seams (CPU platform, swap schedule wrappers and hooks, process-group
rebuilds, the trainer, the recovery runtime) work with 0.19's Python code. What it does not:
anything CUDA, Transformer Engine or Python 3.12 specific.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "resilience"))
from dist_utils import TINY, losses, run_trainer  # noqa: E402
from e2e_support import (  # noqa: E402
    FT, ITERS, assert_losses_match, faults, launch, run_reference, write_profile,
)

REPO = Path(__file__).resolve().parents[2]
NEXT = REPO / ".venv" / "megatron-core-next"
pytestmark = [
    pytest.mark.skipif(not NEXT.is_dir(), reason=f"{NEXT} missing: run scripts/setup_env.sh"),
    pytest.mark.timeout(600),
]
ON_NEXT = {"PYTHONPATH": f"{NEXT}"}
PP2 = ["--pipeline-model-parallel-size", "2", "--train-iters", "4"]


def test_the_next_release_is_the_one_imported_and_its_seams_fit():
    probe = (
        "import megatron.core\n"
        "from megatron.core.tensor_parallel import random\n"
        "from megatron.core.pipeline_parallel import schedules\n"
        "from chameleon_megatron.megatron.platform import check_cpu_seams\n"
        "from chameleon_megatron.megatron.swap_seams import check_schedules\n"
        "check_cpu_seams(random)\n"
        "print(check_schedules(schedules), megatron.core.__file__)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], env={**ON_NEXT, "PATH": ""},
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    version, path = out.stdout.split()
    assert version.startswith("0.19.") and path.startswith(str(NEXT))


def test_pp2_trains_with_swap_bitwise_and_computes_what_0_16_computes(tmp_path):
    old = losses(run_trainer(2, TINY + PP2, tmp_path, name="v016"))
    new = losses(run_trainer(2, TINY + PP2, tmp_path, name="v019", env=ON_NEXT))
    swapped = run_trainer(2, TINY + PP2 + ["--chameleon-swap", "--chameleon-swap-min-tensor-bytes",
                                           "1024"], tmp_path, name="v019-swap", env=ON_NEXT)
    (run,) = [r for r in swapped if r["event"] == "run"]
    assert run["versions"]["megatron_core"].startswith("0.19.")
    assert losses(swapped) == new, "swap changed the losses on 0.19"
    assert new == old, "0.19 and 0.16 compute different losses for the same model and data"
    its = [r for r in swapped if r["event"] == "iteration"]
    assert all(r["swap"]["swapped_out_bytes"] > 0 for r in its[1:])


@pytest.mark.serial
def test_a_failed_rank_is_recovered_in_memory(tmp_path, monkeypatch):
    """4 ranks DP2 x PP2 on 0.19: rank 3 exits in step 3; the survivors re-plan and every
    step matches the failure-free run (same release)."""
    monkeypatch.setenv("PYTHONPATH", str(NEXT))
    (tmp_path / "ref").mkdir()
    ref_losses, _ = run_reference(tmp_path / "ref", ITERS)
    profile = write_profile(tmp_path / "profile.json", favour="dp", tp=1)
    recs, _, log = launch(tmp_path, 4, [
        "--pipeline-model-parallel-size", "2", *FT, "--chameleon-ft-startup-timeout-s", "120",
        "--chameleon-ft-profile", str(profile),
        *faults("rank=3,iteration=3,phase=forward,kind=exit")], timeout_s=300)
    assert assert_losses_match(recs, ref_losses) == list(range(1, ITERS + 1)), log[-4000:]
    (run,) = [r for r in recs if r["event"] == "run"]
    assert run["versions"]["megatron_core"].startswith("0.19.")
    (recovery,) = [r for r in recs if r["event"] == "recovery"]
    assert recovery["failed_ranks"] == [3] and recovery["fallback"] is None
