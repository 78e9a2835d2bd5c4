"""Candidates for likely failures, computed at start-up so a failure costs a lookup.

Entries are keyed by the set of broken TP groups and computed as if every rank of those
groups had died; sources of transfers are then alive whichever of their ranks actually
failed, so one entry serves every dead-rank set that breaks the same groups. (A fresh
``make_candidates`` with the exact dead ranks may also use the live partners of a dead
rank as sources.)
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from chameleon_megatron.resilience.decision.candidates import (
    Candidates,
    broken_units,
    make_candidates,
)
from chameleon_megatron.resilience.decision.layout import Plan
from chameleon_megatron.resilience.decision.planner import Planner


@dataclass(frozen=True)
class PlanCache:
    current: Plan
    units: tuple[tuple[int, ...], ...]
    entries: dict[frozenset[int], Candidates] = field(hash=False)
    build_s: float

    @classmethod
    def build(cls, current: Plan, planner: Planner, *,
              units: Sequence[tuple[int, ...]] | None = None,
              pairs: bool = False) -> "PlanCache":
        """Precompute every single broken TP group (and every pair if ``pairs``)."""
        start = time.perf_counter()
        groups = tuple(units) if units is not None else tuple(
            st.ranks for p in current.pipelines for st in p.stages)
        keys: Iterable[tuple[int, ...]] = [(k,) for k in range(len(groups))]
        if pairs:
            keys = itertools.chain(keys, itertools.combinations(range(len(groups)), 2))
        entries = {
            frozenset(key): make_candidates(current, [r for k in key for r in groups[k]],
                                            planner, groups)
            for key in keys
        }
        return cls(current=current, units=groups, entries=entries,
                   build_s=time.perf_counter() - start)

    def lookup(self, dead_ranks: Iterable[int]) -> Candidates | None:
        """The precomputed candidates for these dead ranks, or None when not cached."""
        return self.entries.get(frozenset(broken_units(self.units, set(dead_ranks))))
