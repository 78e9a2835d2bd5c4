"""Run every GPU check and benchmark, each in its own process with its own time limit.

    python scripts/gpu_validate.py OUTDIR [--dry-run] [--only NAME,...] [--break NAME,...]
        [--budget-s SECONDS]

Prints one line per check: ``PASS NAME {figures}``, ``FAIL NAME {figures, reason}`` or
``SKIP NAME {why}``. Writes OUTDIR/<check>.json (the check's figures), OUTDIR/<check>.log
(its output) and OUTDIR/summary.json (every check's verdict, seconds and figures). Exit
status 0 when no check failed. The resilience checks come first; each check's limit is cut
to what is left of ``--budget-s`` (default 540 s), and a check with under 20 s left is
skipped, so the whole run fits a 10-minute device session. ``--break NAME`` injects that
check's deliberate defect (it must FAIL). ``--dry-run`` runs each check's code on the CPU
at tiny sizes (gloo), so that CI keeps this script and the checks working; its figures mean
nothing. Normally called by ``scripts/gpu_validate.sh``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable


@dataclass(frozen=True)
class Check:
    name: str
    argv: list[str]
    """Command (``{out}``: the check's JSON file)."""
    dry_argv: list[str] | None
    """The CPU variant for --dry-run (None: it has none, reported as skipped)."""
    timeout_s: float
    env: dict[str, str] = field(default_factory=dict)
    needs_gpus: int = 1
    needs_module: str | None = None
    """Skipped when this module cannot be imported."""
    breakable: bool = False
    """``--break`` reaches it (``gpu_checks.py --break``)."""


def _checks_py(check: str) -> list[str]:
    return [PY, "scripts/gpu_checks.py", check, "--out", "{out}"]


def _resilience(name: str, timeout_s: float) -> Check:
    return Check(name, _checks_py(name), [*_checks_py(name), "--dry-run"], timeout_s,
                 breakable=True)


GPU_TEST_FILES = ["tests/swap/test_gpu.py", "tests/test_presets_gpu.py",
                  "tests/resilience/recovery/test_host_copies.py"]
PRESET_RUN = [PY, "-m", "chameleon_megatron.pretrain_gpt", "--mock-data", "--train-iters",
              "4", "--lr-warmup-iters", "1", "--num-layers", "2",
              "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
              "--global-batch-size", "4", "--micro-batch-size", "1", "--log-interval", "1",
              "--chameleon-metrics-file", "{out}.metrics.jsonl"]

CHECKS = [
    _resilience("nccl_abort", 90),
    _resilience("optimizer_shards", 90),
    _resilience("grad_sync", 150),
    _resilience("plan_failover", 180),
    _resilience("recovery_memory", 150),
    Check("overlap", _checks_py("overlap"), [*_checks_py("overlap"), "--dry-run"], 60),
    Check("overlap_max_connections_1", _checks_py("overlap"), None, 60,
          env={"CUDA_DEVICE_MAX_CONNECTIONS": "1"}),
    Check("in_flight", _checks_py("in_flight"), [*_checks_py("in_flight"), "--dry-run"], 90),
    Check("oom", _checks_py("oom"), [*_checks_py("oom"), "--dry-run"], 60),
    Check("oom_expandable_segments", _checks_py("oom"), None, 60,
          env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}),
    Check("gpu_tests", [PY, "-m", "pytest", "-q", "-m", "gpu", *GPU_TEST_FILES],
          [PY, "-m", "pytest", "-q", "-m", "gpu", "--collect-only", *GPU_TEST_FILES], 120),
    Check("bf16_preset_1.3b", [*PRESET_RUN, "--chameleon-config", "configs/gpt-1.3b-8xh100.yaml"],
          [*PRESET_RUN, "--chameleon-config", "configs/tiny-cpu.yaml", "--bf16"], 120),
    Check("bf16_preset_7b_swap", [*PRESET_RUN, "--chameleon-config", "configs/gpt-7b-8xh100.yaml",
                                  "--chameleon-swap"],
          [*PRESET_RUN, "--chameleon-config", "configs/tiny-cpu.yaml", "--bf16",
           "--chameleon-swap"], 150),
    Check("te_layer_spec", [*PRESET_RUN, "--chameleon-config", "configs/gpt-1.3b-8xh100.yaml"],
          None, 120, needs_module="transformer_engine"),
    Check("swap_benchmark", [PY, "scripts/bench_swap_gpu.py", "--json", "{out}"],
          [PY, "scripts/bench_swap_gpu.py", "--smoke", "--json", "{out}"], 360),
    Check("recovery_nccl", [PY, "scripts/bench_recovery_e2e.py", "--json", "{out}"], None, 300,
          needs_gpus=2),
]
MIN_LEFT_S = 20.0
"""A check is not started with less of the run's budget left."""
DRY_RUN_SLOWDOWN = 4
"""The dry run's limits: tiny sizes, but a loaded 2-core CPU instead of an H200."""


def gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except ImportError:
        return 0


