"""Restorer plans: Hungarian assignment vs brute force, transfers, lost state, DSATUR rounds."""

import itertools
import random

import pytest
from dc_helpers import cost, make_profile

from chameleon_megatron.resilience.decision.layout import (
    EMBEDDING, OUTPUT, Pipeline, Plan, Stage, UniformLayout, contiguous_layers,
)
from chameleon_megatron.resilience.decision.planner import PipelineShape
from chameleon_megatron.resilience.decision.restorer import (
    allreduce_groups, allreduce_rounds, assign_slots, live_holdings, restore_plan, transition_s,
)

pytestmark = pytest.mark.timeout(60)


def random_plan(rng, L, units, tp):
    """Pipelines of random depths and uneven splits over the given TP groups."""
    pipes, k = [], 0
    while k < len(units):
        d = rng.randint(1, min(L, len(units) - k))
        cuts = sorted(rng.sample(range(1, L), d - 1))
        counts = [b - a for a, b in zip([0, *cuts], [*cuts, L])]
        stages = tuple(Stage(layers, units[k + s]) for s, layers in enumerate(contiguous_layers(counts)))
        pipes.append(Pipeline(stages=stages, microbatches=1))
        k += d
    return Plan(num_layers=L, pipelines=tuple(pipes))


def bytes_to_move(plan, holdings, profile):
    total = 0.0
    for j, s, i, rank in plan.slots():
        tp_index, owned = holdings.get(rank, (i, ()))
        have = set(owned) if tp_index == i else set()
        for u in plan.pipelines[j].stage_units(s):
            if u not in have:
                c = profile.embedding if u == EMBEDDING else profile.output if u == OUTPUT \
                    else profile.layers[u]
                total += c.state_bytes
    return total


@pytest.mark.parametrize("seed", range(6))
def test_assignment_minimises_bytes_like_brute_force(seed):
    rng = random.Random(seed)
    L, tp = 5, rng.choice([1, 2])
    layers = [cost(param=rng.uniform(1, 9), opt=rng.uniform(1, 9)) for _ in range(L)]
    profile = make_profile(layers=layers, tp=tp, embedding=cost(param=3, opt=4),
                           output=cost(param=2, opt=5))
    units = [tuple(range(u * tp, (u + 1) * tp)) for u in range(6)]
    old = random_plan(rng, L, units, tp)
    dead = {rng.randrange(6 * tp)}
    healthy = [g for g in units if not dead & set(g)]
    holdings = live_holdings(old, dead)
    shape = (PipelineShape(3, 2, (2, 2, 1)), PipelineShape(2, 2, (4, 1)))
    plan = assign_slots(shape, healthy, holdings, profile)
    best = min(
        bytes_to_move(assign_fixed(shape, perm, L), holdings, profile)
        for perm in itertools.permutations(healthy, 5)
    )
    assert bytes_to_move(plan, holdings, profile) == pytest.approx(best)
    restore = restore_plan(holdings, plan, profile)
    assert restore.bytes_moved() == pytest.approx(best)


def assign_fixed(shape, groups, L):
    it = iter(groups)
    return Plan(num_layers=L, pipelines=tuple(
        Pipeline(stages=tuple(Stage(ls, next(it)) for ls in contiguous_layers(p.layer_counts)),
                 microbatches=p.microbatches) for p in shape))


