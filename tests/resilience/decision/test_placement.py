"""Pure parts of the plan runtime: data shares, rank order, layer splits, refusals, and the
gradient-sync spec built from the restorer's groups and DSATUR rounds."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dc_helpers import make_profile  # noqa: E402

from chameleon_megatron.resilience.decision.placement import (  # noqa: E402
    NoFreshCopy, Slot, check_plan_runtime, kept_in_place, microbatch_ids, slot_of,
    stage_major_order,
)
from chameleon_megatron.resilience.execution.grad_sync import sync_spec  # noqa: E402
from chameleon_megatron.resilience.decision.layout import (  # noqa: E402
    EMBEDDING, OUTPUT, Pipeline, Plan, Stage, UniformLayout,
)
from chameleon_megatron.resilience.decision.restorer import (  # noqa: E402
    AllReduceGroup, allreduce_groups, allreduce_rounds,
)

pytestmark = pytest.mark.timeout(30)

HETERO = Plan(num_layers=4, pipelines=(
    Pipeline(stages=(Stage((0,), (0,)), Stage((1, 2, 3), (1,))), microbatches=5),
    Pipeline(stages=(Stage((0, 1, 2, 3), (2,)),), microbatches=3),
    Pipeline(stages=(Stage((0, 1, 2, 3), (3,)),), microbatches=2),
))
UNIFORM = UniformLayout(tp=1, pp=2, dp=2).to_plan(4, 10)  # pipelines (0, 2) and (1, 3)


def test_microbatch_shares_cover_the_batch_once_in_megatron_order() -> None:
    assert microbatch_ids(HETERO) == ((0, 3, 6, 8, 9), (1, 4, 7), (2, 5))
    # equal shares: microbatch k of data-parallel rank j is k * dp + j, as training/data.py
    assert microbatch_ids(UNIFORM) == ((0, 2, 4, 6, 8), (1, 3, 5, 7, 9))


def test_stage_major_order_puts_each_pipeline_in_ascending_world_ranks() -> None:
    plan = Plan(num_layers=4, pipelines=(
        Pipeline(stages=(Stage((0, 1), (7,)), Stage((2, 3), (4,))), microbatches=2),
        Pipeline(stages=(Stage((0,), (5,)), Stage((1, 2), (9,)), Stage((3,), (6,))),
                 microbatches=1),
    ))
    order = stage_major_order(plan)
    assert order == (7, 5, 4, 9, 6)
    world = {r: k for k, r in enumerate(order)}
    for pipe in plan.pipelines:
        ranks = [world[st.ranks[0]] for st in pipe.stages]
        assert ranks == sorted(ranks)
    assert slot_of(plan, 9) == Slot(pipeline=1, stage=1, tp_index=0)
    with pytest.raises(ValueError, match="rank 8 has no slot"):
        slot_of(plan, 8)


def _args(**over) -> argparse.Namespace:
    base = dict(bf16=False, optimizer="adam", use_distributed_optimizer=False,
                num_experts=None, moe_aux_loss_coeff=0.0, sequence_parallel=False,
                num_layers=4)
    return argparse.Namespace(**{**base, **over})


def test_the_runtime_refuses_what_it_does_not_execute() -> None:
    check_plan_runtime(_args(), HETERO)
    check_plan_runtime(_args(optimizer="sgd"), HETERO)
    check_plan_runtime(_args(num_experts=4), HETERO)
    check_plan_runtime(_args(bf16=True), HETERO)
    check_plan_runtime(_args(num_experts=4, moe_aux_loss_coeff=0.01), HETERO)
    check_plan_runtime(_args(bf16=True, use_distributed_optimizer=True), HETERO)
    with pytest.raises(ValueError, match="plan has 4 layers, the model 8"):
        check_plan_runtime(_args(num_layers=8), HETERO)
    with pytest.raises(ValueError, match="does not update the router's expert_bias"):
        check_plan_runtime(_args(num_experts=4, moe_router_enable_expert_bias=True), HETERO)
    tp2 = UniformLayout(tp=2, pp=2, dp=1).to_plan(4, 2)
    check_plan_runtime(_args(bf16=True), tp2)
    check_plan_runtime(_args(num_experts=4, sequence_parallel=True), tp2)
    odd = Plan(num_layers=8, pipelines=(Pipeline(stages=(
        Stage((0,), (0,)), Stage((1, 2), (1,)), Stage((3, 4, 5), (2,)), Stage((6, 7), (3,))),
        microbatches=1),))
    check_plan_runtime(_args(num_layers=8), odd)  # any contiguous split


def test_sync_spec_takes_the_restorers_rounds() -> None:
    profile = make_profile(4, gbs=10)
    groups, rounds = allreduce_groups(HETERO, profile), allreduce_rounds(HETERO, profile)
    spec = sync_spec(HETERO, groups, rounds, tied=True)
    # layer 0 + embedding on (0, 2, 3), layers 1-3 + output on (1, 2, 3): they share 2 and 3
    by_ranks = {g.ranks: set(g.layers) for rnd in spec.rounds for g in rnd}
    assert by_ranks == {(0, 2, 3): {0, EMBEDDING}, (1, 2, 3): {1, 2, 3, OUTPUT}}
    assert [len(rnd) for rnd in spec.rounds] == [1, 1]
    assert spec.tied == ((0, 1, 2, 3),)  # every first and last stage holds a copy
    assert spec.owners == {(0, 0): 0, (EMBEDDING, 0): 0, (1, 0): 1, (2, 0): 1, (3, 0): 1,
                           (OUTPUT, 0): 1}
    assert sync_spec(HETERO, groups, rounds, tied=False).tied == ()


def test_at_tp2_each_tp_index_syncs_its_own_shards() -> None:
    """TP2 x PP2 x DP2: a unit's shards at TP index 0 and 1 are synced, tied and counted in
    the norm apart, never together."""
    plan = UniformLayout(tp=2, pp=2, dp=2).to_plan(4, 4)
    profile = make_profile(4, gbs=8)
    spec = sync_spec(plan, allreduce_groups(plan, profile), allreduce_rounds(plan, profile),
                     tied=True)
    index = {r: i for r, (i, _) in plan.holdings().items()}
    for rnd in spec.rounds:
        for g in rnd:
            assert len({index[r] for r in g.ranks}) == 1, g
    assert len(spec.tied) == 2 and all(len({index[r] for r in c}) == 1 for c in spec.tied)
    assert {i for _, i in spec.owners} == {0, 1}
    assert all(index[r] == i for (_, i), r in spec.owners.items())


def test_sync_spec_refuses_rounds_that_would_mix_up_or_miss_gradients() -> None:
    profile = make_profile(4, gbs=10)
    groups = allreduce_groups(HETERO, profile)
    with pytest.raises(ValueError, match=r"round 0: ranks \[2, 3\] are in two"):
        sync_spec(HETERO, groups, [(0, 1)], tied=True)
    with pytest.raises(ValueError, match="is in 0 all-reduce groups"):
        sync_spec(HETERO, groups, [(0,)], tied=True)
    wrong = (AllReduceGroup(ranks=(0, 2), layers=(0, EMBEDDING), bytes=1.0), groups[1])
    with pytest.raises(ValueError, match=r"unit 0 is held by live ranks \[0, 2, 3\]"):
        sync_spec(HETERO, wrong, [(0,), (1,)], tied=True)


def test_dead_ranks_leave_the_groups_and_lone_copies_need_no_sync() -> None:
    profile = make_profile(4, gbs=10)
    groups, rounds = allreduce_groups(UNIFORM, profile), allreduce_rounds(UNIFORM, profile)
    spec = sync_spec(UNIFORM, groups, rounds, dead=frozenset({3}), tied=True)
    assert [[g.ranks for g in rnd] for rnd in spec.rounds] == [[(0, 1)]]
    assert spec.tied == ((0, 1, 2),)
    assert spec.owners[(OUTPUT, 0)] == 2 and spec.owners[(EMBEDDING, 0)] == 0


def test_a_stale_survivor_of_a_kept_layout_gets_its_units_from_a_fresh_peer() -> None:
    """Rank 1 had not applied the last step (it talked to the dead rank 3): it keeps its
    stage, but not its state: each of its units comes from rank 0, which holds them."""
    moves = kept_in_place(UNIFORM, dead=[3], stale=[1],
                          bytes_of=lambda unit, kind: 10.0 if kind == "params" else 20.0)
    by_dst = {(t.dst, t.layer, t.kind): (t.src, t.bytes) for t in moves}
    assert len(by_dst) == len(moves) == 3 * 3 * 2
    for u in (0, 1, EMBEDDING):
        assert by_dst[(1, u, "params")] == (0, 10.0) and by_dst[(1, u, "optimizer")] == (0, 20.0)
        assert by_dst[(0, u, "params")] == (0, 0.0)
    with pytest.raises(NoFreshCopy, match="stale rank 2 keeps unit 2"):
        kept_in_place(UNIFORM, dead=[3], stale=[2])


def test_rerouting_keeps_every_survivors_state_in_place() -> None:
    moves = kept_in_place(UNIFORM, dead=[3])
    assert all(t.src == t.dst and t.bytes == 0.0 for t in moves)
    held = {(t.dst, t.layer, t.kind) for t in moves}
    assert len(held) == len(moves) == 3 * 3 * 2  # 3 survivors x 3 units x 2 kinds
    assert {(r, u) for r, u, _ in held} == {
        (0, 0), (0, 1), (0, EMBEDDING), (1, 0), (1, 1), (1, EMBEDDING),
        (2, 2), (2, 3), (2, OUTPUT)}
