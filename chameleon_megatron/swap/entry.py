"""Executor bookkeeping: one ``Entry`` per saved storage, one ``Handle`` per saved tensor.

A ``Handle`` is what autograd keeps. When the last handle of an entry dies (after its
backward, or with a recompute graph that is never run) the owner is told, so nothing
leaks. ``__del__`` does that instead of ``weakref.finalize``: the same guarantee at a
seventh of the cost per saved tensor.
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol

import torch

RESIDENT, OUT, SWAPPED, IN, BACK = range(5)
"""Entry states: on device as packed; copy out in flight (device copy still held); on host
only; copy back in flight; back on device."""


class Owner(Protocol):
    def release(self, entry: Entry) -> None: ...


class Entry:
    """One saved storage and every saved tensor on it."""

    __slots__ = ("owner", "key", "ref", "device", "nbytes", "eligible", "tensors", "views",
                 "data", "host", "token", "state", "uid", "rec", "refs", "used", "released")

    def __init__(self, owner: Owner, key: int, storage: Any, t: torch.Tensor,
                 nbytes: int, eligible: bool) -> None:
        self.owner = owner
        self.key = key
        self.ref = weakref.ref(storage)
        self.device = t.device
        self.nbytes = nbytes
        self.eligible = eligible
        self.tensors: list[torch.Tensor] | None = [t]
        self.views: list[tuple] | None = None
        self.data: torch.Tensor | None = None
        self.host: torch.Tensor | None = None
        self.token: Any = None
        self.state = RESIDENT
        self.uid = -1
        self.rec = -1
        self.refs = 0
        self.used = False
        self.released = False


class Handle:
    """What autograd stores for one saved tensor: its entry and its index there."""

    __slots__ = ("entry", "index")

    def __init__(self, entry: Entry, index: int) -> None:
        self.entry = entry
        self.index = index
        entry.refs += 1

    def __del__(self) -> None:
        entry = self.entry
        entry.refs -= 1
        if entry.refs == 0:
            entry.owner.release(entry)


def view_of(t: torch.Tensor) -> tuple:
    """What it takes to rebuild ``t`` on a copy of its storage."""
    return (t.dtype, t.size(), t.stride(), t.storage_offset())


def rebuild(data: torch.Tensor, view: tuple) -> torch.Tensor:
    """The tensor ``view`` describes, on the storage of ``data`` (same layout, same bits)."""
    dtype, size, stride, offset = view
    return torch.empty(0, dtype=dtype, device=data.device).set_(
        data.untyped_storage(), offset, size, stride)


def bytes_of(t: torch.Tensor) -> torch.Tensor:
    """Flat byte view of the whole storage under ``t``."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
