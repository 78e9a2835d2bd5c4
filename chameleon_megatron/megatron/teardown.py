"""Leaving this process's groups after a failure: abort, interrupt, destroy, in that order,
one caller at a time.

Since torch 2.6, ``destroy_process_group`` shuts an NCCL group down by finalizing its
communicators, which waits for the work queued on them: behind a collective blocked on a
dead peer, for the group's whole timeout. And once one rank has aborted a communicator, its
peers must abort it too, not destroy it. So a rank leaving a failed world first aborts every
NCCL communicator (together: ``torch_seams.abort_together``); then it shuts its TCP
connections down, all but the job store's (``transport.close_connections``): in an NCCL job
too, since the plan's ``host`` ring, megatron's gloo data-parallel groups and the recovery
group run over gloo, where nothing else interrupts an operation blocked on a live peer; only
then does it destroy the groups. The abort watcher (a thread) interrupts through the same
``Teardown``, under its lock, so that its abort and the main thread's destroy never
interleave.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Protocol

import torch.distributed as dist

from chameleon_megatron.megatron import groups, torch_seams, transport

logger = logging.getLogger(__name__)


class GroupApi(Protocol):
    """What a teardown does to process groups: torch's (``TorchGroups``), or a stand-in."""

    def registered(self) -> list[Any]: ...

    def backend(self, group: Any) -> str: ...

    def abort(self, nccl_groups: list[Any]) -> int: ...

    def close_connections(self, keep_ports: set[int]) -> int: ...

    def destroy(self) -> None: ...


class TorchGroups:
    """torch.distributed's registered groups and this process's TCP connections."""

    def __init__(self, backend: str) -> None:
        if backend == "nccl":  # refused at start, not in the middle of a recovery
            torch_seams.check_abort()

    def registered(self) -> list[dist.ProcessGroup]:
        return torch_seams.registered_groups()

    def backend(self, group: dist.ProcessGroup) -> str:
        return dist.get_backend(group)

    def abort(self, nccl_groups: list[dist.ProcessGroup]) -> int:
        return torch_seams.abort_together(nccl_groups)

    def close_connections(self, keep_ports: set[int]) -> int:
        return transport.close_connections(keep_ports)

    def destroy(self) -> None:
        groups.destroy()


class Teardown:
    """The one way this process interrupts and leaves its groups after a failure.
    ``store_port``: the job store's, whose connections are kept (None: an in-process store;
    connections cannot be told apart, none is shut down)."""

    def __init__(self, backend: str, store_port: int | None, api: GroupApi | None = None) -> None:
        self._keep = None if store_port is None else {store_port}
        self._api: GroupApi = api if api is not None else TorchGroups(backend)
        self._lock = threading.Lock()

    def interrupt(self) -> int:
        """Make every operation blocked in this process's groups return now, with an error,
        here and on the peers at the other end (the abort watcher's call): NCCL
        communicators aborted, then connections shut down. Returns how many of both."""
        with self._lock:
            return self._interrupt()

    def leave(self) -> int:
        """Interrupt, then destroy megatron's groups and the world (a rank leaving a failed
        step or attempt). Returns how many communicators and connections it interrupted."""
        with self._lock:
            n = self._interrupt()
            self._api.destroy()
        return n

    def _interrupt(self) -> int:
        n = self._api.abort(self._nccl_groups())
        if self._keep is not None:
            n += self._api.close_connections(self._keep)
        return n

    def _nccl_groups(self) -> list[Any]:
        found = []
        for group in self._api.registered():
            try:
                if self._api.backend(group) == "nccl":
                    found.append(group)
            except (ValueError, RuntimeError):  # destroyed meanwhile, outside a teardown
                continue
        return found
