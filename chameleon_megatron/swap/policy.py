"""Policy generator (pure): which saved storages to swap, and when to bring each back.

Given a full profile, a budget of resident saved bytes, the copy bandwidth and a size
threshold, choose the set of storages of minimum total bytes whose absence windows
(``windows.py``) bring the resident bytes within the budget at every event: a covering
problem with one constraint per over-budget event (``cover.py``). A sweep that takes the
furthest-reaching windows first answers in milliseconds, and its linear relaxation, solved
exactly by the same sweep, bounds the optimum from below; when the two differ and the
problem is small, the exact 0-1 program (HiGHS through scipy) decides. On profiles of
real steps the sweep lands within 1 % of the bound (docs/benchmarks.md, Swap).

When no choice meets the budget with copies that fit in the compute they overlap, the
widest windows (copies assumed instant) are used and the plan states the stall the
copies will cost; when even those cannot meet it, ``BudgetError`` says the least budget
that can.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from chameleon_megatron.swap.cover import (
    cover_size,
    exact_cover,
    fractional_bound,
    sweep_cover,
)
from chameleon_megatron.swap.profile import StepProfile
from chameleon_megatron.swap.stall import expected_stall
from chameleon_megatron.swap.windows import Windows, candidate_windows, coverage, resident_curve

EXACT_NONZEROS = 50_000
"""Largest exact program (non-zeros of its constraint matrix) worth handing to the solver."""


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
class SwapPolicy:
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
    lower_bound_bytes: int
    """No plan on these windows swaps fewer bytes (the linear relaxation's optimum)."""
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


def generate_policy(profile: StepProfile, *, budget_bytes: int, bandwidth_bps: float,
                    min_bytes: int, time_limit_s: float = 5.0) -> SwapPolicy:
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
    chosen, bound, optimal = _choose(windows, resident - budget_bytes, time_limit_s)
    picked = windows.subset(chosen)
    decisions = tuple(
        SwapDecision(uid=int(u), nbytes=int(b), out_event=int(o), prefetch_event=int(p),
                     prefetch_anchor=profile.events[int(p)])
        for u, b, o, p in zip(picked.uids, picked.nbytes, picked.out_event,
                              picked.prefetch_event)
    )
    planned = resident - coverage(picked, profile.num_events)
    return SwapPolicy(
        budget_bytes=budget_bytes, bandwidth_bps=bandwidth_bps, decisions=decisions,
        no_swap_peak_bytes=int(resident.max(initial=0)),
        planned_peak_bytes=int(planned.max(initial=0)), min_budget_bytes=floor,
        expected_stall_s=expected_stall(profile, picked, bandwidth_bps),
        lower_bound_bytes=bound, optimal=optimal,
    )


def _choose(windows: Windows, excess: np.ndarray,
            time_limit_s: float) -> tuple[np.ndarray, int, bool]:
    """(mask over ``windows``, lower bound on swapped bytes, proven optimal)."""
    chosen = sweep_cover(windows, excess)
    bound = math.ceil(fractional_bound(windows, excess) - 1e-6)
    best = int(windows.nbytes[chosen].sum())
    if best <= bound:
        return chosen, bound, True
    if cover_size(windows, excess) <= EXACT_NONZEROS:
        exact, optimal = exact_cover(windows, excess, time_limit_s)
        if exact is not None and int(windows.nbytes[exact].sum()) <= best:
            return exact, bound, optimal
    return chosen, bound, False
