"""Covering over-budget events with absence windows (pure, for the policy generator).

The problem: choose storages j (bytes s_j, absent on the event interval [o_j, p_j)) of
least total bytes so that at every event e the absent bytes reach the excess d(e).

* ``sweep_cover``: events left to right; at an event still short, take whole windows that
  reach furthest to the right first (they keep helping longest), then drop every window
  the others make redundant. O((n + E) log n); used when the exact solver would be slow.
* ``fractional_bound``: the same sweep allowed to take part of a window. With byte costs
  equal to byte coverage this greedy solves the linear relaxation exactly (the constraint
  matrix is an interval matrix), so it is a lower bound on the bytes any plan must swap.
* ``exact_cover``: the 0-1 program, solved by HiGHS (scipy) within a time limit.
"""

from __future__ import annotations

import heapq

import numpy as np
from scipy.sparse import coo_matrix

from chameleon_megatron.swap.windows import Windows, coverage


def _short_events(excess: np.ndarray) -> np.ndarray:
    return np.nonzero(excess > 0)[0]


def sweep_cover(windows: Windows, excess: np.ndarray) -> np.ndarray:
    """Boolean mask of a cover (every positive excess met), furthest-reaching first."""
    n = len(windows.uids)
    chosen = np.zeros(n, dtype=bool)
    by_start = np.argsort(windows.out_event, kind="stable")
    available: list[tuple[int, int]] = []  # (-prefetch event, j)
    active: list[tuple[int, int]] = []  # (prefetch event, j) of chosen windows
    covered, k = 0, 0
    for e in _short_events(excess):
        while k < n and windows.out_event[by_start[k]] <= e:
            j = int(by_start[k])
            heapq.heappush(available, (-int(windows.prefetch_event[j]), j))
            k += 1
        while active and active[0][0] <= e:
            covered -= int(windows.nbytes[heapq.heappop(active)[1]])
        while covered < excess[e] and available:
            neg_end, j = heapq.heappop(available)
            if -neg_end <= e:
                continue  # ended before this event
            chosen[j] = True
            covered += int(windows.nbytes[j])
            heapq.heappush(active, (-neg_end, j))
    return _drop_redundant(windows, excess, chosen)


def _drop_redundant(windows: Windows, excess: np.ndarray, chosen: np.ndarray) -> np.ndarray:
    """Unchoose windows whose bytes the others cover anyway, smallest first."""
    slack = coverage(windows.subset(chosen), len(excess)) - np.maximum(excess, 0)
    for j in np.argsort(windows.nbytes, kind="stable"):
        if not chosen[j]:
            continue
        o, p, s = windows.out_event[j], windows.prefetch_event[j], windows.nbytes[j]
        if slack[o:p].min(initial=s) >= s:
            chosen[j] = False
            slack[o:p] -= s
    return chosen


def fractional_bound(windows: Windows, excess: np.ndarray) -> float:
    """Least bytes of the linear relaxation (windows may be taken in part)."""
    return float(fractional_cover(windows, excess).sum())


def fractional_cover(windows: Windows, excess: np.ndarray) -> np.ndarray:
    """Bytes taken of each window by an optimal solution of the linear relaxation."""
    n = len(windows.uids)
    by_start = np.argsort(windows.out_event, kind="stable")
    used = np.zeros(n)
    available: list[tuple[int, int]] = []
    active: list[tuple[int, int]] = []
    covered, k = 0.0, 0
    for e in _short_events(excess):
        while k < n and windows.out_event[by_start[k]] <= e:
            j = int(by_start[k])
            heapq.heappush(available, (-int(windows.prefetch_event[j]), j))
            k += 1
        while active and active[0][0] <= e:
            covered -= used[heapq.heappop(active)[1]]
        while covered < excess[e] and available:
            neg_end, j = available[0]
            if -neg_end <= e:
                heapq.heappop(available)
                continue
            take = min(float(windows.nbytes[j]) - used[j], excess[e] - covered)
            if used[j] == 0:
                heapq.heappush(active, (-neg_end, j))
            used[j] += take
            covered += take
            if used[j] >= windows.nbytes[j]:
                heapq.heappop(available)
    return used


def exact_cover(windows: Windows, excess: np.ndarray,
                time_limit_s: float) -> tuple[np.ndarray | None, bool]:
    """(mask, proven optimal) from the 0-1 program; mask None when no cover was found."""
    from scipy.optimize import LinearConstraint, milp  # seconds to import: only when needed

    spans, need = _constraint_rows(windows, excess)
    if not spans:
        return np.zeros(len(windows.uids), dtype=bool), True
    scale = float(windows.nbytes.max())
    res = milp(
        c=windows.nbytes / scale,
        integrality=np.ones(len(windows.uids)),
        bounds=(0, 1),
        constraints=LinearConstraint(_cover_matrix(windows, spans).tocsr() / scale,
                                     lb=np.asarray(need) / scale),
        options={"time_limit": time_limit_s, "mip_rel_gap": 0.0},
    )
    if res.x is None:
        return None, False
    chosen = res.x > 0.5
    if not (coverage(windows.subset(chosen), len(excess)) >= excess).all():
        return None, False  # numerically short: let the sweep answer
    return chosen, res.status == 0


def cover_size(windows: Windows, excess: np.ndarray) -> int:
    """Non-zeros of the exact program's constraint matrix (its size)."""
    spans, _ = _constraint_rows(windows, excess)
    if not spans:
        return 0
    starts = np.array([lo for lo, _ in spans])
    first = np.searchsorted(starts, windows.out_event, side="left")
    return int((np.searchsorted(starts, windows.prefetch_event, side="left") - first).sum())


def _constraint_rows(windows: Windows,
                     excess: np.ndarray) -> tuple[list[tuple[int, int]], list[int]]:
    """Runs of events with one covering set, as (first, end) spans, and their largest excess."""
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
