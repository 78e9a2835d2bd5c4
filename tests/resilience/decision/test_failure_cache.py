"""Precomputed decisions: a decision served from the cache equals the fresh one."""

from __future__ import annotations

import dataclasses

import pytest

from chameleon_megatron.resilience.decision.center import decide, uniform_plan
from chameleon_megatron.resilience.decision.failure_cache import (
    CacheInputs,
    build_cache,
    likely_failures,
)
from chameleon_megatron.resilience.decision.layout import UniformLayout
from dc_helpers import make_profile

pytestmark = pytest.mark.timeout(120)

TP2_8 = uniform_plan(UniformLayout(tp=2, pp=2, dp=2), list(range(8)), 4, 8)
DP2_PP2 = uniform_plan(UniformLayout(tp=1, pp=2, dp=2), [0, 1, 2, 3], 4, 8)
NODES_8 = ((0, 1, 2, 3), (4, 5, 6, 7))
NODES_4 = ((0, 1), (2, 3))
CASES = [  # plan, profile (rerouting wins / re-plan wins), plan-runtime refusal, nodes
    (TP2_8, make_profile(4, tp=2, ar_bw=1e12, regroup=60.0), None, NODES_8),
    (TP2_8, make_profile(4, tp=2, ar_bw=1e12), None, NODES_8),
    (DP2_PP2, make_profile(4, ar_bw=1e12, regroup=60.0), None, NODES_4),
    (DP2_PP2, make_profile(4, ar_bw=1e12), "vpp=2: plans execute plain 1F1B only", NODES_4),
]


def inputs(plan, profile, plans, members=None, stale=()) -> CacheInputs:
    return CacheInputs(plan=plan, members=tuple(members or plan.ranks()), stale=tuple(stale),
                       profile=profile, plans=plans)


def fresh(ins: CacheInputs, alive, d_s: float, strategy: str = "adaptive"):
    return decide(ins.plan, alive=sorted(alive), stale=ins.stale, profile=ins.profile,
                  d_s=d_s, strategy=strategy, plans=ins.plans)


@pytest.mark.parametrize("plan, profile, plans, nodes", CASES)
def test_a_cached_decision_equals_the_fresh_one_for_every_single_and_node_failure(
        plan, profile, plans, nodes) -> None:
    ins = inputs(plan, profile, plans)
    members = ins.members
    # the lowest rank decides every failure but its own (and its node's): the next one those
    failures = [f for me in members for f in likely_failures(members, (), nodes, me)]
    assert len(failures) == len(members) + len(nodes)
    cache = build_cache(ins, failures)
    assert len(cache.entries) == len(failures)
    executed = set()
    for dead in failures:
        alive = sorted(set(members) - dead)
        cands = cache.lookup(plan=plan, alive=alive, stale=(), plans=plans)
        assert cands is not None, dead
        for d_s in (10.0, 1e6):  # D is not cached: the choice is made at the failure
            served = decide(plan, alive=alive, stale=(), profile=profile, d_s=d_s,
                            plans=plans, candidates=cands)
            want = fresh(ins, alive, d_s)
            assert served == want, dead
            executed.add(want.record["executed"])
    assert executed == {"reroute", "replan"} if plans is None else {"replan"}


def test_the_leader_of_each_failure_precomputes_it() -> None:
    members, nodes = tuple(range(8)), NODES_8
    assert likely_failures(members, (), nodes, 0) == [frozenset([r]) for r in range(1, 8)] + [
        frozenset(range(4, 8))]
    assert likely_failures(members, (), nodes, 1) == [frozenset([0])]
    assert likely_failures(members, (), nodes, 4) == [frozenset(range(4))]
    assert likely_failures(members, (), nodes, 2) == []
    # a spare (stale) does not decide: rank 1 is the spare, rank 2 leads when 0 dies
    assert likely_failures(members, (1,), nodes, 2) == [frozenset([0])]
    assert likely_failures(members, (1,), nodes, 1) == []


def test_other_inputs_are_not_served() -> None:
    plan, profile, plans, _ = CASES[0]
    ins = inputs(plan, profile, plans)
    cache = build_cache(ins, [frozenset([3])])
    alive = [0, 1, 2, 4, 5, 6, 7]
    assert cache.lookup(plan=plan, alive=alive, stale=(), plans=plans) is not None
    assert cache.lookup(plan=plan, alive=alive, stale=[1], plans=plans) is None  # 1 missed a step
    assert cache.lookup(plan=plan, alive=[0, 1, 4, 5, 6, 7], stale=(), plans=plans) is None
    assert cache.lookup(plan=plan, alive=alive, stale=(), plans="refused") is None
    other = uniform_plan(UniformLayout(tp=2, pp=1, dp=4), list(range(8)), 4, 8)
    assert cache.lookup(plan=other, alive=alive, stale=(), plans=plans) is None
    assert cache.lookup(plan=plan, alive=alive, stale=(), plans=plans, time_limit_s=1.0) is None


def test_a_cancelled_build_gives_nothing_and_an_incomplete_search_is_left_out() -> None:
    plan, profile, plans, nodes = CASES[1]
    ins = inputs(plan, profile, plans)
    failures = likely_failures(ins.members, (), nodes, 0)
    calls = []
    assert build_cache(ins, failures, cancelled=lambda: calls.append(1) or len(calls) > 2) is None
    assert len(calls) == 3  # checked before each entry
    hurried = build_cache(dataclasses.replace(ins, time_limit_s=0.0), failures)
    assert hurried.entries == {}


def test_a_recovery_layout_keeps_a_copy_of_every_stage_for_the_next_failure() -> None:
    """The 8-rank job of bench_vs_restart (PP2 x DP4, a rank lost, its replacement joining)
    grew into one pipeline of depth 8, the fastest plan with a slow gradient sync, and the
    next failure found no surviving copy of its stage: a recovery keeps two pipelines."""
    profile = make_profile(8, gbs=4, ar_bw=1e-3, transfer_bw=1e9)
    plan = UniformLayout(tp=1, pp=2, dp=4).to_plan(8, 4)
    for alive, stale in ((range(7), ()), (range(8), (7,))):  # a failure, then the join
        for plans in (None, "megatron layouts only"):
            decision = decide(plan, alive=list(alive), stale=stale, profile=profile, d_s=1e4,
                              plans=plans)
            assert len(decision.plan.pipelines) >= 2, (alive, plans, decision.plan.describe())
    fastest = decide(plan, alive=list(range(7)), stale=(), profile=profile, d_s=1e4,
                     replicated=False)  # --no-chameleon-ft-keep-replicas
    assert fastest.plan.describe() == "1x(d7,m4), tp1"
