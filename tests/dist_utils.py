"""Run the trainer in subprocesses (torchrun for several ranks) and read its metrics.

Every run has a hard timeout; the whole process group is killed on timeout or failure,
so no rank is left behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# A model small enough for 2 CPU cores: ~1 s per iteration at 4 ranks.
TINY = [
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--vocab-size", "128", "--make-vocab-size-divisible-by", "32",
    "--mock-data", "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3",
    "--log-interval", "1", "--distributed-timeout-minutes", "2",
]


class RunFailed(AssertionError):
    pass


def run_trainer(nproc: int, argv: list[str], tmp_path: Path, *, name: str = "run",
                timeout: float = 240, module: str = "chameleon_megatron.pretrain_gpt",
                env: dict[str, str] | None = None) -> list[dict]:
    """Train with ``nproc`` ranks; returns the metrics records of rank 0."""
    metrics = tmp_path / f"{name}.jsonl"
    metrics.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", module] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={nproc}", "-m", module]
    cmd += [*argv, "--chameleon-metrics-file", str(metrics)]
    out = run_command(cmd, timeout=timeout, env=env, log=tmp_path / f"{name}.log")
    if not metrics.exists():
        raise RunFailed(f"no metrics written; output tail:\n{out[-4000:]}")
    return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]


def run_command(cmd: list[str], *, timeout: float, env: dict[str, str] | None = None,
                log: Path | None = None, check: bool = True) -> str:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=full_env, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise RunFailed(f"timed out after {timeout}s: {' '.join(cmd)}\n{out[-4000:]}") from None
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if log is not None:
        log.write_text(out)
    if check and proc.returncode != 0:
        raise RunFailed(f"exit {proc.returncode}: {' '.join(cmd)}\n{out[-4000:]}")
    return out


def losses(records: list[dict]) -> list[float]:
    return [r["loss"] for r in records if r.get("event") == "iteration"]