def why_skipped(check: Check, dry_run: bool) -> str | None:
    if dry_run:
        return None if check.dry_argv is not None else "no CPU variant (a GPU-only setting)"
    if gpus() < check.needs_gpus:
        return f"needs {check.needs_gpus} GPUs, this machine has {gpus()}"
    if check.needs_module is not None:
        import importlib.util

        if importlib.util.find_spec(check.needs_module) is None:
            return f"{check.needs_module} is not installed (it cannot travel to this machine)"
    return None


def verdict_line(output: str, name: str) -> tuple[str, dict] | None:
    """The check's own ``PASS|FAIL NAME {json}`` line, if it printed one."""
    for line in reversed(output.splitlines()):
        word, _, rest = line.partition(" ")
        if word in ("PASS", "FAIL") and rest.startswith(name + " "):
            try:
                return word, json.loads(rest[len(name) + 1:])
            except json.JSONDecodeError:
                return None
    return None


def run(check: Check, outdir: Path, dry_run: bool, broken: bool,
        left_s: float) -> dict[str, Any]:
    """Run one check; {"status": PASS|FAIL|SKIP, "seconds", "figures" or "why"}."""
    out = outdir / f"{check.name}.json"
    skip = why_skipped(check, dry_run)
    if skip is None and left_s < MIN_LEFT_S:
        skip = f"out of time: {left_s:.0f} s of the run's budget left"
    if skip is not None:
        return {"status": "SKIP", "why": skip}
    argv = [a.replace("{out}", str(out)) for a in (check.dry_argv if dry_run else check.argv)]
    argv += ["--break"] * broken
    # Unbuffered: a check killed at its limit still leaves what it printed in its log.
    env = {**os.environ, **check.env, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    limit = min(check.timeout_s * (DRY_RUN_SLOWDOWN if dry_run else 1), left_s)
    start = time.monotonic()
    output, code = _run(argv, env, limit)
    seconds = round(time.monotonic() - start, 1)
    (outdir / f"{check.name}.log").write_text(output)
    own = verdict_line(output, check.name)
    if code is None:  # with what it had written by then (a benchmark saves each section)
        status = "FAIL"
        figures = {**(json.loads(out.read_text()) if out.exists() else {}),
                   "reason": f"timed out after {limit:.0f} s"}
    elif own is not None:
        status, figures = own
    else:
        status = "PASS" if code == 0 else "FAIL"
        figures = json.loads(out.read_text()) if out.exists() else {}
        if code != 0:
            figures = {**figures, "reason": f"exit status {code}",
                       "log_tail": output[-1500:]}
    return {"status": status, "seconds": seconds, "figures": figures}


def _run(argv: list[str], env: dict[str, str], limit_s: float) -> tuple[str, int | None]:
    """(output, exit status or None when killed at ``limit_s``). The check's whole process
    group goes at the end: a launched job's workers must not outlive it on the GPU."""
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=limit_s)
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        code = None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    if code is None:
        output, _ = proc.communicate()
    return output, code


def _names(value: str | None, allowed: list[str], flag: str,
           default: list[str]) -> list[str] | str:
    """The comma-separated names of ``value`` (``default`` when None), or the error line."""
    if value is None:
        return default
    names = value.split(",")
    unknown = [n for n in names if n not in allowed]
    if unknown:
        return f"error: {flag} {unknown[0]!r}: not one of: {', '.join(allowed)}"
    return names


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--only", default=None,
                    help="comma-separated check names, run in this order")
    ap.add_argument("--break", dest="broken", default=None,
                    help="comma-separated checks to run with their deliberate defect")
    ap.add_argument("--budget-s", type=float, default=540.0,
                    help="seconds for the whole run (default 540)")
    a = ap.parse_args()
    every = [c.name for c in CHECKS]
    only = _names(a.only, every, "--only", every)
    broken = _names(a.broken, [c.name for c in CHECKS if c.breakable], "--break", [])
    for names in (only, broken):
        if isinstance(names, str):
            print(names, file=sys.stderr)
            return 2
    if a.budget_s <= 0:
        print(f"error: --budget-s {a.budget_s}: must be > 0", file=sys.stderr)
        return 2
    a.outdir.mkdir(parents=True, exist_ok=True)
    summary = {"dry_run": a.dry_run, "gpus": gpus(), "budget_s": a.budget_s,
               "broken": broken, "checks": {}}
    start = time.monotonic()
    by_name = {c.name: c for c in CHECKS}
    for check in (by_name[n] for n in only):  # in the order given: the first matter most
        left = a.budget_s - (time.monotonic() - start)
        result = run(check, a.outdir, a.dry_run, check.name in broken, left)
        summary["checks"][check.name] = result
        shown = result.get("figures", {"why": result.get("why")})
        print(f"{result['status']} {check.name} {json.dumps(shown, default=str)}", flush=True)
        (a.outdir / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    failed = [n for n, r in summary["checks"].items() if r["status"] == "FAIL"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
