"""Layouts and plans: megatron's rank order and layer assignment, validation."""

import pytest

from chameleon_megatron.resilience.decision.layout import (
    EMBEDDING, OUTPUT, Pipeline, Plan, Stage, UniformLayout, contiguous_layers,
    interleaved_layers, megatron_split,
)

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("tp,pp,dp", [(2, 2, 2), (1, 4, 2), (4, 2, 3), (2, 3, 1)])
def test_rank_order_matches_megatron_rank_generator(tp, pp, dp):
    from megatron.core.parallel_state import RankGenerator

    gen = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    layout = UniformLayout(tp=tp, pp=pp, dp=dp)
    for group in gen.get_ranks("tp"):
        coords = [layout.coords(r) for r in group]
        assert [c[0] for c in coords] == list(range(tp))
        assert len({c[1:] for c in coords}) == 1
    for group in gen.get_ranks("pp"):
        assert [layout.coords(r)[2] for r in group] == list(range(pp))
    for group in gen.get_ranks("dp"):
        assert [layout.coords(r)[1] for r in group] == list(range(dp))
    assert sorted(layout.tp_groups()) == sorted(tuple(g) for g in gen.get_ranks("tp"))


def test_rank_and_coords_by_hand():
    layout = UniformLayout(tp=2, pp=2, dp=2)
    assert layout.rank(tp_rank=1, dp_rank=0, pp_rank=1) == 5
    assert layout.coords(6) == (0, 1, 1)
    with pytest.raises(ValueError, match="rank=8"):
        layout.coords(8)


def test_to_plan_stages_microbatches_and_end_layers():
    plan = UniformLayout(tp=2, pp=2, dp=2).to_plan(num_layers=6, global_microbatches=8)
    assert plan.depths == (2, 2)
    assert [p.microbatches for p in plan.pipelines] == [4, 4]
    assert plan.pipelines[1].stages[0] == Stage(layers=(0, 1, 2), ranks=(2, 3))
    assert plan.pipelines[1].stages[1] == Stage(layers=(3, 4, 5), ranks=(6, 7))
    holdings = plan.holdings()
    assert holdings[3] == (1, (0, 1, 2, EMBEDDING))
    assert holdings[6] == (0, (3, 4, 5, OUTPUT))
    assert plan.is_uniform and plan.tp == 2 and plan.microbatches == 8


def test_interleaved_layers_by_hand():
    assert interleaved_layers(8, pp=2, vpp=2) == ((0, 1, 4, 5), (2, 3, 6, 7))
    plan = UniformLayout(tp=1, pp=2, dp=1, vpp=2).to_plan(8, 4)
    assert plan.pipelines[0].stages[1].layers == (2, 3, 6, 7)
    with pytest.raises(ValueError, match="not divisible"):
        interleaved_layers(6, pp=2, vpp=2)


def test_megatron_split_first_last_and_errors():
    assert megatron_split(10, 4, first=1, last=3) == (1, 3, 3, 3)
    assert megatron_split(8, 4) == (2, 2, 2, 2)
    assert megatron_split(7, 2, first=3) == (3, 4)
    with pytest.raises(ValueError, match="divide evenly"):
        megatron_split(10, 4, first=1, last=2)


def _plan(*pipes, vpp=1, layers=4):
    return Plan(num_layers=layers, vpp=vpp, pipelines=tuple(
        Pipeline(stages=tuple(Stage(layers=ls, ranks=rs) for ls, rs in stages), microbatches=m)
        for stages, m in pipes))


def test_heterogeneous_plan_and_round_trip():
    plan = _plan(([((0, 1), (0,)), ((2, 3), (1,))], 3), ([((0, 1, 2, 3), (2,))], 1))
    assert plan.depths == (2, 1) and not plan.is_uniform
    assert Plan.from_dict(plan.to_dict()) == plan
    assert plan.describe() == "1x(d2,m3) + 1x(d1,m1), tp1"


@pytest.mark.parametrize("stages,microbatches,match", [
    ([((0, 1), (0,)), ((2, 3), (0,))], 1, "appears in two slots"),
    ([((0, 1), (0,)), ((3,), (1,))], 1, "contiguous"),
    ([((0, 1), (0,)), ((2, 3), (1, 2))], 1, "expected tp=1"),
    ([((0, 1, 2, 3), (0,))], 0, "microbatches=0"),
])
def test_plan_validation_names_the_problem(stages, microbatches, match):
    with pytest.raises(ValueError, match=match):
        _plan((stages, microbatches))


def test_interleaved_plan_needs_multiple_of_depth_microbatches():
    with pytest.raises(ValueError, match="multiple of depth"):
        UniformLayout(tp=1, pp=2, dp=1, vpp=2).to_plan(8, 3)


def test_contiguous_layers():
    assert contiguous_layers((2, 1, 3)) == ((0, 1), (2,), (3, 4, 5))
