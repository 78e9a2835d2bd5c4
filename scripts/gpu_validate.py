"""Run every GPU test and benchmark, each in its own process with its own time limit.

    python scripts/gpu_validate.py OUTDIR [--dry-run] [--only NAME,...]

Writes OUTDIR/<check>.json (what the check reported, or its failure), OUTDIR/<check>.log
(its output) and OUTDIR/summary.json (status and seconds of every check, and why any was
skipped). Exit status 0 when no check failed. ``--dry-run`` runs each check's code on the
CPU at tiny sizes, so that CI keeps this script and the checks working; its figures mean
nothing. Normally called by ``scripts/gpu_validate.sh``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

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


def _checks_py(check: str) -> list[str]:
    return [PY, "scripts/gpu_checks.py", check, "--out", "{out}"]


PRESET_RUN = [PY, "-m", "chameleon_megatron.pretrain_gpt", "--mock-data", "--train-iters",
              "4", "--lr-warmup-iters", "1", "--num-layers", "2",
              "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
              "--global-batch-size", "4", "--micro-batch-size", "1", "--log-interval", "1",
              "--chameleon-metrics-file", "{out}.metrics.jsonl"]

CHECKS = [
    Check("gpu_tests", [PY, "-m", "pytest", "-q", "-m", "gpu", "tests"],
          [PY, "-m", "pytest", "-q", "-m", "gpu", "--collect-only", "tests/swap/test_gpu.py",
           "tests/test_presets_gpu.py"], 240),
    Check("overlap", _checks_py("overlap"), [*_checks_py("overlap"), "--dry-run"], 90),
    Check("overlap_max_connections_1", _checks_py("overlap"), None, 90,
          env={"CUDA_DEVICE_MAX_CONNECTIONS": "1"}),
    Check("in_flight", _checks_py("in_flight"), [*_checks_py("in_flight"), "--dry-run"], 120),
    Check("oom", _checks_py("oom"), [*_checks_py("oom"), "--dry-run"], 90),
    Check("oom_expandable_segments", _checks_py("oom"), None, 90,
          env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}),
    Check("nccl_abort", _checks_py("nccl_abort"), [*_checks_py("nccl_abort"), "--dry-run"], 90),
    Check("bf16_preset_1.3b", [*PRESET_RUN, "--chameleon-config", "configs/gpt-1.3b-8xh100.yaml"],
          [*PRESET_RUN, "--chameleon-config", "configs/tiny-cpu.yaml", "--bf16"], 150),
    Check("bf16_preset_7b_swap", [*PRESET_RUN, "--chameleon-config", "configs/gpt-7b-8xh100.yaml",
                                  "--chameleon-swap"],
          [*PRESET_RUN, "--chameleon-config", "configs/tiny-cpu.yaml", "--bf16",
           "--chameleon-swap"], 150),
    Check("te_layer_spec", [*PRESET_RUN, "--chameleon-config", "configs/gpt-1.3b-8xh100.yaml"],
          None, 150, needs_module="transformer_engine"),
    Check("swap_benchmark", [PY, "scripts/bench_swap_gpu.py", "--json", "{out}"],
          [PY, "scripts/bench_swap_gpu.py", "--smoke", "--json", "{out}"], 300),
    Check("recovery_nccl", [PY, "scripts/bench_recovery_e2e.py", "--json", "{out}"], None, 300,
          needs_gpus=2),
]


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


def run(check: Check, outdir: Path, dry_run: bool) -> dict:
    out = outdir / f"{check.name}.json"
    skip = why_skipped(check, dry_run)
    if skip is not None:
        return {"status": "skipped", "why": skip}
    argv = [a.replace("{out}", str(out)) for a in (check.dry_argv if dry_run else check.argv)]
    env = {**os.environ, **check.env, "PYTHONPATH": str(REPO)}
    start = time.monotonic()
    with open(outdir / f"{check.name}.log", "w") as log:
        try:
            code = subprocess.run(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                  timeout=check.timeout_s).returncode
        except subprocess.TimeoutExpired:
            code = None
    seconds = time.monotonic() - start
    status = "passed" if code == 0 else ("timed out" if code is None else f"failed ({code})")
    return {"status": status, "seconds": round(seconds, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--only", default=None, help="comma-separated check names")
    a = ap.parse_args()
    names = [c.name for c in CHECKS]
    only = a.only.split(",") if a.only else names
    unknown = sorted(set(only) - set(names))
    if unknown:
        print(f"error: --only {unknown[0]!r}: not a check; checks: {', '.join(names)}",
              file=sys.stderr)
        return 2
    a.outdir.mkdir(parents=True, exist_ok=True)
    summary = {"dry_run": a.dry_run, "gpus": gpus(), "checks": {}}
    for check in CHECKS:
        if check.name not in only:
            continue
        result = run(check, a.outdir, a.dry_run)
        summary["checks"][check.name] = result
        print(f"{check.name:28s} {result['status']:12s} {result.get('seconds', '')}"
              f" {result.get('why', '')}", flush=True)
        (a.outdir / "summary.json").write_text(json.dumps(summary, indent=1))
    failed = [n for n, r in summary["checks"].items() if r["status"] not in ("passed", "skipped")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
