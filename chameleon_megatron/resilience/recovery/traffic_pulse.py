"""Beats while this process's connections to its peers carry data: a step that a slow link
stretches past the heartbeat window is not taken for a hang.

Each wait inside a gloo collective is bounded by the group timeout, but a collective made of
many waits is not: with 2 s of delay on one host's link every wait ends in time while a step
takes 8-12 s against a 10 s heartbeat window, most of it in the gradient all-reduce, with no
forward pass to beat from. Bytes acknowledged or received on the process's connections (the
job store's excepted: its watcher polls it whether or not training advances) are proof that
the communication in progress advances; a hung training thread issues none, so its beats
stop within one exchange of the hang and the agent declares it after the heartbeat window
as before. NCCL is covered by its own watchdog (a whole collective is bounded by the group
timeout), so only its socket transport shows up here.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Mapping

from chameleon_megatron.megatron import transport

logger = logging.getLogger(__name__)


def advanced(before: Mapping[int, int], after: Mapping[int, int]) -> bool:
    """Whether any connection carried data between two readings (a new one with data
    counts; one that closed does not)."""
    return any(moved > before.get(conn, 0) for conn, moved in after.items())


class TrafficPulse:
    """A thread that calls ``pulse`` each ``period_s`` in which a connection other than the
    job store's (``store_port``; None: an in-process store, whose traffic cannot be told
    apart, so the thread never starts) carried data."""

    def __init__(self, pulse: Callable[[], None], store_port: int | None, period_s: float = 1.0,
                 read: Callable[[set[int]], dict[int, int]] = transport.bytes_moved) -> None:
        self._pulse = pulse
        self._keep = None if store_port is None else {store_port}
        self._period = period_s
        self._read = read
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="traffic-pulse", daemon=True)

    def start(self) -> TrafficPulse:
        if self._keep is not None:
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        assert self._keep is not None
        last = self._read(self._keep)
        while not self._stop.wait(self._period):
            try:
                now = self._read(self._keep)
                if advanced(last, now):
                    self._pulse()
                last = now
            except Exception as exc:  # noqa: BLE001 - a failed beat ends the beats, not the worker
                logger.warning("traffic pulse: %s: %s (stopping)", type(exc).__name__, exc)
                return
