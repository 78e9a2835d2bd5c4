"""Waits in the job store that a recovery attempt can leave at once.

A member blocked in the store's own ``wait`` (or in a C++ rendezvous that waits there, such
as building a gloo group) sits out its whole timeout after the others have left the attempt,
and then meets them a generation late. These waits poll instead, and give up as soon as the
attempt is abandoned (a member set its retry key, or a new failure was announced); a
``barrier`` before a C++ rendezvous makes every member enter it together, so that nobody
waits there for a member that already left.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import torch.distributed as dist


class Abandoned(RuntimeError):
    """The recovery attempt this wait belongs to was abandoned: leave it and retry."""


def wait_keys(store: dist.Store, keys: Sequence[str], *, timeout_s: float,
              abandoned: Callable[[], bool], on_wait: Callable[[], None] = lambda: None,
              poll_s: float = 0.05) -> None:
    """Return once every key of ``keys`` is set; Abandoned when ``abandoned()`` says so
    first, TimeoutError after ``timeout_s``. The polls start 1 ms apart and slow down to
    ``poll_s``: most waits of a recovery end within milliseconds."""
    deadline = time.monotonic() + timeout_s
    pause = min(0.001, poll_s)
    while not store.check(list(keys)):
        if abandoned():
            raise Abandoned(f"left the wait for {list(keys)[:3]}: the attempt was abandoned")
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s:.1f} s for {list(keys)[:3]} in the job store")
        on_wait()
        time.sleep(pause)
        pause = min(2 * pause, poll_s)


def barrier(store: dist.Store, name: str, me: int, members: Sequence[int], *,
            timeout_s: float, abandoned: Callable[[], bool],
            on_wait: Callable[[], None] = lambda: None) -> None:
    """Every member of ``members`` reached ``name`` (``store``: the attempt's scope)."""
    store.set(f"at/{name}/{me}", "1")
    wait_keys(store, [f"at/{name}/{r}" for r in members], timeout_s=timeout_s,
              abandoned=abandoned, on_wait=on_wait)
