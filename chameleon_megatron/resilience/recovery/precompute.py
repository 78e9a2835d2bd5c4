"""One background thread that builds a value off the training thread: the latest request
wins, the result is handed over under a lock, and a build is abandoned (between two of its
pieces) as soon as it is superseded, cancelled or stopped.

A pure-Python build holds the interpreter lock while it computes, which delays the training
thread's own Python (each operation it launches); so after each piece the thread sleeps
``yield_ratio`` times as long as the piece took: the build takes at most 1 / (1 +
``yield_ratio``) of the interpreter's time (a half by default)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Generic, TypeVar

logger = logging.getLogger(__name__)

K = TypeVar("K")
V = TypeVar("V")

Build = Callable[[Callable[[], bool]], "V | None"]
"""Builds the value; polls its argument (True: give up) between pieces of work."""


class Precomputer(Generic[K, V]):
    """Builds ``(key, value)`` in a daemon thread, started by the first request."""

    def __init__(self, name: str = "precompute", *, yield_ratio: float = 1.0) -> None:
        if yield_ratio < 0:
            raise ValueError(f"yield_ratio={yield_ratio}: must be >= 0")
        self._name = name
        self._yield_ratio = yield_ratio
        self._cond = threading.Condition()
        self._wanted: tuple[int, K, Build] | None = None
        self._ready: tuple[K, V] | None = None
        self._version = 0
        self._stopping = False
        self._thread: threading.Thread | None = None

    def request(self, key: K, build: Build) -> None:
        """Build the value of ``key`` next, abandoning a build in progress."""
        with self._cond:
            if self._stopping:
                return
            self._version += 1
            self._wanted = (self._version, key, build)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify()

    def ready(self) -> tuple[K, V] | None:
        """The last value built to the end, with its key (None: none yet)."""
        with self._cond:
            return self._ready

    def cancel(self) -> None:
        """Abandon the build in progress and any pending request (the ready value stays):
        a recovery starts and needs the processor."""
        with self._cond:
            self._version += 1
            self._wanted = None

    def stop(self) -> None:
        """Cancel and end the thread (waits for the piece of work in progress)."""
        with self._cond:
            self._stopping = True
            self._version += 1
            self._wanted = None
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _pacer(self, gone: Callable[[], bool]) -> Callable[[], bool]:
        """``gone``, polled between pieces, after a pause in proportion to the last piece."""
        last = [time.perf_counter()]

        def poll() -> bool:
            if not gone():
                time.sleep((time.perf_counter() - last[0]) * self._yield_ratio)
            last[0] = time.perf_counter()
            return gone()
        return poll

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._wanted is None and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                version, key, build = self._wanted
                self._wanted = None
            gone = lambda v=version: self._version != v  # noqa: E731
            try:
                value = build(self._pacer(gone))
            except Exception:  # noqa: BLE001 - the caller computes fresh; the thread lives on
                logger.exception("%s: building %r failed", self._name, key)
                continue
            with self._cond:
                if value is not None and not gone():
                    self._ready = (key, value)
            logger.debug("%s: %r %s", self._name, key,
                         "abandoned" if value is None or gone() else "ready")
