"""Algorithm 1 against brute-force enumeration of the same space on small clusters."""

import dataclasses
import itertools
import math
import random

import numpy as np
import pytest
from dc_helpers import cost, make_profile

from chameleon_megatron.resilience.decision.layout import Pipeline, Plan, Stage, contiguous_layers
from chameleon_megatron.resilience.decision.perf_model import hop_s, plan_step
from chameleon_megatron.resilience.decision.planner import Planner, SearchOptions
from chameleon_megatron.resilience.decision.schedule import compile_schedule
from chameleon_megatron.resilience.decision.splits import SplitSearch

pytestmark = pytest.mark.timeout(120)


def splits(L, d):
    """Every split into d contiguous stages of at least one layer."""
    return [tuple(e - s for s, e in zip((0, *cuts), (*cuts, L)))
            for cuts in itertools.combinations(range(1, L), d - 1)]


def megatron_form(split):
    """The old search space: first a, middle stages k each, last b."""
    return len(set(split[1:-1])) <= 1


def multisets(n, lo, hi, pmin, pmax, min_sum):
    for p in range(pmin, pmax + 1):
        for depths in itertools.combinations_with_replacement(range(hi, lo - 1, -1), p):
            if min_sum <= sum(depths) <= n:
                yield depths


def batch_splits(depths, M):
    D = sum(depths)
    floors = [M * d // D for d in depths]
    extra = M - sum(floors)
    for chosen in itertools.combinations(range(len(depths)), extra):
        ms = [f + (j in chosen) for j, f in enumerate(floors)]
        if min(ms) >= 1:
            yield ms


def build(depths, ms, layer_splits, L, tp):
    rank = itertools.count()
    return Plan(num_layers=L, pipelines=tuple(
        Pipeline(stages=tuple(Stage(layers, tuple(next(rank) for _ in range(tp)))
                              for layers in contiguous_layers(split)), microbatches=m)
        for split, m in zip(layer_splits, ms)))


def brute_force(profile, n, opts, keep=lambda split: True):
    """The fastest plan of the search space (its splits restricted to ``keep``)."""
    L, M, best = profile.num_layers, profile.global_microbatches, math.inf
    hi = min(opts.max_depth or L, n)
    idle = n if opts.max_idle_units is None else opts.max_idle_units
    for depths in multisets(n, opts.min_depth, hi, opts.min_pipelines,
                            min(opts.max_pipelines or n, M), n - idle):
        if opts.uniform and len(set(depths)) > 1:
            continue
        options = [[(L // d,) * d] if opts.uniform else list(filter(keep, splits(L, d)))
                   for d in depths]
        if opts.uniform and L % depths[0]:
            continue
        for ms in batch_splits(depths, M):
            if opts.uniform and len(set(ms)) > 1:
                continue
            for chosen in itertools.product(*options):
                est = plan_step(build(depths, ms, chosen, L, profile.tp), profile)
                if est.fits_memory:
                    best = min(best, est.t_step_s)
    return best


def random_profile(rng, L, M, tp):
    layers = [cost(f=rng.uniform(0.5, 1.5), b=rng.uniform(1.0, 3.0), param=rng.uniform(1, 4),
                   opt=rng.uniform(1, 4), act=rng.uniform(0.5, 2)) for _ in range(L)]
    static = sum(2 * c.param_bytes + c.optimizer_bytes for c in layers)
    return make_profile(layers=layers, tp=tp, gbs=M, embedding=cost(0.3, 0.6, 3, 3, 1),
                        output=cost(0.8, 1.6, 3, 3, 2), boundary=1.0, p2p_bw=rng.choice([5.0, 1e9]),
                        ar_bw=rng.uniform(1.0, 8.0), latency=0.01,
                        memory=rng.uniform(0.45, 1.2) * static)


def gradient_heavy_profile(rng, L, M, tp):
    """Some layers with 16x the gradient bytes and a slow all-reduce: the fastest split of
    a pipeline is not always the best once the gradient sync is counted."""
    layers = [cost(f=rng.uniform(0.5, 1.5), b=rng.uniform(1.0, 3.0),
                   param=rng.choice([0.5, 8.0]), opt=1, act=0.5) for _ in range(L)]
    return make_profile(layers=layers, tp=tp, gbs=M, boundary=1.0, p2p_bw=1e9,
                        ar_bw=rng.uniform(0.5, 2.0))


def swapping_profile(rng, L, M, tp):
    """Memory too small for most plans as they are, and a swap bandwidth: stages over it fit
    by swapping, at the stall of their copies (a copy as slow as a layer's compute, or more)."""
    layers = [cost(f=rng.uniform(0.5, 1.5), b=rng.uniform(1.0, 3.0), param=rng.uniform(1, 2),
                   opt=rng.uniform(1, 2), act=rng.uniform(1, 4)) for _ in range(L)]
    static = sum(2 * c.param_bytes + c.optimizer_bytes for c in layers)
    return make_profile(layers=layers, tp=tp, gbs=M, boundary=1.0, p2p_bw=1e9,
                        ar_bw=rng.uniform(1.0, 8.0), memory=rng.uniform(0.4, 0.7) * static,
                        swap_bw=rng.uniform(0.5, 3.0))


CASES = [  # (seed, layers, microbatches, units, tp, options, profile)
    (1, 5, 7, 6, 1, SearchOptions(), random_profile),
    (52, 5, 9, 6, 2, SearchOptions(), random_profile),  # 12 devices
    (1, 6, 8, 8, 1, SearchOptions(min_depth=2), random_profile),
    (8, 4, 6, 6, 1, SearchOptions(max_idle_units=1, min_pipelines=2), random_profile),
    (1, 6, 12, 6, 2, SearchOptions(uniform=True), random_profile),  # 12 devices
    (22, 5, 10, 7, 1, SearchOptions(max_pipelines=3), random_profile),
    (3, 6, 8, 7, 1, SearchOptions(max_idle_units=0, min_pipelines=2), random_profile),
    (18, 5, 6, 4, 1, SearchOptions(), gradient_heavy_profile),
    (40, 5, 6, 4, 2, SearchOptions(), gradient_heavy_profile),  # 8 devices
    (1, 5, 8, 5, 1, SearchOptions(), swapping_profile),
    (7, 6, 8, 6, 1, SearchOptions(), swapping_profile),
    (9, 6, 8, 6, 1, SearchOptions(max_depth=4), swapping_profile),
    (8, 6, 8, 5, 1, SearchOptions(), random_profile),
    (16, 6, 8, 7, 1, SearchOptions(), swapping_profile),
]


@pytest.mark.parametrize("seed,L,M,n,tp,opts,factory", CASES)
def test_search_finds_the_brute_force_optimum(seed, L, M, n, tp, opts, factory):
    profile = factory(random.Random(seed), L, M, tp)
    expected = brute_force(profile, n, opts)
    result = Planner(profile, opts).search(n)
    if math.isinf(expected):
        assert result.pipelines is None and "fits memory" in result.reason
        return
    assert result.complete
    assert result.t_step_s == pytest.approx(expected, rel=1e-12)
    shape = result.pipelines
    plan = build([p.depth for p in shape], [p.microbatches for p in shape],
                 [p.layer_counts for p in shape], L, tp)
    assert plan_step(plan, profile).t_step_s == pytest.approx(expected, rel=1e-12)
    assert len(plan.ranks()) <= n * tp and plan.microbatches == M


def test_cases_exercise_heterogeneous_optima_and_memory_pruning():
    """Guards the cases above against being trivial: some optimum mixes depths or uneven
    splits, and some plans are pruned by memory."""
    mixed = pruned = uneven = 0
    for seed, L, M, n, tp, opts, factory in CASES:
        profile = factory(random.Random(seed), L, M, tp)
        shape = Planner(profile, opts).search(n).pipelines or ()
        mixed += len({(p.depth, p.layer_counts) for p in shape}) > 1
        pruned += profile.device_memory_bytes < sum(2 * c.param_bytes + c.optimizer_bytes
                                                    for c in profile.layers)
        uneven += any(not megatron_form(p.layer_counts) for p in shape)
    assert mixed >= 3 and pruned >= 5 and uneven >= 2


@pytest.mark.parametrize("case", [7, 12])
def test_splits_outside_the_first_middle_last_form_win(case):
    """These optima have stages of unequal middle stages (case 7: a 2-layer stage between
    1-layer ones): every plan whose splits have equal middle stages is slower."""
    seed, L, M, n, tp, opts, factory = CASES[case]
    profile = factory(random.Random(seed), L, M, tp)
    found = Planner(profile, opts).search(n)
    assert any(not megatron_form(p.layer_counts) for p in found.pipelines)
    assert found.t_step_s < brute_force(profile, n, opts, keep=megatron_form)


def test_swap_cases_plan_stages_over_memory_and_pay_their_stall():
    """The swapping cases are not trivial: their optimum swaps on some stage, and swapping is
    what makes it feasible (without a swap bandwidth the same plan does not fit)."""
    swapped = stalled = 0
    for seed, L, M, n, tp, opts, factory in CASES:
        if factory is not swapping_profile:
            continue
        profile = factory(random.Random(seed), L, M, tp)
        shape = Planner(profile, opts).search(n).pipelines
        plan = build([p.depth for p in shape], [p.microbatches for p in shape],
                     [p.layer_counts for p in shape], L, tp)
        est = plan_step(plan, profile)
        swapped += bool(est.swaps)
        stalled += any(s.stall_s > 0 for s in est.swaps.values())
        if est.swaps:
            no_swap = plan_step(plan, dataclasses.replace(profile, swap_bandwidth_Bps=0.0))
            assert est.fits_memory and not no_swap.fits_memory
            assert est.t_step_s >= no_swap.t_step_s
    assert swapped >= 2 and stalled >= 2


def test_deadline_returns_the_best_plan_so_far():
    profile = random_profile(random.Random(9), 6, 12, 1)
    full = Planner(profile).search(10)
    rushed = Planner(profile, SearchOptions(time_limit_s=0.0)).search(10)
    assert not rushed.complete and rushed.pipelines is not None
    assert rushed.t_step_s >= full.t_step_s


def test_nothing_fits_memory_is_reported():
    result = Planner(make_profile(4, gbs=4, memory=1.0)).search(4)
    assert result.pipelines is None and math.isinf(result.t_step_s)
    assert "fits memory" in result.reason


@pytest.mark.parametrize("kwargs,match", [
    (dict(min_depth=0), "min_depth=0"), (dict(min_depth=3, max_depth=2), "max_depth=2"),
    (dict(min_pipelines=2, max_pipelines=1), "max_pipelines=1"),
    (dict(max_idle_units=-1), "max_idle_units=-1"), (dict(time_limit_s=-1.0), "time_limit_s"),
])
def test_options_are_validated(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SearchOptions(**kwargs)


def every_split_time(profile, d, m):
    """The fastest pipeline time of (d, m) over every contiguous split, each timed."""
    L = profile.num_layers
    cut = np.array(splits(L, d)).cumsum(axis=1)
    starts = np.concatenate([np.zeros((len(cut), 1), dtype=int), cut[:, :-1]], axis=1)
    times = []
    for attr in ("forward_s", "backward_s"):
        cum = np.concatenate([[0.0], np.cumsum([getattr(c, attr) for c in profile.layers])])
        t = cum[cut] - cum[starts]
        t[:, 0] += getattr(profile.embedding, attr)
        t[:, -1] += getattr(profile.output, attr)
        times.append(t)
    return compile_schedule(d, 1, m).times(*times, hop_s(profile)).min()


@pytest.mark.parametrize("L,d,m,most", [(14, 6, 24, 15), (17, 7, 30, 10)])
def test_the_split_search_times_few_of_a_long_pipelines_splits(L, d, m, most, monkeypatch):
    """Equal layers that do not divide among the stages, slow links: many splits nearly
    tie. The search finds the fastest after timing a few, because its bound holds every
    window of neighbouring stages (without them: 20 of 1,287 and 72 of 8,008)."""
    profile = make_profile(L, gbs=m, boundary=1.0, p2p_bw=1.0, embedding=cost(0.3, 0.6),
                           output=cost(0.5, 1.0))
    timed = []
    time_them = SplitSearch._timed
    monkeypatch.setattr(SplitSearch, "_timed",
                        lambda self, best, starts: timed.append(len(starts))
                        or time_them(self, best, starts))
    front = Planner(profile).front(d, m)
    assert front.times[-1] == pytest.approx(every_split_time(profile, d, m), rel=1e-12)
    assert sum(timed) <= most


def test_a_replicated_search_keeps_two_pipelines_unless_only_one_fits():
    """A recovery's layout keeps a copy of every stage's state for the next failure: with
    a slow gradient sync one deep pipeline is fastest, and a replicated search still picks
    two or more; it takes one pipeline only when nothing else fits memory."""
    slow_sync = make_profile(8, gbs=4, ar_bw=1e-3)
    fastest = Planner(slow_sync).search(8)
    assert len(fastest.pipelines) == 1  # what the search would pick unreplicated
    replicated = Planner(slow_sync, SearchOptions(replicated=True)).search(8)
    assert len(replicated.pipelines) >= 2 and replicated.t_step_s > fastest.t_step_s
    uniform = Planner(slow_sync, SearchOptions(replicated=True, uniform=True)).search(8)
    assert len(uniform.pipelines) >= 2
    one_layer_stages = make_profile(4, gbs=4, memory=8.0)  # only one-layer stages fit
    only = Planner(one_layer_stages, SearchOptions(replicated=True)).search(4)
    assert [p.depth for p in only.pipelines] == [4]
