"""The routed schedule of rerouting, checked by an independent executor.

The checker runs each rank's op list asynchronously (a rank advances whenever its next op's
input has arrived; sends never block; receives take the oldest message of their link and
must find exactly the one they expect), so it finds a deadlock, an out-of-order message, a
missing or doubled operation, or a stage holding more microbatches than 1F1B would.
"""

from __future__ import annotations

import itertools
import random
import sys
from collections import deque
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dc_helpers import make_profile  # noqa: E402

from chameleon_megatron.resilience.decision.placement import microbatch_ids  # noqa: E402
from chameleon_megatron.resilience.decision.layout import (  # noqa: E402
    Pipeline, Plan, Stage, UniformLayout,
)
from chameleon_megatron.resilience.decision.reroute import (  # noqa: E402
    Infeasible, Reroute, ReroutePlan, plan_reroute,
)
from chameleon_megatron.resilience.decision.reroute_schedule import (  # noqa: E402
    rank_ops, routes, schedule,
)

pytestmark = pytest.mark.timeout(60)


def check(route_of: dict, ops: dict) -> None:
    """Execute ``ops``; assert it completes, in FIFO order, every op once, within 1F1B memory."""
    expected = {(k, g, rank) for g, route in route_of.items() for rank in route for k in "FB"}
    done = [(op.kind, op.microbatch, rank) for rank, seq in ops.items() for op in seq]
    assert sorted(done) == sorted(expected)
    links: dict = {}
    pos = {rank: 0 for rank in ops}
    held = {rank: 0 for rank in ops}
    finished: set = set()
    progress = True
    while progress:
        progress = False
        for rank, seq in ops.items():
            while pos[rank] < len(seq):
                op = seq[pos[rank]]
                route = route_of[op.microbatch]
                s = route.index(rank)
                if op.kind == "F":
                    want_from = route[s - 1] if s > 0 else None
                    want_to = route[s + 1] if s + 1 < len(route) else None
                else:
                    want_from = route[s + 1] if s + 1 < len(route) else None
                    want_to = route[s - 1] if s > 0 else None
                    assert ("F", op.microbatch, rank) in finished
                assert (op.recv, op.send) == (want_from, want_to), op
                if op.recv is not None:
                    queue = links.get((op.recv, rank))
                    if not queue:
                        break  # blocked: wait for the sender
                    assert queue.popleft() == (op.kind, op.microbatch), "out of order"
                if op.send is not None:
                    links.setdefault((rank, op.send), deque()).append((op.kind, op.microbatch))
                held[rank] += 1 if op.kind == "F" else -1
                assert held[rank] <= len(route) - s, f"rank {rank} holds {held[rank]}"
                finished.add((op.kind, op.microbatch, rank))
                pos[rank] += 1
                progress = True
    stuck = {rank: seq[pos[rank]] for rank, seq in ops.items() if pos[rank] < len(seq)}
    assert not stuck, f"deadlock: {stuck}"


def test_dead_last_stage_sends_its_pipelines_microbatches_to_the_peer() -> None:
    plan = UniformLayout(tp=1, pp=2, dp=2).to_plan(4, 10)  # pipelines (0, 2) and (1, 3)
    rp = plan_reroute(plan, [3], make_profile(4, gbs=10))
    route_of = routes(plan, rp, microbatch_ids(plan))
    assert route_of == {g: (g % 2, 2) for g in range(10)}
    ops = schedule(route_of)
    check(route_of, ops)
    assert set(ops) == {0, 1, 2}
    assert sum(op.kind == "F" for op in ops[2]) == 10  # the peer runs both pipelines' stage


def test_a_failed_pipeline_can_spread_over_several_peers_and_stages() -> None:
    """DP3 x PP3 (pipeline j = ranks j, j + 3, j + 6), ranks 4 and 8 dead: pipeline 1's
    middle stage and pipeline 2's last stage spread over their live peers."""
    plan = UniformLayout(tp=1, pp=3, dp=3).to_plan(6, 12)
    rp = plan_reroute(plan, [4, 8], make_profile(6, gbs=12))
    route_of = routes(plan, rp, microbatch_ids(plan))
    for route in route_of.values():
        assert not {4, 8} & set(route)
    assert {route[1] for g, route in route_of.items() if g % 3 == 1} == {3, 5}
    assert {route[2] for g, route in route_of.items() if g % 3 == 2} == {6, 7}
    check(route_of, schedule(route_of))


