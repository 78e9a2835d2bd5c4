"""The 1F1B longest path (Eq. 9/11) against hand values and an independent event simulation."""

import heapq
import random

import numpy as np
import pytest

from chameleon_megatron.resilience.decision.schedule import (
    compile_schedule,
    pipeline_lower_bound,
    pipeline_time,
)

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("d,m", [(1, 1), (1, 5), (2, 1), (3, 2), (4, 4), (4, 9), (8, 3)])
def test_equal_stages_give_eq9(d, m):
    f, b = 0.7, 1.9
    assert pipeline_time([f] * d, [b] * d, m, 0.0) == pytest.approx((d + m - 1) * (f + b))


@pytest.mark.parametrize("p,v,m", [(2, 2, 2), (2, 2, 6), (3, 2, 6), (4, 2, 8), (4, 3, 12)])
def test_interleaved_equal_stages_give_the_interleaved_bubble(p, v, m):
    """Per physical stage f + b = 3; the bubble shrinks to (p - 1) / v of a stage."""
    t = pipeline_time([1.0 / v] * (p * v), [2.0 / v] * (p * v), m, 0.0, vpp=v)
    assert t == pytest.approx((m + (p - 1) / v) * 3.0)


def test_two_stages_one_microbatch_with_hops_by_hand():
    # F0, hop, F1, B1, hop, B0
    assert pipeline_time([2.0, 3.0], [4.0, 5.0], 1, 1.5) == pytest.approx(2 + 1.5 + 3 + 5 + 1.5 + 4)


def event_simulation(fwd, bwd, m, hop):
    """1F1B replayed in time order: a stage runs its next op (warm-up forwards, then
    one forward one backward, then the remaining backwards) once its input has arrived."""
    d = len(fwd)
    queues = []
    for s in range(d):
        w = min(d - s - 1, m)
        ops = [("F", j) for j in range(w)]
        for i in range(m - w):
            ops += [("F", w + i), ("B", i)]
        queues.append(ops + [("B", j) for j in range(m - w, m)])
    arrived = {("F", 0, j): 0.0 for j in range(m)}
    free = [0.0] * d
    heap = []  # (start time, stage) of each stage's next runnable op

    def offer(s):
        if queues[s]:
            kind, j = queues[s][0]
            if (kind, s, j) in arrived:
                heapq.heappush(heap, (max(free[s], arrived[(kind, s, j)]), s))

    for s in range(d):
        offer(s)
    while heap:
        start, s = heapq.heappop(heap)
        kind, j = queues[s].pop(0)
        free[s] = end = start + (fwd[s] if kind == "F" else bwd[s])
        if kind == "F" and s + 1 < d:
            arrived[("F", s + 1, j)] = end + hop
            if len(queues[s + 1]) and queues[s + 1][0] == ("F", j):
                offer(s + 1)
        elif kind == "F":
            arrived[("B", s, j)] = end
        elif s > 0:
            arrived[("B", s - 1, j)] = end + hop
            if queues[s - 1] and queues[s - 1][0] == ("B", j):
                offer(s - 1)
        offer(s)
    assert not any(queues), "event simulation stalled"
    return max(free)


def test_longest_path_matches_event_simulation_on_random_pipelines():
    rng = random.Random(7)
    for _ in range(300):
        d, m = rng.randint(1, 6), rng.randint(1, 9)
        fwd = [rng.uniform(0.2, 2.0) for _ in range(d)]
        bwd = [rng.uniform(0.2, 4.0) for _ in range(d)]
        hop = rng.choice([0.0, 0.05, 0.7])
        assert pipeline_time(fwd, bwd, m, hop) == pytest.approx(event_simulation(fwd, bwd, m, hop))


def test_lower_bound_is_valid_and_tight_for_equal_stages():
    rng = random.Random(3)
    for _ in range(600):
        d, m = rng.randint(1, 8), rng.randint(1, 40)
        fwd = [rng.uniform(0.2, 2.0) for _ in range(d)]
        bwd = [rng.uniform(0.2, 4.0) for _ in range(d)]
        hop = rng.choice([0.0, 0.3, 1.0])
        bound = float(pipeline_lower_bound(fwd, bwd, m, hop))
        assert bound <= pipeline_time(fwd, bwd, m, hop) + 1e-9
    for d, m, hop in [(4, 9, 0.0), (6, 20, 0.0), (3, 2, 0.0), (14, 169, 0.01)]:
        exact = pipeline_time([1.0] * d, [2.0] * d, m, hop)
        assert float(pipeline_lower_bound([1.0] * d, [2.0] * d, m, hop)) == pytest.approx(exact)


def test_many_splits_are_timed_as_each_alone():
    rng = np.random.default_rng(5)
    schedule = compile_schedule(5, 1, 9)
    fwd, bwd = rng.uniform(0.2, 2.0, (7, 5)), rng.uniform(0.2, 4.0, (7, 5))
    got = schedule.times(fwd, bwd, 0.3)
    assert got.tolist() == [schedule.time(f.tolist(), b.tolist(), 0.3) for f, b in zip(fwd, bwd)]


def test_the_bound_counts_the_first_round_trip_of_heavy_early_stages():
    """Five 8-layer stages before eight 7-layer ones: each early stage waits for microbatch
    0's round trip, then still has every backward to run. Without that term the bound is
    3.6 % under the step; with it, 1 %."""
    c = np.array([8.0] * 5 + [7.0] * 8)
    fwd, bwd = c / 3, 2 * c / 3
    exact = pipeline_time(list(fwd), list(bwd), 157, 0.0)
    assert exact - float(pipeline_lower_bound(fwd, bwd, 157, 0.0)) < 0.012 * exact


def test_the_bound_counts_neighbouring_heavy_stages():
    """The same stages with a hop a third of a layer's compute: five heavy stages in a row
    hand each microbatch on at a hop's cost, which the window of them bounds (within 0.1 %;
    the stages' own terms alone stay 4.8 % under)."""
    c = np.array([8.0] * 5 + [7.0] * 8)
    fwd, bwd = c / 3, 2 * c / 3
    exact = pipeline_time(list(fwd), list(bwd), 157, 0.3)
    assert exact - float(pipeline_lower_bound(fwd, bwd, 157, 0.3)) < 0.001 * exact