def test_transfers_fill_every_slot_from_live_sources():
    profile = make_profile(4, tp=2, embedding=cost(param=3, opt=3), output=cost(param=2, opt=2))
    old = UniformLayout(tp=2, pp=2, dp=2).to_plan(4, 4)  # ranks 0-3 stage 0, 4-7 stage 1
    dead = {5}
    units = [g for g in UniformLayout(tp=2, pp=2, dp=2).tp_groups() if 5 not in g]
    holdings = live_holdings(old, dead)
    plan = assign_slots((PipelineShape(3, 4, (1, 2, 1)),), units, holdings, profile)
    restore = restore_plan(holdings, plan, profile)
    have = {r: set(units_) if r not in dead else set() for r, (_, units_) in old.holdings().items()}
    for t in restore.transfers:
        assert t.src not in dead
        assert holdings[t.src][0] == next(i for _, _, i, r in plan.slots() if r == t.dst)
        assert t.layer in holdings[t.src][1]
        if t.kind == "params":
            have[t.dst].add(t.layer)
    for j, s, i, rank in plan.slots():
        assert set(plan.pipelines[j].stage_units(s)) <= have[rank]
    assert not restore.unrecoverable
    kinds = {(t.layer, t.dst): set() for t in restore.transfers}
    for t in restore.transfers:
        kinds[(t.layer, t.dst)].add(t.kind)
    assert all(k == {"params", "optimizer"} for k in kinds.values())


def test_transition_is_regroup_plus_busiest_rank():
    profile = make_profile(2, transfer_bw=2.0, regroup=5.0)  # state 3 bytes per layer
    old = UniformLayout(tp=1, pp=2, dp=2).to_plan(2, 4)  # 0,1 stage 0; 2,3 stage 1
    holdings = live_holdings(old, {3})
    plan = assign_slots((PipelineShape(1, 4, (2,)),), [(0,), (1,), (2,)], holdings, profile)
    restore = restore_plan(holdings, plan, profile)
    # the single stage needs layers 0 and 1: a rank of stage 0 lacks layer 1 (3 bytes)
    assert restore.bytes_moved() == pytest.approx(3.0)
    assert transition_s(restore, profile) == pytest.approx(5.0 + 3.0 / 2.0)


def test_lost_layers_make_the_plan_unrecoverable():
    profile = make_profile(4)
    old = UniformLayout(tp=1, pp=2, dp=1).to_plan(4, 2)  # a single pipeline
    holdings = live_holdings(old, {1})  # stage 1 (layers 2, 3 and output) is gone
    plan = assign_slots((PipelineShape(1, 2, (4,)),), [(0,)], holdings, profile)
    restore = restore_plan(holdings, plan, profile)
    assert restore.unrecoverable
    assert restore.lost == ((2, 0), (3, 0), (OUTPUT, 0))


def test_uniform_plan_reduces_in_one_round():
    plan = UniformLayout(tp=2, pp=3, dp=4).to_plan(6, 8)
    groups = allreduce_groups(plan, make_profile(6, tp=2))
    assert len(groups) == 3 * 2 and len(allreduce_rounds(plan, make_profile(6, tp=2))) == 1
    assert all(len(g.ranks) == 4 for g in groups)


@pytest.mark.parametrize("seed", range(20))
def test_rounds_are_a_valid_colouring_of_random_heterogeneous_plans(seed):
    rng = random.Random(seed)
    L, tp = rng.randint(3, 8), rng.choice([1, 2])
    units = [tuple(range(u * tp, (u + 1) * tp)) for u in range(rng.randint(3, 10))]
    plan = random_plan(rng, L, units, tp)
    groups = allreduce_groups(plan, make_profile(L, tp=tp))
    rounds = allreduce_rounds(plan, make_profile(L, tp=tp))
    assert sorted(g for r in rounds for g in r) == list(range(len(groups)))
    for r in rounds:
        ranks = [rank for g in r for rank in groups[g].ranks]
        assert len(ranks) == len(set(ranks)), "a rank is in two groups of one round"
    # every (state unit, tp index) held more than once is reduced by exactly its holders
    holders = {}
    for j, s, i, rank in plan.slots():
        for u in plan.pipelines[j].stage_units(s):
            holders.setdefault((u, i), set()).add(rank)
    covered = {(u, i) for (u, i), h in holders.items() if len(h) > 1}
    for g in groups:
        for u in g.layers:
            matches = [key for key in covered if key[0] == u and holders[key] == set(g.ranks)]
            assert matches
    assert sum(len(g.layers) for g in groups) == len(covered)
