"""Eq. 9-14 on plans, rerouting, memory, calibration: hand-computed values."""

import pytest
from dc_helpers import cost, make_profile

from chameleon_megatron.resilience.decision.calibration import Observation, calibrate
from chameleon_megatron.resilience.decision.layout import Pipeline, Plan, Stage, UniformLayout
from chameleon_megatron.resilience.decision.perf_model import in_flight, plan_step
from chameleon_megatron.resilience.decision.reroute import Infeasible, plan_reroute

pytestmark = pytest.mark.timeout(60)


def test_uniform_plan_step_is_eq9_plus_sync_and_overhead():
    # 2 stages of 2 layers: f = 2, b = 4 per stage; m = 4 per pipeline
    prof = make_profile(4, gbs=8, ar_bw=1.0, overhead=0.5)
    est = plan_step(UniformLayout(tp=1, pp=2, dp=2).to_plan(4, 8), prof)
    assert est.pipeline_s == (30.0, 30.0)  # (2 + 4 - 1) * 6
    assert est.sync_s == pytest.approx(2.0)  # 2 (P-1)/P * 2 grad bytes / 1 B/s
    assert est.t_step_s == pytest.approx(32.5)


def test_hops_cost_latency_plus_bytes_over_bandwidth():
    prof = make_profile(2, gbs=1, boundary=1.0, p2p_bw=1.0, latency=0.5)
    est = plan_step(UniformLayout(tp=1, pp=2, dp=1).to_plan(2, 1), prof)
    assert est.t_step_s == pytest.approx(1 + 1.5 + 1 + 2 + 1.5 + 2)


def test_heterogeneous_plan_is_slowest_pipeline_plus_sync_eq10():
    plan = Plan(num_layers=4, pipelines=(
        Pipeline(stages=(Stage((0, 1), (0,)), Stage((2, 3), (1,))), microbatches=3),
        Pipeline(stages=(Stage((0, 1, 2, 3), (2,)),), microbatches=1),
    ))
    est = plan_step(plan, make_profile(4, gbs=4, ar_bw=1.0))
    assert est.pipeline_s == (24.0, 12.0)
    assert est.sync_s == pytest.approx(4.0)  # the 4-layer stage's gradients
    assert est.t_step_s == pytest.approx(28.0)


def test_reroute_two_failures_at_one_stage_eq12():
    prof = make_profile(4, gbs=16)
    plan = UniformLayout(tp=1, pp=2, dp=4).to_plan(4, 16)  # m = 4, stage f+b = 6
    rp = plan_reroute(plan, [0, 1], prof)  # stage 0 of pipelines 0 and 1
    assert rp.extra_microbatches() == {(2, 0): 4, (3, 0): 4}
    # (N_pp + N_m - 1 + N_m F / (N_dp - F)) (t_f + t_b) = (2 + 4 - 1 + 4*2/2) * 6
    assert rp.estimate(prof).t_step_s == pytest.approx(54.0, rel=1e-9)


def test_reroute_failures_at_two_stages_add_up_eq13():
    prof = make_profile(4, gbs=20)
    plan = UniformLayout(tp=1, pp=2, dp=5).to_plan(4, 20)  # m = 4
    rp = plan_reroute(plan, [0, 5], prof)  # pipeline 0, stages 0 and 1
    assert rp.estimate(prof).t_step_s == pytest.approx((2 + 4 - 1 + 4 / 4 + 4 / 4) * 6, rel=1e-9)
    assert all(sum(n for _, n in r.targets) == 4 for r in rp.reroutes)


def test_reroute_is_infeasible_without_a_healthy_peer():
    plan = UniformLayout(tp=1, pp=2, dp=2).to_plan(4, 4)
    with pytest.raises(Infeasible, match="stage 1 of pipeline 0"):
        plan_reroute(plan, [2, 3], make_profile(4, gbs=4))


def test_stage_memory_eq14_with_embedding_and_output():
    prof = make_profile(4, gbs=8, embedding=cost(0, 0, 10, 20, 5), output=cost(0, 0, 3, 6, 4))
    plan = UniformLayout(tp=1, pp=2, dp=2).to_plan(4, 8)
    # stage 0: 2 layers x (2*1 + 2) + embedding (2*10 + 20) = 48, activations (2 + 5) x min(2, 4)
    # stage 1: 2 x 4 + output (2*3 + 6) = 20, activations (2 + 4) x min(1, 4)
    assert plan_step(plan, prof).peak_memory_bytes == 62.0
    assert plan_step(plan, make_profile(4, gbs=8, memory=62.0, embedding=cost(0, 0, 10, 20, 5),
                                        output=cost(0, 0, 3, 6, 4))).fits_memory
    small = make_profile(4, gbs=8, memory=61.9, embedding=cost(0, 0, 10, 20, 5),
                         output=cost(0, 0, 3, 6, 4))
    assert not plan_step(plan, small).fits_memory


def test_in_flight_microbatches():
    assert in_flight(4, 0, 8) == 4 and in_flight(4, 3, 8) == 1 and in_flight(4, 0, 2) == 2
    # interleaved: megatron's warm-up 2 (d-s-1) + (v-1) d chunks, plus one, in stage units
    assert in_flight(4, 0, 8, vpp=2) == (2 * 3 + 4 + 1) / 2


def test_plan_and_profile_must_agree():
    plan = UniformLayout(tp=2, pp=2, dp=1).to_plan(4, 4)
    with pytest.raises(ValueError, match="tp=2"):
        plan_step(plan, make_profile(4))


def test_calibration_recovers_a_known_scale_and_reports_error():
    base = make_profile(4, gbs=8, boundary=1.0, p2p_bw=10.0, ar_bw=4.0)
    truth = base.with_times_scaled(2.0)
    plans = [UniformLayout(tp=1, pp=p, dp=d).to_plan(4, 8) for p, d in ((2, 2), (4, 1), (1, 4))]
    obs = [Observation(p, plan_step(p, truth).t_step_s, f"pp{p.depths[0]}") for p in plans]
    cal = calibrate(base, obs)
    assert cal.factor == pytest.approx(2.0, rel=1e-6)
    assert cal.mean_abs_error < 1e-6
    skewed = [obs[0], Observation(plans[1], obs[1].measured_s * 1.2, "slow")]
    rows = calibrate(base, skewed).rows
    assert rows[0][3] > 0 > rows[1][3]  # one over-, one under-estimated


def test_calibration_refuses_a_step_faster_than_communication():
    base = make_profile(4, gbs=8, ar_bw=0.01)
    plan = UniformLayout(tp=1, pp=1, dp=2).to_plan(4, 8)
    with pytest.raises(ValueError, match="communication-only"):
        calibrate(base, [Observation(plan, 1.0, "x")])
