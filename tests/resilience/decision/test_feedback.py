"""Estimator feedback: measured steps against the estimate, and the recalibrated model.

Oracle by hand: 4 layers of forward 1 s + backward 2 s, no embedding/output cost, free
communication. One pipeline of depth 1 with 8 microbatches takes (1 + 8 - 1) x 12 = 96 s
(Eq. 9); DP2 of depth 2 with 4 microbatches each takes (2 + 4 - 1) x 6 = 30 s.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dc_helpers import make_profile  # noqa: E402

from chameleon_megatron.resilience.decision.calibration import calibrate  # noqa: E402
from chameleon_megatron.resilience.decision.feedback import Feedback  # noqa: E402
from chameleon_megatron.resilience.decision.layout import UniformLayout  # noqa: E402
from chameleon_megatron.resilience.decision.perf_model import plan_step  # noqa: E402
from chameleon_megatron.resilience.decision.reroute import plan_reroute  # noqa: E402

pytestmark = pytest.mark.timeout(30)

PROFILE = make_profile(4, gbs=8)
ONE = UniformLayout(tp=1, pp=1, dp=1).to_plan(4, 8)
DP2 = UniformLayout(tp=1, pp=2, dp=2).to_plan(4, 8)


def test_the_oracle_is_the_model() -> None:
    assert plan_step(ONE, PROFILE).t_step_s == pytest.approx(96.0)
    assert plan_step(DP2, PROFILE).t_step_s == pytest.approx(30.0)


def fitted(fb: Feedback):
    return calibrate(PROFILE, fb.observations()).profile


def test_a_layout_twice_as_slow_as_estimated_is_reported_and_calibrated() -> None:
    fb = Feedback(warmup=1, window=3)
    assert fb.observations() == []  # nothing measured yet
    fb.start("after failure 1", ONE, estimated_s=96.0)
    records = [fb.step(t) for t in (1000.0, 190.0, 192.0, 199.0, 500.0)]
    assert records[:3] == [None] * 3 and records[4] is None  # one record per layout
    assert records[3] == {"event": "estimator", "label": "after failure 1",
                          "plan": ONE.describe(), "rerouted": False, "estimated_s": 96.0,
                          "measured_s": 192.0, "error": -0.5, "steps": 3}
    assert plan_step(ONE, fitted(fb)).t_step_s == pytest.approx(192.0, rel=1e-6)
    # the fitted scale carries over to a layout not measured yet
    assert plan_step(DP2, fitted(fb)).t_step_s == pytest.approx(60.0, rel=1e-6)


def test_rerouted_layouts_are_fitted_with_their_extra_microbatches() -> None:
    reroute = plan_reroute(DP2, [3], PROFILE)
    estimate = reroute.estimate(PROFILE).t_step_s  # pipeline 0 runs 4 more microbatches
    assert estimate == pytest.approx(30.0 + 4 * 6.0)
    fb = Feedback(warmup=0, window=1)
    fb.start("rerouted", DP2, estimate, reroute)
    rec = fb.step(2 * estimate)
    assert rec["rerouted"] and rec["error"] == pytest.approx(-0.5)
    (obs,) = fb.observations()
    assert obs.extra_microbatches == {(0, 1): 4}
    # fitted as rerouted (54 s -> 108 s: times double), not as the plain layout (30 s)
    assert plan_step(DP2, fitted(fb)).t_step_s == pytest.approx(60.0, rel=1e-6)
    assert reroute.estimate(fitted(fb)).t_step_s == pytest.approx(108.0, rel=1e-6)


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="window=0"):
        Feedback(window=0)
    fb = Feedback()
    with pytest.raises(ValueError, match="call start"):
        fb.step(1.0)
    with pytest.raises(ValueError, match="estimated_s=0"):
        fb.start("x", ONE, 0.0)
    with pytest.raises(ValueError, match="another plan"):
        fb.start("x", ONE, 1.0, plan_reroute(DP2, [3], PROFILE))
