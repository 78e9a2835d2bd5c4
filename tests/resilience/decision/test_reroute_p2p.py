"""Rerouting's point-to-point programs complete without send buffering (NCCL's case).

The programs the runtime executes (``reroute_program.plan_programs``: ``rerouted`` reads
``rank_program``, its entry per rank) run on a model of unbuffered messaging
(``p2p_model``): for every plan of 4 to 16 ranks that the rerouter is given (uniform TP x PP
x DP layouts, and the planner's heterogeneous plans), every dead rank and feasible pairs
of dead ranks, training and evaluation programs must complete. The model catches the
pattern the programs replace: each message posted on its own, a send before a receive.
(Pairs of dead ranks: all on up to 8 ranks, those with the first or last rank beyond.)
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path
from typing import Iterator

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from dc_helpers import cost, make_profile  # noqa: E402
from p2p_model import run, single_ops  # noqa: E402

from chameleon_megatron.resilience.decision.layout import Plan, UniformLayout  # noqa: E402
from chameleon_megatron.resilience.decision.placement import microbatch_ids  # noqa: E402
from chameleon_megatron.resilience.decision.planner import Planner  # noqa: E402
from chameleon_megatron.resilience.decision.profile import Profile  # noqa: E402
from chameleon_megatron.resilience.decision.reroute import Infeasible, plan_reroute  # noqa: E402
from chameleon_megatron.resilience.decision.reroute_program import (  # noqa: E402
    Exchange, Transfer, forward_only, plan_programs,
)
from chameleon_megatron.resilience.decision.reroute_schedule import (  # noqa: E402
    Op, routes, schedule,
)
from chameleon_megatron.resilience.decision.restorer import assign_slots  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def test_the_model_deadlocks_on_send_then_receive_and_not_on_a_batch() -> None:
    """Stage 0 sends F(1) then receives B(0); stage 1 sends B(0) then receives F(1)."""
    ops = {0: (Op("F", 1, None, 1), Op("B", 0, 1, None)),
           1: (Op("B", 0, None, 0), Op("F", 1, 0, None))}
    alone = run(single_ops(ops))
    assert not alone.finished
    assert alone.stuck == {0: Exchange((Transfer("F", 1, 0, 1),), ()),
                           1: Exchange((Transfer("B", 0, 1, 0),), ())}
    f1, b0 = Transfer("F", 1, 0, 1), Transfer("B", 0, 1, 0)
    batched = {0: (ops[0][0], Exchange((f1,), (b0,)), ops[0][1]),
               1: (ops[1][0], Exchange((b0,), (f1,)), ops[1][1])}
    assert run(batched).finished


def test_the_model_refuses_an_op_that_runs_before_its_input_arrives() -> None:
    ops = {0: (Op("F", 0, None, 1),), 1: (Op("F", 0, 0, None),)}
    with pytest.raises(AssertionError, match="before receiving it"):
        run({0: single_ops(ops)[0], 1: ops[1]})


def test_one_message_per_op_deadlocks_where_the_programs_do_not() -> None:
    """DP2 x PP2, rank 3 dead: the schedule's ops with their messages posted one by one (the
    runtime before the programs) deadlock; the programs complete."""
    plan = UniformLayout(tp=1, pp=2, dp=2).to_plan(4, 10)
    rp = plan_reroute(plan, [3], make_profile(4, gbs=10))
    assert not run(single_ops(schedule(routes(plan, rp, microbatch_ids(plan))))).finished
    assert run(plan_programs(plan, rp, microbatch_ids(plan))).finished


def uniform_plans() -> Iterator[tuple[Plan, Profile]]:
    """TP1/TP2 x PP2..4 x DP >= 2 on 4 to 16 ranks; 1, pp and 2 pp + 1 microbatches each."""
    for tp, pp, dp in itertools.product((1, 2), (2, 3, 4), range(2, 9)):
        if 4 <= tp * pp * dp <= 16:
            for per in (1, pp, 2 * pp + 1):
                yield (UniformLayout(tp=tp, pp=pp, dp=dp).to_plan(4 * pp, dp * per),
                       make_profile(4 * pp, gbs=dp * per, tp=tp))


def planner_plans() -> Iterator[tuple[Plan, Profile]]:
    """The planner's plans for 4 to 16 TP groups under memory limits that make it mix
    depths and microbatch shares (layers of unequal cost)."""
    for memory, layers, gbs in ((20.0, 8, 16), (40.0, 8, 16), (20.0, 12, 24), (40.0, 12, 24)):
        profile = make_profile(layers, gbs=gbs, memory=memory,
                               layers=[cost(f=1 + 0.3 * (i % 3)) for i in range(layers)])
        planner = Planner(profile)
        for n in range(4, 17):
            shape = planner.search(n).pipelines
            if shape is not None:
                yield assign_slots(shape, [(r,) for r in range(n)], {}, profile), profile


def failures(plan: Plan) -> Iterator[tuple[int, ...]]:
    """Every rank; every pair on up to 8 ranks, else every pair with the first or last."""
    ranks = plan.ranks()
    yield from ((r,) for r in ranks)
    yield from (pair for pair in itertools.combinations(ranks, 2)
                if len(ranks) <= 8 or {ranks[0], ranks[-1]} & set(pair))


def check_plan(plan: Plan, profile: Profile) -> int:
    """Rerouting cases of ``plan`` (each checked)."""
    ids = microbatch_ids(plan)
    cases = 0
    for dead in failures(plan):
        try:
            rp = plan_reroute(plan, dead, profile)
        except Infeasible:
            continue
        progs = plan_programs(plan, rp, ids)
        assert set(progs) == set(plan.ranks()) - set(rp.stopped_ranks)
        for rank, ops in schedule(routes(plan, rp, ids)).items():  # exactly the schedule's
            assert tuple(s for s in progs[rank] if isinstance(s, Op)) == ops
        for mode, ready in (("train", progs),
                            ("eval", {r: forward_only(p) for r, p in progs.items()})):
            outcome = run(ready)
            assert outcome.finished, (plan.describe(), dead, mode, outcome.stuck)
        cases += 1
    return cases


def test_every_uniform_layout_and_failure_runs_without_buffering() -> None:
    cases = sum(check_plan(plan, profile) for plan, profile in uniform_plans())
    assert cases > 1500


def test_every_planner_plan_and_failure_runs_without_buffering() -> None:
    plans = list(planner_plans())
    assert sum(not plan.is_uniform for plan, _ in plans) >= 20  # mixed depths and shares
    cases = sum(check_plan(plan, profile) for plan, profile in plans)
    assert cases > 900


def test_the_runtime_runs_these_programs() -> None:
    """``rerouted`` takes each rank's program from ``plan_programs`` (what the model ran),
    and evaluates its forward part."""
    from types import SimpleNamespace

    from chameleon_megatron.resilience.execution.rerouted import rerouted_program

    plan = UniformLayout(tp=2, pp=2, dp=2).to_plan(4, 8)
    rp = plan_reroute(plan, [0], make_profile(4, gbs=8, tp=2))
    progs = plan_programs(plan, rp, microbatch_ids(plan))
    for me in plan.ranks():
        rt = SimpleNamespace(plan=plan, reroute=rp, me=me)
        assert rerouted_program(rt) == progs.get(me, ())  # type: ignore[arg-type]
    # rank 2 runs both pipelines' first stage (at its TP index 0): sends to both peers
    assert {m.dst for s in progs[2] if isinstance(s, Exchange) for m in s.sends} == {4, 6}
