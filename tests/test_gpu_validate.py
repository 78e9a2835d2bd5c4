"""The GPU validation entry keeps working without a GPU: its dry run executes every check's
code on the CPU at tiny sizes and writes the summary a GPU run would."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(400), pytest.mark.serial]


def test_the_dry_run_runs_every_check_with_a_cpu_variant(tmp_path: Path) -> None:
    out = tmp_path / "gpu"
    proc = subprocess.run(["bash", "scripts/gpu_validate.sh", str(out), "--dry-run"], cwd=REPO,
                          capture_output=True, text=True, timeout=380)
    summary = json.loads((out / "summary.json").read_text())
    checks = summary["checks"]
    assert proc.returncode == 0, (proc.stdout, {n: (out / f"{n}.log").read_text()[-2000:]
                                                 for n, r in checks.items()
                                                 if r["status"] not in ("passed", "skipped")})
    ran = {n for n, r in checks.items() if r["status"] == "passed"}
    assert {"overlap", "in_flight", "oom", "nccl_abort", "swap_benchmark", "gpu_tests"} <= ran
    skipped = {n: r["why"] for n, r in checks.items() if r["status"] == "skipped"}
    assert set(skipped) == {"overlap_max_connections_1", "oom_expandable_segments",
                            "te_layer_spec", "recovery_nccl"}
    oom = json.loads((out / "oom.json").read_text())
    assert oom["forward"]["equal"] and oom["copy_back"]["fired"] and oom["copy_back"]["equal"]
    assert all(json.loads((out / "in_flight.json").read_text())["bitwise_equal"])


def test_a_bad_invocation_is_one_clear_error(tmp_path: Path) -> None:
    proc = subprocess.run(["bash", "scripts/gpu_validate.sh"], cwd=REPO, capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 2 and proc.stderr.startswith("usage:")
    proc = subprocess.run(["bash", "scripts/gpu_validate.sh", str(tmp_path), "--dry-run",
                           "--only", "overlap,nope"], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: --only 'nope': not a check; checks: " + ", ".join(
            ["gpu_tests", "overlap", "overlap_max_connections_1", "in_flight", "oom",
             "oom_expandable_segments", "nccl_abort", "bf16_preset_1.3b", "bf16_preset_7b_swap",
             "te_layer_spec", "swap_benchmark", "recovery_nccl"])]
