"""A recording stand-in for the process-group API a ``Teardown`` drives (``GroupApi``)."""

from __future__ import annotations

import threading
from typing import Any


class RecordingGroups:
    """Groups by name with their backend; every call is logged, in order, with the name of
    the thread that made it. ``hold_first_abort``: the first abort waits until ``release``
    is set (``entered`` tells it has started), to catch a call slipping in meanwhile."""

    def __init__(self, backends: dict[str, str], *, hold_first_abort: bool = False) -> None:
        self.backends = dict(backends)
        self.log: list[tuple[Any, ...]] = []
        self.entered = threading.Event()
        self.release = threading.Event()
        if not hold_first_abort:
            self.release.set()

    def calls(self) -> list[tuple[Any, ...]]:
        """The log without thread names."""
        return [entry[1:] for entry in self.log]

    def _record(self, *entry: Any) -> None:
        self.log.append((threading.current_thread().name, *entry))

    def registered(self) -> list[str]:
        return list(self.backends)

    def backend(self, group: str) -> str:
        return self.backends[group]

    def abort(self, nccl_groups: list[str]) -> int:
        self._record("abort", tuple(nccl_groups))
        self.entered.set()
        self.release.wait(10)
        self._record("aborted")
        return len(nccl_groups)

    def close_connections(self, keep_ports: set[int]) -> int:
        self._record("close", frozenset(keep_ports))
        return 1

    def destroy(self) -> None:
        self._record("destroy")
        self.backends.clear()
