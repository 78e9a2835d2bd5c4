"""Per-rank heartbeats, written on the worker's host for its agent, and the rule that
declares a silent rank failed.

A worker beats at least once per step and says, with each beat, how long it may stay silent
(its heartbeat timeout, derived from its measured step time). Its agent, on the same host,
compares the beat with its own clock; a rank that has not beaten yet is allowed the start-up
timeout from its start.

The beats are files in a folder the agent gives its workers (``BEAT_DIR_ENV``), not job-store
keys: only the worker's own agent reads them, and a beat that crosses the network makes a
slow link look like a hung worker (2 s of delay on one host's link: each store call took
seconds, the beats reached the store past the window, and the agent killed its own worker).
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Mapping

from chameleon_megatron.resilience.store.env import BEAT_DIR_ENV


STACKS_SIGNAL = signal.SIGUSR1
"""What an agent sends a worker it found silent, just before it kills it: the worker writes
every thread's stack to its stderr (``dump_stacks_on_request``), the one record of where it
hung."""
STACKS_GRACE_S = 1.0
"""How long the agent lets a silent worker write its stacks before the kill."""


def dump_stacks_on_request() -> None:
    """In a worker: ``STACKS_SIGNAL`` dumps every thread's stack to stderr (from C: it works
    while the main thread is blocked in a collective). A handler already installed for it
    (Megatron-LM's ``--exit-signal`` may name it) still runs after the dump."""
    installed = signal.getsignal(STACKS_SIGNAL) not in (signal.SIG_DFL, signal.SIG_IGN, None)
    faulthandler.register(STACKS_SIGNAL, all_threads=True, chain=installed)


@dataclass(frozen=True)
class Beat:
    """The last sign of life of one rank."""

    time: float
    """Unix seconds of the beat (the worker's host clock, which is also its agent's)."""
    timeout_s: float
    """How long the rank may stay silent after this beat."""
    iteration: int | None = None
    """The step it was at, for the log."""


class Heartbeat:
    """The worker side: ``beat`` once per step (and while waiting in recovery); from any
    thread (each writes its own temporary file, then renames it over the beat)."""

    def __init__(self, directory: Path, rank: int) -> None:
        self._path = directory / str(rank)

    @classmethod
    def from_env(cls, rank: int) -> Heartbeat:
        """The beats of a worker started by the chameleon-run agent."""
        directory = os.environ.get(BEAT_DIR_ENV)
        if directory is None:
            raise RuntimeError(f"{BEAT_DIR_ENV} is not set: heartbeats need the chameleon-run "
                               f"agent (python -m chameleon_megatron.run)")
        return cls(Path(directory), rank)

    def beat(self, timeout_s: float, iteration: int | None = None) -> None:
        beat = Beat(time=time.time(), timeout_s=timeout_s, iteration=iteration)
        scratch = self._path.with_name(f".{self._path.name}.{threading.get_ident()}")
        scratch.write_text(json.dumps(asdict(beat)))
        os.replace(scratch, self._path)


def read_beats(directory: Path, ranks: Iterable[int]) -> dict[int, Beat]:
    """The last beat of each rank that has beaten at least once."""
    out = {}
    for rank in ranks:
        try:
            text = (directory / str(rank)).read_text()
        except FileNotFoundError:
            continue
        out[rank] = Beat(**json.loads(text))
    return out


def overdue(beats: Mapping[int, Beat], ranks: Iterable[int], *, now: float, started_at: float,
            startup_timeout_s: float) -> dict[int, float]:
    """Ranks silent past their deadline, each with its last sign of life (pure)."""
    late = {}
    for rank in ranks:
        beat = beats.get(rank)
        last, allowed = (started_at, startup_timeout_s) if beat is None else (beat.time, beat.timeout_s)
        if now - last > allowed:
            late[rank] = last
    return late
