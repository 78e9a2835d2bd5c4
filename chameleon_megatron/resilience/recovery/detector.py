"""Failure detection on a worker: timeouts from the measured step time, heartbeats, the
announcements of the agents, and telling a peer's failure from a local error.

How a survivor learns of a failure: a collective or p2p op with the dead rank raises within
~0.05 s (gloo: connection closed); one blocked on a live peer raises at the process-group
timeout, so that timeout is derived from the step time instead of megatron's 30 minutes; and a
watcher thread interrupts the communication when a failure is announced (aborts the NCCL
communicators, then shuts the connections gloo runs over down), which makes a blocked
operation return at once.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import statistics
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Callable

import torch.distributed as dist

from chameleon_megatron.megatron import groups
from chameleon_megatron.resilience.config import ResilienceConfig
from chameleon_megatron.resilience.store.announce import (
    AbandonRecord,
    FailureRecord,
    abandon_count,
    failure_count,
    read_abandons,
    read_failures,
)
from chameleon_megatron.resilience.store.heartbeat import Heartbeat
from chameleon_megatron.resilience.store.job_store import JobStore

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Timeouts:
    """How long to wait, in seconds, before calling a rank dead."""

    pg_s: float
    """Collective/p2p timeout of every process group."""
    heartbeat_s: float
    """Silence after which the agent kills a rank."""
    rendezvous_s: float
    """How long survivors wait for each other in a recovery rendezvous."""


def derive_timeouts(step_time_s: float | None, ft: ResilienceConfig) -> Timeouts:
    """Timeouts for a measured step time (None: not measured yet, use the start-up timeout).

    A healthy rank beats once per step, and one step can include a collective blocked for a
    whole group timeout on a peer that died: so heartbeat = 2 x group timeout (the group
    timeout is at least one step). Survivors meet within a group timeout of a failure, and a
    hung rank is declared after a heartbeat timeout: the rendezvous waits for both, twice.
    """
    if step_time_s is not None and step_time_s <= 0:
        raise ValueError(f"step time={step_time_s} s: must be > 0")
    if step_time_s is None:
        pg = ft.startup_timeout_s
    else:
        pg = max(ft.min_pg_timeout_s, ft.pg_timeout_factor * step_time_s)
    return Timeouts(pg_s=pg, heartbeat_s=2 * pg, rendezvous_s=4 * pg)


RECOVERY_MARGIN = 3.0
"""A recovery's waits last at least this many times the longest recovery measured so far:
a machine slow enough to take that long once will again."""


def windows(timeouts: Timeouts, longest_recovery_s: float) -> Timeouts:
    """The recovery waits for the step-time-derived ``timeouts`` and the recoveries seen."""
    rendezvous = max(timeouts.rendezvous_s, RECOVERY_MARGIN * longest_recovery_s)
    return dataclasses.replace(timeouts, rendezvous_s=rendezvous)


def widened(timeouts: Timeouts) -> Timeouts:
    """The waits of a retried recovery: twice as long (its last attempt was too short)."""
    return dataclasses.replace(timeouts, rendezvous_s=2 * timeouts.rendezvous_s)


class StepTimer:
    """Step times of the current layout: the first is warm-up; after ``steps`` more, the
    step time is their maximum (a conservative base for timeouts). The median of the last
    ``RECENT`` steps after warm-up is the typical step (what an estimator is fitted to);
    until one is measured, the warm-up step stands in for it: an upper bound (it carries
    one-time costs), where an unscaled model would take compute as nearly free and leave
    most survivors idle (soak seed 611463: a failure in step 2 kept one rank of seven)."""

    RECENT = 64

    def __init__(self, steps: int) -> None:
        if steps < 1:
            raise ValueError(f"timing steps={steps}: must be >= 1")
        self._steps = steps
        self._count = 0
        self._window: list[float] = []
        self._recent: collections.deque[float] = collections.deque(maxlen=self.RECENT)
        self._warm_up: float | None = None

    def record(self, seconds: float) -> None:
        self._count += 1
        if self._count == 1:
            self._warm_up = seconds
            return
        self._recent.append(seconds)
        if len(self._window) < self._steps:
            self._window.append(seconds)

    @property
    def step_time(self) -> float | None:
        return max(self._window) if len(self._window) == self._steps else None

    @property
    def typical(self) -> float | None:
        return statistics.median(self._recent) if self._recent else self._warm_up

    def reset(self) -> None:
        """A new layout: measure again."""
        self._count = 0
        self._window = []
        self._recent.clear()
        self._warm_up = None


_COMM_MARKERS = ("gloo", "nccl", "connection closed", "connection reset", "broken pipe",
                 "timed out", "socket", "peer")


def is_communication_error(exc: BaseException) -> bool:
    """True for the errors a peer's failure causes (a local bug, or an injected exception,
    is not one: that process must die and be announced)."""
    if isinstance(exc, dist.DistError):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc).lower() for m in _COMM_MARKERS)


def is_timeout(exc: BaseException) -> bool:
    """A communication error that is a wait running out (the peer may be only slow)."""
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text


PULSE_S = 1.0
"""The least time between two beats from inside a step (one store write each)."""


class FailureDetector:
    """The worker side of detection: beats, derives timeouts, reads announcements."""

    def __init__(self, job: JobStore, rank: int, ft: ResilienceConfig,
                 heartbeat: Heartbeat | None = None) -> None:
        """``heartbeat``: where this rank beats (default: its agent's folder)."""
        self._job = job
        self._ft = ft
        self._rank = rank
        self._heartbeat = heartbeat or Heartbeat.from_env(rank)
        self._timer = StepTimer(ft.timing_steps)
        self.timeouts = derive_timeouts(None, ft)
        self._log_timeouts(None, None)
        self.seen = 0
        """Failure announcements already handled."""
        self.seen_abandons = 0
        self._held_until = 0.0
        """Monotonic time up to which the last ``hold`` allows silence."""
        self._last_pulse = 0.0

    def beat(self, iteration: int | None = None) -> None:
        self._held_until = 0.0
        self._heartbeat.beat(self.timeouts.heartbeat_s, iteration)

    def hold(self, seconds: float) -> None:
        """Beat, allowing ``seconds`` of silence: before work that cannot beat (a checkpoint,
        a model rebuild, a recovery's blocking waits)."""
        self._held_until = time.monotonic() + seconds
        self._heartbeat.beat(max(seconds, self.timeouts.heartbeat_s))

    def pulse(self) -> None:
        """Beat from inside a step (each forward pass), at most once per ``PULSE_S``: a step
        that a loaded machine slows down past the heartbeat stays alive, a hung one stops
        pulsing. A hold in force is kept (its work may still block without beating)."""
        now = time.monotonic()
        if now - self._last_pulse < PULSE_S:
            return
        self._last_pulse = now
        self._heartbeat.beat(max(self.timeouts.heartbeat_s, self._held_until - now))

    @property
    def typical_step_time(self) -> float | None:
        """The median recent step time of the current layout (the warm-up step's before
        any other; None: none measured yet)."""
        return self._timer.typical

    def step_done(self, iteration: int, seconds: float) -> None:
        """Record a step; once the step time is known, apply the derived timeouts."""
        had = self._timer.step_time
        self._timer.record(seconds)
        if had is None and self._timer.step_time is not None:
            self.timeouts = derive_timeouts(self._timer.step_time, self._ft)
            n = groups.set_timeouts(self.timeouts.pg_s)
            self._log_timeouts(self._timer.step_time, n)
        self.beat(iteration)

    def _log_timeouts(self, step_time_s: float | None, groups_set: int | None) -> None:
        """The deadlines in force (a hang is found after ``heartbeat_s``): at start with the
        start-up timeout, then derived from the step time. Each rank derives its own; rank
        0's stands for the job in the log."""
        logger.log(logging.INFO if self._rank == 0 else logging.DEBUG, {
            "event": "timeouts", "rank": self._rank, "step_time_s": step_time_s,
            **dataclasses.asdict(self.timeouts), "groups": groups_set})

    def new_layout(self) -> None:
        """After a recovery: back to the start-up timeouts until steps are measured again."""
        self._timer.reset()
        self.timeouts = derive_timeouts(None, self._ft)
        self.beat()

    def new_failures(self) -> list[FailureRecord]:
        """Announcements not handled yet (non-blocking); marks them handled."""
        found = read_failures(self._job, self.seen)
        self.seen += len(found)
        return found

    def new_abandons(self) -> list[AbandonRecord]:
        """Abandoned steps not handled yet (non-blocking); marks them handled."""
        found = read_abandons(self._job, self.seen_abandons)
        self.seen_abandons += len(found)
        return found

    def wait_for_events(self, timeout_s: float, poll_s: float = 0.05) -> Events:
        """After a communication error: wait (beating, a hold in force kept) until a failure
        or an abandoned step is announced (empty after ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while True:
            events = Events(self.new_failures(), self.new_abandons())
            if events or time.monotonic() > deadline:
                return events
            self.pulse()
            time.sleep(poll_s)


@dataclass(frozen=True)
class Events:
    """What the announcements say happened."""

    failures: list[FailureRecord]
    abandons: list[AbandonRecord]

    def __bool__(self) -> bool:
        return bool(self.failures or self.abandons)

    @property
    def cause(self) -> str:
        """A failure if any rank failed, else the first abandon's reason."""
        return "failure" if self.failures else self.abandons[0].reason


class AbortWatcher:
    """A thread that interrupts this process's communication when a new failure or abandoned
    step is announced: an operation blocked on a peer that left (or died without its
    connections closing) otherwise waits for the group's full timeout. ``abort``:
    ``Teardown.interrupt`` (NCCL communicators aborted, then every connection but the job
    store's shut down), whose lock keeps it from interleaving with the main thread's
    ``Teardown.leave``.

    The main thread ``acknowledge``s the events it handles before it builds new groups, so
    that only later events (a failure during a recovery) interrupt those; a suspicion raised
    in the regroup itself is ``covered`` by the membership it produced. During a recovery
    attempt it also watches that attempt's retry key: a member whose attempt failed sets it,
    and the members still inside the attempt leave it; members already in a later attempt
    watch another key and are not disturbed.

    Until the main thread reports that it ``caught`` the interruption (or acknowledges),
    the watcher interrupts again every ``repeat_s``, and says once where the main thread is:
    a rank still blocked in its step would otherwise be killed as hung at its next heartbeat
    deadline, and a connection its peer closed first is shut down on the repeat too."""

    def __init__(self, job: JobStore, abort: Callable[[], int], period_s: float = 0.2,
                 repeat_s: float = 2.0) -> None:
        self._job = job
        self._abort = abort
        self._period = period_s
        self._repeat_s = repeat_s
        self._uncaught_since: float | None = None
        """Monotonic time of the last interruption the main thread has not caught yet."""
        self._repeats = 0
        self._seen = (0, 0)
        """(failures, abandoned steps) handled by the main thread."""
        self._retry_key: str | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="abort-watcher", daemon=True)
        self.aborted_at: float | None = None
        """When it last interrupted."""

    def start(self) -> AbortWatcher:
        self._seen = self._events()
        self._thread.start()
        return self

    def acknowledge(self, retry_key: str | None = None) -> None:
        """Every event announced so far is being handled: interrupt only for later ones,
        or once ``retry_key`` is set in the job store (returns once no interruption is in
        progress)."""
        with self._lock:
            self._seen = self._events()
            self._retry_key = retry_key
            self._uncaught_since = None

    def caught(self) -> None:
        """The main thread has left its step with the interruption's error (or is handling
        the events by itself): no repeat."""
        with self._lock:
            self._uncaught_since = None

    def covered(self, failures: int) -> None:
        """The first ``failures`` announced failures are handled too: the membership just
        agreed left them out (a rank suspected in the regroup among them). Noticed late, on a
        loaded machine, such a suspicion interrupted the groups built for that very
        membership, and a live member missed the retry's rendezvous."""
        with self._lock:
            self._seen = (max(self._seen[0], failures), self._seen[1])

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            try:
                self._tick()
            except dist.DistNetworkError as exc:  # the store is gone: nothing more to watch
                logger.warning("abort watcher: the job store is unreachable (%s): stopping", exc)
                return
            except Exception as exc:  # noqa: BLE001 - the watcher must outlive any one tick
                # e.g. the main thread destroyed a group meanwhile: the next tick tries again.
                logger.warning("abort watcher: %s: %s (retrying)", type(exc).__name__, exc)

    def _events(self) -> tuple[int, int]:
        return failure_count(self._job), abandon_count(self._job)

    def _tick(self) -> None:
        with self._lock:
            events = self._events()
            new = any(now > seen for now, seen in zip(events, self._seen))
            retry = self._retry_key is not None and self._job.store.check([self._retry_key])
            now = time.monotonic()
            repeat = not (new or retry) and self._uncaught_since is not None \
                and now - self._uncaught_since >= self._repeat_s
            if not (new or retry or repeat):
                return
            n = self._abort()
            if not repeat:
                self._seen = events
                self._retry_key = None
                self.aborted_at = time.time()
                self._repeats = 0
            # nothing interrupted: nothing of this process was blocked (a spare, say)
            self._uncaught_since = now if n or repeat else None
        if repeat:
            self._repeats += 1
            self._say_uncaught(n)
        else:  # every rank does this; the job's record comes from the controller
            logger.debug("failure announced: interrupted %d communicators or connections", n)

    def _say_uncaught(self, n: int) -> None:
        """Where an interruption did not reach: a warning with the main thread's stack the
        first time."""
        if self._repeats > 1:
            logger.debug("interrupted again (%d): %d communicators or connections",
                         self._repeats, n)
            return
        frame = sys._current_frames().get(threading.main_thread().ident)
        stack = "".join(traceback.format_stack(frame)) if frame is not None else "(unknown)\n"
        logger.warning("the main thread has not caught an interruption after %.1f s: "
                       "interrupted again (%d communicators or connections); it is at:\n%s",
                       self._repeat_s, n, stack.rstrip())
