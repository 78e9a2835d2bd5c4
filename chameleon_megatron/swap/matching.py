"""Multi-feature fuzzy matching of live saved tensors to profile records.

Eager tensors have no stable identity across steps, so a live tensor is recognised by
features: its stage, producing operator and dtype, the two operators saved before it,
its position in the stage and its size class. Two lookups, strict first:

1. stage + position + operator + size class: the same sequence as profiled;
2. stage + operator + history + occurrence: position and size ignored, so a tensor is
   still found when other tensors were inserted before it or when sizes changed
   (sequence length, MoE routing).

A miss leaves the tensor unswapped, which is always safe: each swapped tensor carries its
own copy, so matching decides only *whether* to swap, never *what* is restored.
"""

from __future__ import annotations

from typing import Iterable

from chameleon_megatron.swap.profile import TensorRecord
from chameleon_megatron.swap.signature import StageKey


def size_class(nbytes: int) -> int:
    """Power-of-two bucket of a size."""
    return nbytes.bit_length()


class MatchIndex:
    """Lookup tables over one profile's records (built once per plan)."""

    def __init__(self, records: Iterable[TensorRecord]) -> None:
        self._strict: dict[tuple, int] = {}
        self._loose: dict[tuple, int] = {}
        for r in records:
            self._strict[(r.stage, r.ordinal, r.code, size_class(r.nbytes))] = r.uid
            self._loose[(r.stage, r.code, r.history, r.occurrence)] = r.uid

    def match(self, stage: StageKey, ordinal: int, code: int, nbytes: int, history: int,
              occurrence: int) -> int:
        """uid of the record these features identify, or -1."""
        uid = self._strict.get((stage, ordinal, code, nbytes.bit_length()))
        if uid is None:
            uid = self._loose.get((stage, code, history, occurrence), -1)
        return uid
