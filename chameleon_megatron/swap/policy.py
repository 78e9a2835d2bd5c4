"""Policy generator (pure): which saved storages to swap, and when to bring each back.

Given a full profile, a budget of resident saved bytes, the copy bandwidth and a size
threshold, choose the set of storages of minimum total bytes whose absence windows
(``windows.py``) bring the resident bytes within the budget at every event. That is a
covering problem with one constraint per over-budget event; it is solved exactly as a
0-1 integer program (HiGHS through scipy), with a greedy cover when the solver runs out
of time. Rows between two consecutive window edges share their covering set, so only the
largest excess of each such run is kept.

When no choice meets the budget with copies that fit in the compute they overlap, the
widest windows (copies assumed instant) are used and the plan states the stall the
copies will cost; when even those cannot meet it, ``BudgetError`` says the least budget
that can.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.sparse import coo_matrix

from chameleon_megatron.swap.profile import StepProfile
from chameleon_megatron.swap.stall import expected_stall
from chameleon_megatron.swap.windows import Windows, candidate_windows, coverage, resident_curve


class BudgetError(ValueError):
    """The budget cannot be met whatever is swapped."""


@dataclass(frozen=True)
class SwapDecision:
    uid: int
    """Record swapped out at its pack."""
    nbytes: int
    out_event: int
    """First event at which it is planned to be off the device."""
    prefetch_event: int
    """Event at which its copy back starts (a pack or first use of ``prefetch_anchor``)."""
    prefetch_anchor: tuple[int, int]
    """(record uid, event kind) of ``prefetch_event``: what the executor waits for."""


@dataclass(frozen=True)
class Plan:
    budget_bytes: int
    bandwidth_bps: float
    decisions: tuple[SwapDecision, ...]
    no_swap_peak_bytes: int
    """Peak resident saved bytes of the profiled step without swapping."""
    planned_peak_bytes: int
    """Peak resident saved bytes with this plan (<= budget)."""
    min_budget_bytes: int
    """Least budget any plan could meet on this profile."""
    expected_stall_s: float
    """Compute time the copies are expected to stall per step (0: fully overlapped)."""
    optimal: bool
    """Whether the swapped bytes are proven minimal."""

    @property
    def planned_out_bytes(self) -> int:
        return sum(d.nbytes for d in self.decisions)


def min_feasible_budget(profile: StepProfile, min_bytes: int) -> int:
    """Least budget any choice meets (copies assumed instant)."""
    widest = candidate_windows(profile, min_bytes, float("inf"))
    left = resident_curve(profile) - coverage(widest, profile.num_events)
    return int(left.max(initial=0))


def generate_plan(profile: StepProfile, *, budget_bytes: int, bandwidth_bps: float,
                  min_bytes: int, time_limit_s: float = 5.0) -> Plan:
    """The plan of minimum swapped bytes that keeps resident saved bytes within budget."""
    if budget_bytes <= 0 or bandwidth_bps <= 0:
        raise ValueError(f"budget_bytes={budget_bytes} and bandwidth_bps={bandwidth_bps} "
                         "must be > 0")
    resident = resident_curve(profile)
    floor = min_feasible_budget(profile, min_bytes)
    if budget_bytes < floor:
        raise BudgetError(
            f"swap budget {budget_bytes} bytes is below the least achievable {floor} bytes "
            f"(peak without swap {int(resident.max(initial=0))}; the rest is held by tensors "
            f"that cannot be swapped: below min_tensor_bytes={min_bytes}, parameters, or "
            "unused in backward); raise the budget or lower swap.min_tensor_bytes")
    windows = candidate_windows(profile, min_bytes, bandwidth_bps)
    if (resident - coverage(windows, profile.num_events) > budget_bytes).any():
        windows = candidate_windows(profile, min_bytes, float("inf"))
    chosen, optimal = _choose(windows, resident - budget_bytes, time_limit_s)
    picked = windows.subset(chosen)
    decisions = tuple(
        SwapDecision(uid=int(u), nbytes=int(b), out_event=int(o), prefetch_event=int(p),
                     prefetch_anchor=profile.events[int(p)])
        for u, b, o, p in zip(picked.uids, picked.nbytes, picked.out_event,
                              picked.prefetch_event)
    )
    planned = resident - coverage(picked, profile.num_events)
    return Plan(
        budget_bytes=budget_bytes, bandwidth_bps=bandwidth_bps, decisions=decisions,
        no_swap_peak_bytes=int(resident.max(initial=0)),
        planned_peak_bytes=int(planned.max(initial=0)), min_budget_bytes=floor,
        expected_stall_s=expected_stall(profile, picked, bandwidth_bps), optimal=optimal,
    )


def _choose(windows: Windows, excess: np.ndarray, time_limit_s: float) -> tuple[np.ndarray, bool]:
    """Boolean mask over ``windows``: the least bytes covering every positive excess."""
    rows, need = _constraint_rows(windows, excess)
    if not rows:
        return np.zeros(len(windows.uids), dtype=bool), True
    from scipy.optimize import LinearConstraint, milp  # seconds to import: only when needed

    coo = _cover_matrix(windows, rows)
    scale = float(windows.nbytes.max())
    res = milp(
        c=windows.nbytes / scale,
        integrality=np.ones(len(windows.uids)),
        bounds=(0, 1),
        constraints=LinearConstraint(coo.tocsr() / scale, lb=np.asarray(need) / scale),
        options={"time_limit": time_limit_s, "mip_rel_gap": 0.0},
    )
    if res.x is not None:
        chosen = res.x > 0.5
        if _covers(windows, chosen, excess):
            return chosen, res.status == 0
    return _greedy_cover(windows, excess), False


def _constraint_rows(windows: Windows, excess: np.ndarray) -> tuple[list[tuple[int, int]], list[int]]:
    """Runs of events with one covering set, as (first, last) spans, and their largest excess."""
    edges = np.unique(np.concatenate([[0, len(excess)], windows.out_event,
                                      windows.prefetch_event]))
    spans, need = [], []
    for lo, hi in zip(edges[:-1], edges[1:]):
        worst = int(excess[lo:hi].max(initial=0))
        if worst > 0:
            spans.append((int(lo), int(hi)))
            need.append(worst)
    return spans, need


def _cover_matrix(windows: Windows, spans: list[tuple[int, int]]) -> coo_matrix:
    """Row i, column j is the bytes of j when j's window contains span i."""
    starts = np.array([lo for lo, _ in spans])
    first = np.searchsorted(starts, windows.out_event, side="left")
    counts = np.searchsorted(starts, windows.prefetch_event, side="left") - first
    cols = np.repeat(np.arange(len(counts)), counts)
    # Element k of column j sits in row first[j] + (k - index of j's first element).
    rows = np.arange(counts.sum()) + np.repeat(first - np.cumsum(counts) + counts, counts)
    return coo_matrix((windows.nbytes[cols].astype(float), (rows, cols)),
                      shape=(len(spans), len(counts)))


def _covers(windows: Windows, chosen: np.ndarray, excess: np.ndarray) -> bool:
    return bool((coverage(windows.subset(chosen), len(excess)) >= excess).all())


def _greedy_cover(windows: Windows, excess: np.ndarray) -> np.ndarray:
    """Largest first until covered, then drop what became redundant (smallest first)."""
    chosen = np.zeros(len(windows.uids), dtype=bool)
    for j in np.argsort(-windows.nbytes, kind="stable"):
        if _covers(windows, chosen, excess):
            break
        chosen[j] = True
    for j in np.argsort(windows.nbytes, kind="stable"):
        if chosen[j]:
            chosen[j] = False
            if not _covers(windows, chosen, excess):
                chosen[j] = True
    return chosen
