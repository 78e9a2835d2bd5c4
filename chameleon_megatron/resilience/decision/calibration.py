"""Fit a profile's compute times to measured step times and report the estimator error.

The step model is monotone in a common scale of all compute times, so each measurement
pins one scale (by bisection: this inverts Eq. 9/11 with the communication terms kept);
the fitted scale minimises the squared relative errors over all measurements.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

from chameleon_megatron.resilience.decision.layout import Plan
from chameleon_megatron.resilience.decision.perf_model import plan_step
from chameleon_megatron.resilience.decision.profile import Profile


@dataclass(frozen=True)
class Observation:
    plan: Plan
    measured_s: float
    label: str = ""
    extra_microbatches: Mapping[tuple[int, int], int] = field(default_factory=dict)
    """(pipeline, stage) -> microbatches it ran for failed stages (a rerouted layout)."""


@dataclass(frozen=True)
class Calibration:
    profile: Profile
    """The input profile with compute times scaled by ``factor``."""
    factor: float
    rows: tuple[tuple[str, float, float, float], ...]
    """(label, measured s, estimated s, relative error) per observation."""

    @property
    def mean_abs_error(self) -> float:
        return sum(abs(r[3]) for r in self.rows) / len(self.rows)


def _estimate(profile: Profile, obs: Observation, factor: float) -> float:
    return plan_step(obs.plan, profile.with_times_scaled(factor), obs.extra_microbatches).t_step_s


def scale_for(profile: Profile, obs: Observation) -> float:
    """The compute-time scale at which the model predicts exactly ``obs.measured_s``."""
    floor = _estimate(profile, obs, 0.0)
    if obs.measured_s <= floor:
        raise ValueError(
            f"{obs.label or 'observation'}: measured {obs.measured_s:.4g}s is not above the "
            f"communication-only estimate {floor:.4g}s; check the profile's bandwidths"
        )
    lo, hi = 0.0, 1.0
    while _estimate(profile, obs, hi) < obs.measured_s:
        lo, hi = hi, hi * 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _estimate(profile, obs, mid) < obs.measured_s else (lo, mid)
    return (lo + hi) / 2


def calibrate(profile: Profile, observations: Sequence[Observation]) -> Calibration:
    if not observations:
        raise ValueError("calibration needs at least one measured step time")
    scales = [scale_for(profile, o) for o in observations]

    def loss(factor: float) -> float:
        return sum(((_estimate(profile, o, factor) - o.measured_s) / o.measured_s) ** 2
                   for o in observations)

    lo, hi = min(scales), max(scales)
    factor = lo if hi - lo <= 1e-12 * hi else float(
        _minimize_scalar()(loss, bounds=(lo, hi), method="bounded", options={"xatol": 1e-9 * hi}).x)
    rows = []
    for o in observations:
        est = _estimate(profile, o, factor)
        rows.append((o.label, o.measured_s, est, (est - o.measured_s) / o.measured_s))
    return Calibration(profile=profile.with_times_scaled(factor), factor=factor, rows=tuple(rows))


def _minimize_scalar():
    from scipy.optimize import minimize_scalar  # heavy: imported when needed

    return minimize_scalar
