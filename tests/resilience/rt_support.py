"""Shared by the rt_ tests: launching chameleon-run with hard limits, guarding worker programs.

Worker programs are the test files themselves run as scripts; ``guard_worker`` makes each one
exit when its agent dies or its time is up, so no test leaves a process behind.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(30)

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}"
    env["OMP_NUM_THREADS"] = "1"
    return env


def start_launcher(launcher_args: list[str], log: Path) -> subprocess.Popen:
    """Start ``python -m chameleon_megatron.run <launcher_args>`` in its own session."""
    out = open(log, "w")
    return subprocess.Popen([sys.executable, "-m", "chameleon_megatron.run", *launcher_args],
                            cwd=REPO, env=worker_env(), stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    """End a launcher: SIGTERM (the agent stops its workers), then SIGKILL its session."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def run_launcher(launcher_args: list[str], log: Path, timeout_s: float) -> tuple[int, float]:
    """Run the launcher to completion; return (exit status, seconds). Always cleans up."""
    start = time.monotonic()
    proc = start_launcher(launcher_args, log)
    try:
        code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        code = None
    finally:
        stop(proc)
    if code is None:
        pytest.fail(f"launcher still running after {timeout_s} s; log:\n{log.read_text()[-4000:]}")
    return code, time.monotonic() - start


def guard_worker(max_seconds: float) -> None:
    """In a worker program: exit when the parent (the agent) is gone or after max_seconds."""
    parent = os.getppid()
    deadline = time.monotonic() + max_seconds

    def watch() -> None:
        while os.getppid() == parent and time.monotonic() < deadline:
            time.sleep(0.2)
        os._exit(99)
    threading.Thread(target=watch, daemon=True).start()


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"