def test_random_layouts_and_failures_schedule_without_deadlock() -> None:
    rng = random.Random(7)
    cases = 0
    for pp, dp, per in itertools.product((1, 2, 3, 4), (2, 3, 4), (1, 2, 5)):
        plan = UniformLayout(tp=1, pp=pp, dp=dp).to_plan(4 * pp, dp * per)
        profile = make_profile(4 * pp, gbs=dp * per)
        for _ in range(3):
            dead = rng.sample(range(pp * dp), rng.randint(1, max(1, pp * dp // 3)))
            try:
                rp = plan_reroute(plan, dead, profile)
            except Infeasible:
                continue
            route_of = routes(plan, rp, microbatch_ids(plan))
            check(route_of, schedule(route_of))
            cases += 1
    assert cases > 60


def test_rerouting_a_heterogeneous_plan_to_a_peer_of_another_depth() -> None:
    """The peer holds the same units at another stage index of a deeper pipeline."""
    plan = Plan(num_layers=4, pipelines=(
        Pipeline(stages=(Stage((0, 1), (0,)), Stage((2, 3), (1,))), microbatches=3),
        Pipeline(stages=(Stage((0,), (2,)), Stage((1,), (3,)), Stage((2, 3), (4,))),
                 microbatches=4),
    ))
    rp = ReroutePlan(plan=plan, failed_ranks=(1,),
                     reroutes=(Reroute(pipeline=0, stage=1, targets=((1, 3),)),))
    route_of = routes(plan, rp, microbatch_ids(plan))
    assert {route_of[g] for g in microbatch_ids(plan)[0]} == {(0, 4)}
    check(route_of, schedule(route_of))


def test_routes_refuse_a_plan_that_leaves_a_dead_rank_on_a_route() -> None:
    plan = UniformLayout(tp=1, pp=2, dp=2).to_plan(4, 4)
    rp = ReroutePlan(plan=plan, failed_ranks=(3,), reroutes=())
    with pytest.raises(ValueError, match=r"microbatch 1 still meets failed stages \[3\]"):
        routes(plan, rp, microbatch_ids(plan))


def test_at_tp2_a_failed_stage_stops_whole_and_each_tp_index_follows_its_routes() -> None:
    """TP2 x PP2 x DP2 (stages (0, 1), (2, 3) | (4, 5), (6, 7)), rank 0 dead: its partner 1
    stops too; pipeline 0's microbatches run their first stage on (2, 3), each TP index
    exchanging with the same index of the next stage."""
    plan = UniformLayout(tp=2, pp=2, dp=2).to_plan(4, 8)
    rp = plan_reroute(plan, [0], make_profile(4, gbs=8, tp=2))
    assert rp.failed_ranks == (0,) and rp.stopped_ranks == (0, 1)
    ids = microbatch_ids(plan)
    leaders = routes(plan, rp, ids)
    assert {leaders[g] for g in ids[0]} == {(2, 4)}
    assert rank_ops(plan, rp, ids, 1) == ()
    for index in (0, 1):
        route_of = {g: tuple(r + index for r in route) for g, route in leaders.items()}
        ops = {r: rank_ops(plan, rp, ids, r) for r in range(2 + index, 8, 2)}
        check(route_of, ops)
        assert sum(op.kind == "F" for op in ops[2 + index]) == 8


def test_a_rerouting_plan_stops_every_rank_of_a_failed_stage() -> None:
    plan = UniformLayout(tp=2, pp=2, dp=2).to_plan(4, 8)
    rp = ReroutePlan(plan=plan, failed_ranks=(5, 6), reroutes=())
    assert rp.stopped_ranks == (4, 5, 6, 7)
    with pytest.raises(ValueError, match=r"still meets failed stages \[4\]"):
        routes(plan, rp, microbatch_ids(plan))
