"""The GPU validation entry keeps working without a GPU: its dry run executes every check's
code on the CPU at tiny sizes, and each resilience check fails on its deliberate defect
(``--break``) where the CPU can show it; where only a GPU can, the defect is shown to reach
the check, and the check's verdict on figures a GPU would give is tested here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(900), pytest.mark.serial]

RESILIENCE = ["nccl_abort", "optimizer_shards", "grad_sync", "plan_failover",
              "recovery_memory"]
GPU_ONLY = {"overlap_max_connections_1", "oom_expandable_segments", "te_layer_spec",
            "recovery_nccl"}


def validate(out: Path, *flags: str) -> tuple[subprocess.CompletedProcess, dict]:
    """The dry run (a budget that the loaded CI machine cannot exhaust)."""
    proc = subprocess.run(["bash", "scripts/gpu_validate.sh", str(out), "--dry-run",
                           "--budget-s", "3000", *flags], cwd=REPO, capture_output=True,
                          text=True, timeout=880)
    return proc, json.loads((out / "summary.json").read_text())["checks"]


def test_the_dry_run_passes_every_check_with_a_cpu_variant(tmp_path: Path) -> None:
    out = tmp_path / "gpu"
    proc, checks = validate(out)
    failed = {n: r for n, r in checks.items() if r["status"] == "FAIL"}
    assert proc.returncode == 0 and not failed, (proc.stdout[-3000:], failed)
    assert {n for n, r in checks.items() if r["status"] == "SKIP"} == GPU_ONLY
    assert {n for n, r in checks.items() if r["status"] == "PASS"} >= {
        *RESILIENCE, "overlap", "in_flight", "oom", "swap_benchmark", "gpu_tests"}
    # one verdict line per check, with its figures
    lines = [line.split(" ", 2) for line in proc.stdout.splitlines()]
    assert [(w, n) for w, n, _ in lines] == [(r["status"], n) for n, r in checks.items()]
    figures = {n: r.get("figures") for n, r in checks.items()}
    assert figures["oom"]["forward"]["equal"] and figures["oom"]["copy_back"]["equal"]
    assert all(figures["in_flight"]["bitwise_equal"])
    shards = figures["optimizer_shards"]
    assert shards["tensors"] > 0 and shards["tensors_differing"] == 0
    assert shards["sink"] == "ShardSink"
    sync = figures["grad_sync"]
    assert all(sync["bitwise_equal"].values())
    assert all(n >= 1 for early in sync["early_groups"].values() for n in early)
    failover = figures["plan_failover"]
    assert len(failover["losses"]) == len(failover["reference_losses"]) == 3
    assert failover["max_relative_error"] <= 1e-5
    assert figures["nccl_abort"]["cycles"] == 3


def test_each_defect_makes_its_check_fail(tmp_path: Path) -> None:
    """optimizer_shards, grad_sync and plan_failover fail on the CPU; nccl_abort and
    recovery_memory judge what only a GPU measures: their defect reaches the check."""
    out = tmp_path / "broken"
    names = ",".join(RESILIENCE)
    proc, checks = validate(out, "--only", names, "--break", names)
    assert proc.returncode == 1
    for name in ("optimizer_shards", "grad_sync", "plan_failover"):
        assert checks[name]["status"] == "FAIL", (name, checks[name])
        assert checks[name]["figures"]["reason"], name
    assert checks["optimizer_shards"]["figures"]["tensors_differing"] == 1
    assert not any(checks["grad_sync"]["figures"]["bitwise_equal"].values())
    assert checks["plan_failover"]["figures"]["dropped_microbatches"]
    assert checks["nccl_abort"]["figures"]["broken"] is True
    assert checks["nccl_abort"]["figures"]["last"]["aborted"] == 0
    held = checks["recovery_memory"]["figures"]["survivors"]
    assert held and all(s["extra_copy_held"] for s in held.values())


MiB = 1 << 20


def test_the_abort_verdict_needs_pending_aborted_groups_and_no_growth() -> None:
    from gpu_resilience import abort_failure

    run = {"groups": 3, "used": True, "pending": 3, "aborted": 3, "abort_s": 0.01}
    mem = {"allocated": 8 * MiB, "reserved": 20 * MiB, "device_used": 900 * MiB}
    assert abort_failure([run] * 20, [mem] * 20, nccl=True) is None
    assert "aborted" in abort_failure([run, {**run, "aborted": 0}], [mem] * 2, nccl=True)
    assert "pending" in abort_failure([{**run, "pending": 2}], [mem], nccl=True)
    grown = {**mem, "device_used": mem["device_used"] + 100 * MiB}
    assert "grew" in abort_failure([run] * 2, [mem, grown], nccl=True)
    assert "grew" in abort_failure([run] * 2, [mem, {**mem, "allocated": 9 * MiB}], nccl=True)


def test_the_memory_verdict_catches_a_layout_held_after_recovery() -> None:
    from gpu_resilience import memory_failure

    steady = {"steady_peak_bytes": 300 * MiB, "steady_resident_bytes": 100 * MiB}
    good = {**steady, "recovery_peak_bytes": 250 * MiB, "recovery_resident_bytes": 100 * MiB}
    assert memory_failure({0: good, 1: good}) is None
    held = {**good, "recovery_resident_bytes": 200 * MiB}
    assert "still held" in memory_failure({0: good, 1: held})
    three = {**good, "recovery_peak_bytes": 401 * MiB}
    assert "recovery peak" in memory_failure({0: three})


def test_an_exception_in_the_watcher_thread_is_raised_in_the_check() -> None:
    from gpu_resilience import in_thread

    assert in_thread(lambda: 3, timeout_s=5)[0] == 3
    with pytest.raises(RuntimeError, match="watcher thread raised: ZeroDivisionError"):
        in_thread(lambda: 1 / 0, timeout_s=5)
    with pytest.raises(TimeoutError, match="still runs"):
        in_thread(lambda: __import__("time").sleep(2), timeout_s=0.1)


def test_a_bad_invocation_is_one_clear_error(tmp_path: Path) -> None:
    proc = subprocess.run(["bash", "scripts/gpu_validate.sh"], cwd=REPO, capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 2 and proc.stderr.startswith("usage:")
    for flag, value, allowed in (("--only", "overlap,nope", None),
                                 ("--break", "oom", RESILIENCE)):
        proc = subprocess.run(["bash", "scripts/gpu_validate.sh", str(tmp_path), "--dry-run",
                               flag, value], cwd=REPO, capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 2
        (line,) = proc.stderr.strip().splitlines()
        bad = value.split(",")[-1]
        assert line.startswith(f"error: {flag} {bad!r}: not one of: "), line
        if allowed:
            assert line.endswith(", ".join(allowed))
