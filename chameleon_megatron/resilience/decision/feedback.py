"""Estimator feedback: after each recovery, the measured step time of the layout now trained
is compared with the decision center's estimate, and the performance model is recalibrated
on every layout measured so far, so the next decision estimates from what this job really
does (issue item 4).

``Feedback`` is the one place that keeps measurements (passed explicitly, no globals): the
controller calls ``start`` when a layout begins (after a recovery, with the estimate the
decision used), ``step`` after every training step, and calibrates the next decision's
profile on ``observations()`` (``live_profile``). Each layout yields one
``{"event": "estimator", ...}`` record once enough steps are measured.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from chameleon_megatron.resilience.decision.calibration import Observation
from chameleon_megatron.resilience.decision.layout import Plan
from chameleon_megatron.resilience.decision.reroute import ReroutePlan


@dataclass
class _Layout:
    label: str
    plan: Plan
    estimated_s: float
    reroute: ReroutePlan | None
    times: list[float] = field(default_factory=list)


class Feedback:
    """Measured step times per layout, their error against the estimate, the calibration.

    ``warmup``: first steps of each layout left out (the first step after a rebuild pays
    one-off costs); ``window``: steps whose median is the layout's measured step time.
    """

    def __init__(self, *, warmup: int = 1, window: int = 5) -> None:
        if warmup < 0 or window < 1:
            raise ValueError(f"warmup={warmup} must be >= 0 and window={window} >= 1")
        self.warmup, self.window = warmup, window
        self._layouts: list[_Layout] = []

    def start(self, label: str, plan: Plan, estimated_s: float,
              reroute: ReroutePlan | None = None) -> None:
        """A layout begins; ``estimated_s``: the step time the decision center expected."""
        if not estimated_s > 0:
            raise ValueError(f"estimated_s={estimated_s}: must be > 0")
        if reroute is not None and reroute.plan != plan:
            raise ValueError("the rerouting plan is for another plan than the one given")
        self._layouts.append(_Layout(label, plan, estimated_s, reroute))

    def step(self, seconds: float) -> dict[str, Any] | None:
        """Record one step of the current layout; returns its feedback record when the
        window is complete (once per layout), else None."""
        if not self._layouts:
            raise ValueError("no layout started: call start() first")
        current = self._layouts[-1]
        current.times.append(seconds)
        if len(current.times) != self.warmup + self.window:
            return None
        return self._record(current)

    def _record(self, layout: _Layout) -> dict[str, Any]:
        measured = self._measured(layout)
        return {"event": "estimator", "label": layout.label, "plan": layout.plan.describe(),
                "rerouted": layout.reroute is not None, "estimated_s": layout.estimated_s,
                "measured_s": measured,
                "error": (layout.estimated_s - measured) / measured,
                "steps": self.window}

    def _measured(self, layout: _Layout) -> float:
        return statistics.median(layout.times[self.warmup:self.warmup + self.window])

    def observations(self) -> list[Observation]:
        """Every layout measured over a whole window (rerouted ones with their extra
        microbatches), for calibrating the performance model."""
        return [Observation(x.plan, self._measured(x), x.label,
                            x.reroute.extra_microbatches() if x.reroute else {})
                for x in self._layouts if len(x.times) >= self.warmup + self.window]
