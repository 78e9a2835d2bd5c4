"""The smallest saved tensor worth swapping, from the profile (pure).

A copy costs a fixed overhead (launch, event, bookkeeping) beside its bytes, so a tensor
is worth a copy when moving it takes at least ``COPY_OVERHEAD_S`` at the link's bandwidth:
``bandwidth x COPY_OVERHEAD_S`` bytes (1 MB at 50 GB/s). When the tensors of that size or
more cannot meet the budget, the threshold comes down to the sizes actually present: the
largest size at which the budget becomes achievable, so that as few small copies as
possible are added.
"""

from __future__ import annotations

from chameleon_megatron.swap.policy import min_feasible_budget
from chameleon_megatron.swap.profile import StepProfile

COPY_OVERHEAD_S = 20e-6
"""Fixed cost of one copy (launch, event, bookkeeping) the bytes must outweigh."""


def bandwidth_threshold(bandwidth_bps: float) -> int:
    """Bytes whose copy takes ``COPY_OVERHEAD_S`` at ``bandwidth_bps``."""
    return max(int(bandwidth_bps * COPY_OVERHEAD_S), 1)


def smallest_worth_swapping(profile: StepProfile, *, budget_bytes: int,
                            bandwidth_bps: float) -> int:
    """The size threshold for plans of ``profile`` (see the module docstring); the smallest
    size present when even that cannot meet the budget."""
    ceiling = bandwidth_threshold(bandwidth_bps)
    if min_feasible_budget(profile, ceiling) <= budget_bytes:
        return ceiling
    sizes = sorted({r.nbytes for r in profile.records if r.swappable and 0 < r.nbytes < ceiling})
    if not sizes:
        return ceiling
    # Lowering the threshold only adds candidates, so feasibility holds below some size:
    # find the largest size at which it holds (the fewest small copies).
    lo, hi = 0, len(sizes) - 1
    if min_feasible_budget(profile, sizes[lo]) > budget_bytes:
        return sizes[lo]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if min_feasible_budget(profile, sizes[mid]) <= budget_bytes:
            lo = mid
        else:
            hi = mid - 1
    return sizes[lo]
