"""D of Eq. 8: the expected time until the job's next failure.

Failures are taken as a Poisson process. A prior MTBF counts as ``prior_weight`` failures
observed over ``prior_weight x prior_s`` seconds; the job's own history adds its failures
and its exposure time (the current, still open interval included), so
D = (w x prior + exposure) / (w + failures): the prior for a young job, the observed
rate once failures accumulate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True, kw_only=True)
class MtbfEstimator:
    prior_s: float
    """Prior mean time between failures of the job."""
    prior_weight: float = 1.0
    """How many observed failures the prior is worth."""

    def __post_init__(self) -> None:
        if not self.prior_s > 0:
            raise ValueError(f"prior_s={self.prior_s}: must be > 0")
        if not self.prior_weight > 0:
            raise ValueError(f"prior_weight={self.prior_weight}: must be > 0")

    def expected_s(self, failure_times: Sequence[float], now_s: float,
                   start_s: float = 0.0) -> float:
        """D at ``now_s`` for a job started at ``start_s`` with failures at ``failure_times``."""
        if now_s < start_s:
            raise ValueError(f"now_s={now_s} is before start_s={start_s}")
        for t in failure_times:
            if not start_s <= t <= now_s:
                raise ValueError(f"failure time {t} is outside [{start_s}, {now_s}]")
        exposure = now_s - start_s
        weight = self.prior_weight
        return (weight * self.prior_s + exposure) / (weight + len(failure_times))
