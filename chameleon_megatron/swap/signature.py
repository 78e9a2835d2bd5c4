"""Lightweight-mode profiler: a per-stage signature of the saved-tensor operator sequence.

Each stage keeps the sequence of (producing operator, dtype) codes of its saved tensors
and their bytes; the end of the step reduces them to a count, the bytes and a hash of the
ordered codes. Comparing two steps' signatures is a pure
function: a stage whose count or operator hash differs has changed, even when it has the
same number of operators in a different order or with different operators; a stage whose
bytes moved by more than a relative tolerance has changed size (sequence length). MoE
routing moves bytes between experts but keeps a layer's total, so it does not count.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

StageKey = tuple[str, int, int, int]
"""(phase 'F' or 'B', microbatch, model chunk, transformer layer number or -1 outside layers)."""


class StageStats:
    """Mutable accumulator of one stage in the current step (the hot path updates it)."""

    __slots__ = ("key", "codes", "nbytes", "occurrences")

    def __init__(self, key: StageKey) -> None:
        self.key = key
        self.codes: list[int] = []
        self.nbytes = 0
        self.occurrences: dict[tuple[int, int], int] = {}
        """Saved storages so far per (operator code, history), for matching."""

    def add(self, code: int, nbytes: int) -> None:
        """Account one saved tensor produced by operator ``code`` (called per pack)."""
        self.codes.append(code)  # hashed once at the end of the step: cheaper than rolling
        self.nbytes += nbytes

    def history(self) -> int:
        """The two most recent operator codes of the stage, packed in one int."""
        codes = self.codes
        return ((codes[-2] if len(codes) > 1 else 0) << 16) | (codes[-1] if codes else 0)

    def freeze(self) -> StageSignature:
        return StageSignature(count=len(self.codes), nbytes=self.nbytes,
                              digest=hash(tuple(self.codes)))


@dataclass(frozen=True)
class StageSignature:
    count: int
    """Saved tensors packed in the stage."""
    nbytes: int
    """Their storage bytes."""
    digest: int
    """Hash of the ordered (operator, dtype) codes (ints hash the same in every process)."""


@dataclass(frozen=True)
class StepSignature:
    stages: Mapping[StageKey, StageSignature]

    @staticmethod
    def of(stats: Mapping[StageKey, StageStats]) -> StepSignature:
        return StepSignature(MappingProxyType({k: s.freeze() for k, s in stats.items()}))


def changed_stages(reference: StepSignature, current: StepSignature,
                   size_tolerance: float) -> tuple[StageKey, ...]:
    """Stages whose operator sequence or size differs between two steps (sorted)."""
    keys = set(reference.stages) | set(current.stages)
    changed = []
    for key in keys:
        ref, cur = reference.stages.get(key), current.stages.get(key)
        if ref is None or cur is None or ref.count != cur.count or ref.digest != cur.digest:
            changed.append(key)
        elif abs(cur.nbytes - ref.nbytes) > size_tolerance * ref.nbytes:
            changed.append(key)
    return tuple(sorted(changed))
