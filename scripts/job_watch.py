"""Run a training job while watching it: every metrics record and log line stamped with the
wall-clock time it appeared, and worker processes killed (SIGKILL, like a crashed node) at
given steps. Used by ``bench_vs_restart.py`` for both the in-memory and the restart job, so
the two see the same failures at the same moments and are timed by the same clock.

A kill is due when the record of the step before it has appeared: the victim dies early in
that step (its forward), before the step completes anywhere.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

logger = logging.getLogger(__name__)

TAG_ENV = "CHAMELEON_BENCH_JOB"
"""Set in the launcher's environment (workers inherit it): finds this job's workers."""
POLL_S = 0.02
LAUNCH_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""Dropped from the launcher's environment: a worker's RANK must be the launcher's."""


@dataclass
class Trace:
    """What a watched job did, every time from ``time.time()``."""

    start: float
    end: float = 0.0
    exit_code: int | None = None
    records: list[tuple[float, dict]] = field(default_factory=list)
    lines: list[tuple[float, str]] = field(default_factory=list)
    kills: list[float] = field(default_factory=list)
    load: tuple[float, float] = (0.0, 0.0)
    """The host's 1-minute load average at the start and at the end (other work inflates
    every time: jobs run one after the other see different loads)."""

    @property
    def wall_s(self) -> float:
        return self.end - self.start

    def iterations(self) -> list[tuple[float, int]]:
        return [(t, r["iteration"]) for t, r in self.records if r.get("event") == "iteration"]


class Tail:
    """The complete lines appended to a file since the last call, each with its time."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._partial = ""

    def read(self) -> list[tuple[float, str]]:
        try:
            with open(self.path) as f:
                f.seek(self._offset)
                text = f.read()
                self._offset = f.tell()
        except FileNotFoundError:
            return []
        now = time.time()
        text, self._partial = self._partial + text, ""
        lines = text.split("\n")
        self._partial = lines.pop()  # "" after a complete last line
        return [(now, line) for line in lines if line.strip()]


@dataclass(frozen=True)
class Kill:
    """Kill launch rank ``rank`` during step ``step`` (once the record of step-1 is seen and
    ``ready(step)`` holds, e.g. the checkpoint of step-1 is complete)."""

    step: int
    rank: int


def job_env(tag: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    return {**env, TAG_ENV: tag, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": str(Path(__file__).resolve().parents[1])}


def worker_pids(tag: str, rank: int) -> list[int]:
    """Live processes of job ``tag`` started as launch rank ``rank`` (their RANK)."""
    want = {f"{TAG_ENV}={tag}".encode(), f"RANK={rank}".encode()}
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            env = set((proc / "environ").read_bytes().split(b"\0"))
        except OSError:
            continue
        if want <= env:
            found.append(int(proc.name))
    return found


def watch_job(cmd: list[str], *, cwd: Path, metrics: Path, log: Path, tag: str,
              kills: tuple[Kill, ...] = (), ready: Callable[[int], bool] = lambda step: True,
              env: dict[str, str] | None = None, timeout_s: float) -> Trace:
    """Run ``cmd`` (a launcher) in its own session, stamping ``metrics`` records and ``log``
    lines and firing ``kills`` in order; the session is killed at the end or on timeout.
    ``env``: added to the launcher's environment."""
    pending = list(kills)
    records, lines = Tail(metrics), Tail(log)
    with open(log, "w") as out:
        trace = Trace(start=time.time(), load=(os.getloadavg()[0], 0.0))
        proc = subprocess.Popen(cmd, cwd=cwd, env={**job_env(tag), **(env or {})}, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            while proc.poll() is None and time.time() - trace.start < timeout_s:
                time.sleep(POLL_S)
                trace.lines += lines.read()
                for t, line in records.read():
                    trace.records.append((t, json.loads(line)))
                if pending and _due(trace, pending[0], ready):
                    trace.kills.append(_kill(tag, pending.pop(0)))
        finally:
            trace.end = time.time()
            trace.exit_code = proc.poll()
            trace.load = (trace.load[0], os.getloadavg()[0])
            _kill_session(proc)
    trace.lines += lines.read()
    trace.records += [(t, json.loads(line)) for t, line in records.read()]
    return trace


def _due(trace: Trace, kill: Kill, ready: Callable[[int], bool]) -> bool:
    """The record of step-1 appeared after the previous kill (a restarted job redoes steps
    before ``kill.step`` - 1 only: ``kill.step`` - 1 is new) and ``ready`` agrees."""
    after = trace.kills[-1] if trace.kills else 0.0
    seen = any(t > after and it == kill.step - 1 for t, it in trace.iterations())
    return seen and ready(kill.step)


def _kill(tag: str, kill: Kill) -> float:
    pids = worker_pids(tag, kill.rank)
    if not pids:
        raise RuntimeError(f"no live worker of launch rank {kill.rank} to kill at step "
                           f"{kill.step}")
    now = time.time()
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    logger.info("killed launch rank %d (pid %s) in step %d", kill.rank, pids, kill.step)
    return now


def _kill_session(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
