"""Eq. 8 selection, the MTBF estimate of D, candidates and the plan cache."""

import json

import pytest
from dc_helpers import make_profile

from chameleon_megatron.resilience.decision.candidates import Candidate, make_candidates
from chameleon_megatron.resilience.decision.layout import Pipeline, Plan, Stage, UniformLayout
from chameleon_megatron.resilience.decision.mtbf import MtbfEstimator
from chameleon_megatron.resilience.decision.plan_cache import PlanCache
from chameleon_megatron.resilience.decision.planner import Planner
from chameleon_megatron.resilience.decision.selector import NoFeasibleCandidate, score, select

pytestmark = pytest.mark.timeout(60)

REROUTE = Candidate(name="reroute", feasible=True, reason="ok", t_step_s=12.0, t_transition_s=0.0)
REPLAN = Candidate(name="replan", feasible=True, reason="ok", t_step_s=10.0, t_transition_s=100.0)


def test_score_is_eq8():
    assert score(64, 10.0, 100.0, 400.0) == pytest.approx(64 / 10 * 300 / 400)


def test_short_d_picks_rerouting_and_long_d_picks_replan():
    # break-even: 1/12 = (1/10) (D - 100) / D  ->  D = 600
    assert select([REROUTE, REPLAN], d_s=500.0, batch=64).chosen.name == "reroute"
    assert select([REROUTE, REPLAN], d_s=700.0, batch=64).chosen.name == "replan"


def test_d_not_above_transition_excludes_the_candidate():
    decision = select([REROUTE, REPLAN], d_s=100.0, batch=64)
    row = decision.record["candidates"][1]
    assert decision.chosen.name == "reroute"
    assert not row["feasible"] and "t_transition" in row["reason"] and row["score"] is None


def test_no_feasible_candidate_is_a_clear_error_with_the_record():
    lost = Candidate(name="replan", feasible=False, reason="no surviving copy of [3]")
    with pytest.raises(NoFeasibleCandidate, match="no surviving copy") as info:
        select([lost, REPLAN], d_s=50.0, batch=8)
    assert info.value.record["choice"] is None
    assert len(info.value.record["candidates"]) == 2


def test_forced_strategy_and_bad_inputs():
    assert select([REROUTE, REPLAN], d_s=1e6, batch=8, strategy="reroute").chosen.name == "reroute"
    with pytest.raises(ValueError, match="D=0"):
        select([REROUTE], d_s=0.0, batch=8)
    with pytest.raises(ValueError, match="B=0"):
        select([REROUTE], d_s=1.0, batch=0)


def test_record_has_every_figure_and_is_json():
    record = select([REROUTE, REPLAN], d_s=700.0, batch=64).record
    json.dumps(record)
    assert record["D_s"] == 700.0 and record["B"] == 64 and record["choice"] == "replan"
    for row in record["candidates"]:
        assert {"t_step_s", "t_transition_s", "score", "feasible", "reason"} <= set(row)


def test_mtbf_estimate_moves_from_prior_to_observed():
    est = MtbfEstimator(prior_s=1000.0, prior_weight=2.0)
    assert est.expected_s([], now_s=0.0) == 1000.0
    # (2 x 1000 + 600 exposure) / (2 + 3 failures)
    assert est.expected_s([100.0, 300.0, 500.0], now_s=600.0) == pytest.approx(520.0)
    many = [10.0 * k for k in range(1, 1001)]
    assert est.expected_s(many, now_s=10000.0) == pytest.approx(10.0, rel=0.25)
    with pytest.raises(ValueError, match="outside"):
        est.expected_s([700.0], now_s=600.0)
    with pytest.raises(ValueError, match="prior_s"):
        MtbfEstimator(prior_s=0.0)


def _setup():
    profile = make_profile(4, gbs=16, transfer_bw=1.0, regroup=2.0)
    plan = UniformLayout(tp=1, pp=2, dp=4).to_plan(4, 16)
    return profile, plan, Planner(profile)


def test_candidates_for_one_failure():
    profile, plan, planner = _setup()
    cands = make_candidates(plan, [1], planner)
    assert cands.reroute.feasible and cands.reroute.t_transition_s == 0.0
    assert cands.reroute.t_step_s == pytest.approx((2 + 4 - 1 + 2) * 6)  # 4 extra over 3 peers
    assert cands.replan.feasible and cands.replan.plan is not None
    assert 1 not in cands.replan.plan.ranks() and len(cands.replan.plan.ranks()) <= 7
    assert cands.replan.t_transition_s >= profile.regroup_s
    json.dumps(select(cands, d_s=1e4, batch=16).record)


def test_reroute_needs_a_peer_with_the_same_layers_replan_does_not():
    profile = make_profile(4, gbs=4, transfer_bw=1.0)
    plan = Plan(num_layers=4, pipelines=(
        Pipeline(stages=(Stage((0, 1), (0,)), Stage((2, 3), (1,))), microbatches=3),
        Pipeline(stages=(Stage((0, 1, 2, 3), (2,)),), microbatches=1),
    ))
    cands = make_candidates(plan, [1], Planner(profile))
    assert not cands.reroute.feasible and "no healthy peer" in cands.reroute.reason
    assert cands.replan.feasible and cands.replan.restore.bytes_moved() > 0


def test_state_lost_everywhere_makes_both_infeasible():
    profile, plan, planner = _setup()
    cands = make_candidates(plan, [4, 5, 6, 7], planner)  # every copy of stage 1
    assert not cands.reroute.feasible and "no healthy peer" in cands.reroute.reason
    assert not cands.replan.feasible and "no surviving copy of [2, 3, 'output']" in cands.replan.reason


def test_plan_cache_serves_any_rank_of_a_broken_group():
    profile = make_profile(4, tp=2, gbs=18, transfer_bw=1.0, regroup=2.0)
    plan = UniformLayout(tp=2, pp=2, dp=3).to_plan(4, 18)
    planner = Planner(profile)
    cache = PlanCache.build(plan, planner, pairs=True)
    assert len(cache.entries) == 6 + 15
    hit = cache.lookup([3])  # rank 3 is TP index 1 of group (2, 3)
    assert hit is cache.lookup([2]) is cache.lookup([2, 3])
    fresh = make_candidates(plan, [2, 3], planner)
    assert hit.replan.t_step_s == pytest.approx(fresh.replan.t_step_s)
    assert hit.reroute.t_step_s == pytest.approx(fresh.reroute.t_step_s)
    assert cache.lookup([0, 4]) is not None  # a pair
    assert cache.lookup([0, 4, 8]) is None
