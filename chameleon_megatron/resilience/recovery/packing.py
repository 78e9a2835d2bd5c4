"""Which tensors of a migration's wave travel as one message.

A message costs gloo about 20 us whatever its size, so a layer's norms and biases (a few KiB
each) cost more as messages than as copies. Within a wave the tensors going to (or coming
from) one peer with one dtype, each under ``PACK_BELOW``, travel packed into one contiguous
message; larger tensors and 0-dim ones go alone, as they are: packing them too trades a
message for two copies (pack and unpack), which cost as much on a host whose transport is
itself a copy (loopback TCP on two cores: ``docs/benchmarks.md``, *Migration against the
transport*).

``bundles`` is the only rule: both ends of a pair of ranks list the same tensors (the
receiver's wants, which the sender checked) in the same order, so they pack them the same
way and name each message by the tag of its first tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

PACK_BELOW = 64 * 2**10
"""Tensors of fewer bytes travel packed with their wave's others of the same peer and dtype."""


@dataclass(frozen=True)
class Item:
    """One tensor of a wave: the peer it goes to or comes from, and its own tag."""

    peer: int
    tag: int
    tensor: torch.Tensor


@dataclass(frozen=True)
class Bundle:
    """One message: a lone tensor, or several packed end to end (same peer, same dtype)."""

    peer: int
    tag: int
    tensors: tuple[torch.Tensor, ...]
    packed: bool

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


def packs(t: torch.Tensor) -> bool:
    return t.dim() > 0 and t.numel() * t.element_size() < PACK_BELOW


def bundles(items: Sequence[Item]) -> list[Bundle]:
    """The messages of ``items`` (in their order): the packable ones grouped by peer and
    dtype, each group one message tagged with its first item's tag; the rest alone."""
    out: list[Bundle] = []
    groups: dict[tuple[int, torch.dtype], list[Item]] = {}
    for item in items:
        if packs(item.tensor):
            groups.setdefault((item.peer, item.tensor.dtype), []).append(item)
        else:
            out.append(Bundle(item.peer, item.tag, (item.tensor,), packed=False))
    for (peer, _), group in groups.items():
        out.append(Bundle(peer, group[0].tag, tuple(i.tensor for i in group),
                          packed=len(group) > 1))
    return out


def laid_out(flat: torch.Tensor, tensors: Sequence[torch.Tensor]
             ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(view of ``flat``, tensor) for each of ``tensors``, end to end in ``flat``: where a
    packed message holds each of them, at both ends."""
    out, at = [], 0
    for t in tensors:
        out.append((flat[at:at + t.numel()].view(t.shape), t))
        at += t.numel()
    return out


class Pool:
    """Host memory for one migration's packed messages, each buffer reused once its wave
    has landed: packing into fresh memory costs a page fault per page, which made the pack
    as slow as the transport. Holds about what two waves in flight pack."""

    def __init__(self, *, pinned: bool) -> None:
        self.pinned = pinned
        self._free: list[torch.Tensor] = []
        self._lent: dict[int, torch.Tensor] = {}

    def take(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """``numel`` elements of ``dtype``: the front of a free buffer where one fits, else
        a new one (a free one of the dtype too small for it is dropped)."""
        fits = [b for b in self._free if b.dtype == dtype and b.numel() >= numel]
        if fits:
            buf = min(fits, key=torch.Tensor.numel)
            self._free = [b for b in self._free if b is not buf]
        else:
            self._free = [b for b in self._free if b.dtype != dtype]
            buf = torch.empty(numel + numel // 8, dtype=dtype, pin_memory=self.pinned)
        self._lent[buf.data_ptr()] = buf
        return buf[:numel]

    def give(self, views: Sequence[torch.Tensor]) -> None:
        """What ``take`` returned is free again."""
        self._free += [self._lent.pop(v.data_ptr()) for v in views]
