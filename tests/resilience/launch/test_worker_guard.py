"""The worker guard of the launch tests: no test leaves a process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rt_support import alive, worker_env  # noqa: E402

RESILIENCE_TESTS = Path(__file__).resolve().parents[1]


def test_guard_worker_exits_when_the_parent_dies() -> None:
    """Without the guard, a worker whose agent was killed would outlive its test."""
    child = (f"import sys, time; sys.path.insert(0, {str(RESILIENCE_TESTS)!r});"
             "import rt_support as s; s.guard_worker(60); print('ready', flush=True);"
             "time.sleep(60)")
    parent = ("import subprocess, sys;"
              f"p = subprocess.Popen([sys.executable, '-c', {child!r}], stdout=subprocess.PIPE);"
              "assert p.stdout.readline().strip() == b'ready'; print(p.pid)")
    out = subprocess.run([sys.executable, "-c", parent], env=worker_env(), timeout=30,
                         capture_output=True, text=True, check=True)
    pid = int(out.stdout)
    deadline = time.monotonic() + 10
    try:
        while alive(pid):
            assert time.monotonic() < deadline, "the orphaned worker is still running"
            time.sleep(0.1)
    finally:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
