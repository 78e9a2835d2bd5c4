"""A worker started by chameleon-run ends with its agent, however the agent ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rt_support import alive, worker_env  # noqa: E402

from chameleon_megatron.resilience.store.env import AGENT_PID_ENV

pytestmark = pytest.mark.timeout(60)

WORKER = ("import sys, time; import chameleon_megatron.resilience.launch.with_agent as w;"
          "{setup}print(w.end_with_agent(0.1), flush=True); time.sleep(60)")
AGENT = ("import os, subprocess, sys;"
         f"env = {{**os.environ, {AGENT_PID_ENV!r}: str(os.getpid())}};"
         "p = subprocess.Popen([sys.executable, '-c', sys.argv[1]], env=env, "
         "stdout=subprocess.PIPE, text=True);"
         "print(p.pid, p.stdout.readline().strip(), flush=True); "
         "import time; time.sleep(60)")


@pytest.mark.parametrize("setup, how", [
    ("", "prctl"),
    ("w._parent_death_signal = lambda sig: False;", "watch"),  # no prctl: the thread
])
def test_the_worker_dies_when_its_agent_is_killed(setup: str, how: str) -> None:
    agent = subprocess.Popen([sys.executable, "-c", AGENT, WORKER.format(setup=setup)],
                             env=worker_env(), stdout=subprocess.PIPE, text=True)
    pid, said = agent.stdout.readline().split()
    pid = int(pid)
    try:
        assert said == how
        assert alive(pid)
        agent.kill()  # SIGKILL: the agent cannot stop its workers
        agent.wait()
        deadline = time.monotonic() + 10
        while alive(pid):
            assert time.monotonic() < deadline, "the worker outlived its agent"
            time.sleep(0.05)
    finally:
        agent.kill()
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_a_worker_whose_agent_is_already_gone_ends_at_once() -> None:
    env = {**worker_env(), AGENT_PID_ENV: "1"}  # not this worker's parent
    run = subprocess.run([sys.executable, "-c", WORKER.format(setup="")], env=env,
                         capture_output=True, text=True, timeout=30)
    assert run.returncode == -signal.SIGKILL and "agent (pid 1) is gone" in run.stderr


def test_without_an_agent_nothing_changes() -> None:
    env = {k: v for k, v in worker_env().items() if k != AGENT_PID_ENV}
    code = "import chameleon_megatron.resilience.launch.with_agent as w; print(w.end_with_agent())"
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=30, check=True)
    assert run.stdout.strip() == "None"
