"""Policy generator: brute-force oracle on small profiles, invariants on random ones."""

from __future__ import annotations

import itertools
import random

import pytest

from chameleon_megatron.swap.policy import BudgetError, generate_policy, min_feasible_budget
from chameleon_megatron.swap.profile import FREE, PACK, USE, StepProfile

from profiles import make_profile, random_profile

pytestmark = pytest.mark.timeout(120)

INF = float("inf")


# ---------------------------------------------------------------- an independent oracle
def _windows(p: StepProfile, min_bytes: int, bw: float) -> dict[int, tuple[int, int]]:
    """uid -> (out, prefetch) for every candidate with a non-empty window, by plain loops."""
    t = p.event_times
    out = {}
    for r in p.records:
        if not (r.swappable and r.nbytes >= min_bytes and r.use_event > r.pack_event):
            continue
        copy = r.nbytes / bw
        o = next((e for e in range(r.pack_event, p.num_events) if t[e] >= t[r.pack_event] + copy),
                 p.num_events)
        anchors = [e for e in range(r.use_event) if p.events[e][1] != FREE
                   and t[r.use_event] - t[e] >= copy]
        if anchors and o < anchors[-1]:
            out[r.uid] = (o, anchors[-1])
    return out


def _curve(p: StepProfile, swapped: dict[int, tuple[int, int]]) -> list[int]:
    """Resident bytes after each event."""
    curve = []
    for e in range(p.num_events):
        total = 0
        for r in p.records:
            alive = r.pack_event <= e and (r.free_event < 0 or e < r.free_event)
            gone = r.uid in swapped and swapped[r.uid][0] <= e < swapped[r.uid][1]
            total += r.nbytes if alive and not gone else 0
        curve.append(total)
    return curve


def _oracle(p: StepProfile, budget: int, min_bytes: int, bw: float) -> int | None:
    """Least swapped bytes over every subset of candidates that meets the budget."""
    wins = _windows(p, min_bytes, bw)
    best = None
    uids = sorted(wins)
    for k in range(len(uids) + 1):
        for subset in itertools.combinations(uids, k):
            cost = sum(p.records[u].nbytes for u in subset)
            if best is not None and cost >= best:
                continue
            if max(_curve(p, {u: wins[u] for u in subset}), default=0) <= budget:
                best = cost
    return best


def _plan_curve(p: StepProfile, plan) -> list[int]:
    return _curve(p, {d.uid: (d.out_event, d.prefetch_event) for d in plan.decisions})


# ---------------------------------------------------------------- oracle comparisons
def _hard_cases(seed: int, count: int, min_bytes: int):
    """Random small profiles with a budget below their peak that some plan can meet."""
    rng = random.Random(seed)
    found = 0
    while found < count:
        p = random_profile(rng, rng.randint(3, 9))
        peak = max(_curve(p, {}))
        floor = max(_curve(p, _windows(p, min_bytes, INF)))
        if floor < peak:
            found += 1
            yield rng, p, rng.randint(max(floor, 1), peak - 1)


def test_minimum_bytes_equal_brute_force_with_instant_copies():
    for _, p, budget in _hard_cases(seed=0, count=40, min_bytes=10):
        plan = generate_policy(p, budget_bytes=budget, bandwidth_bps=INF, min_bytes=10)
        assert plan.planned_out_bytes == _oracle(p, budget, 10, INF) > 0
        assert plan.optimal
        assert max(_plan_curve(p, plan)) <= budget


def test_minimum_bytes_equal_brute_force_with_finite_bandwidth():
    branches = {"overlapped": 0, "stalled": 0}
    for rng, p, budget in _hard_cases(seed=1, count=40, min_bytes=0):
        bw = rng.choice([20.0, 50.0, 200.0])
        plan = generate_policy(p, budget_bytes=budget, bandwidth_bps=bw, min_bytes=0)
        feasible_with_bw = _oracle(p, budget, 0, bw)
        if feasible_with_bw is not None:  # copies fit in compute: that optimum
            assert plan.planned_out_bytes == feasible_with_bw
            branches["overlapped"] += 1
        else:  # they cannot: the instant-copy optimum, with a stated stall
            assert plan.planned_out_bytes == _oracle(p, budget, 0, INF)
            assert plan.expected_stall_s > 0
            branches["stalled"] += 1
        assert max(_plan_curve(p, plan)) <= budget
    assert min(branches.values()) >= 5, branches


# ---------------------------------------------------------------- invariants
@pytest.mark.parametrize("seed", range(25))
def test_invariants_on_random_profiles(seed):
    rng = random.Random(5000 + seed)
    p = random_profile(rng, rng.randint(20, 60), max_bytes=1 << 20)
    min_bytes = rng.choice([0, 1 << 10, 1 << 18])
    bw = rng.choice([INF, 1e5, 1e6, 1e7])
    no_swap = _curve(p, {})
    floor = max(_curve(p, _windows(p, min_bytes, INF)))
    assert min_feasible_budget(p, min_bytes) == max(floor, 0)
    budgets = sorted({max(floor, 1), (max(floor, 1) + max(no_swap)) // 2, max(no_swap)})
    previous = None
    for budget in reversed(budgets):  # falling budgets swap no fewer bytes
        plan = generate_policy(p, budget_bytes=budget, bandwidth_bps=bw, min_bytes=min_bytes)
        curve = _plan_curve(p, plan)
        assert max(curve) <= budget
        assert plan.planned_peak_bytes == max(curve)
        assert plan.no_swap_peak_bytes == max(no_swap)
        assert plan.lower_bound_bytes <= plan.planned_out_bytes
        for d in plan.decisions:
            r = p.records[d.uid]
            assert r.swappable and r.nbytes >= min_bytes and d.nbytes == r.nbytes
            assert r.pack_event <= d.out_event < d.prefetch_event < r.use_event
            assert p.events[d.prefetch_event] == d.prefetch_anchor
            assert d.prefetch_anchor[1] in (PACK, USE)
        if budget >= max(no_swap):
            assert plan.decisions == ()
        if previous is not None and plan.optimal:
            assert plan.planned_out_bytes >= previous
        previous = plan.planned_out_bytes if plan.optimal else None


def test_budget_below_what_can_be_swapped_is_a_clear_error():
    # A (50 B, swappable) lives across B (40 B, not swappable); C (empty) is an anchor
    # after B's release at which A can come back.
    events = [(0, PACK), (1, PACK), (1, USE), (1, FREE), (2, PACK), (0, USE), (0, FREE),
              (2, USE), (2, FREE)]
    p = make_profile([(50, True), (40, False), (0, False)], events)
    assert min_feasible_budget(p, 0) == 50  # A itself once it is back
    plan = generate_policy(p, budget_bytes=50, bandwidth_bps=INF, min_bytes=0)
    assert plan.planned_out_bytes == 50 and plan.planned_peak_bytes == 50
    with pytest.raises(BudgetError, match="budget 49 bytes is below the least achievable 50"):
        generate_policy(p, budget_bytes=49, bandwidth_bps=INF, min_bytes=0)
    with pytest.raises(BudgetError, match="least achievable 90"):  # A now below the threshold
        generate_policy(p, budget_bytes=60, bandwidth_bps=INF, min_bytes=51)


def test_stall_is_stated_when_copies_cannot_overlap():
    # A (100 B) must be off the device while B (60 B) lives; at 50 B/s a copy takes 2 s
    # but only 1 s of compute separates A's pack from B's. C (1 B) packs after B's release.
    events = [(0, PACK), (1, PACK), (1, USE), (1, FREE), (2, PACK), (0, USE), (0, FREE),
              (2, USE), (2, FREE)]
    p = make_profile([(100, True), (60, False), (1, False)], events,
                     times=[0, 1, 2, 2, 2, 3, 3, 4, 4])
    plan = generate_policy(p, budget_bytes=101, bandwidth_bps=50.0, min_bytes=0)
    d, = plan.decisions
    assert (d.uid, d.out_event, d.prefetch_event, d.prefetch_anchor) == (0, 0, 4, (2, PACK))
    # Out copy 0..2 s: compute waits 2 s at the pack. The copy back starts at C's pack
    # (t = 2 + 2 = 4) and ends at 6; A's use comes at 3 + 2 = 5: another 1 s.
    assert plan.expected_stall_s == pytest.approx(3.0)
    assert plan.planned_peak_bytes == 101


def test_no_stall_when_copies_fit_in_compute():
    events = [(0, PACK), (1, PACK), (2, PACK), (2, USE), (2, FREE), (1, USE), (1, FREE),
              (0, USE), (0, FREE)]
    p = make_profile([(100, True), (10, False), (10, False)], events,
                     times=[0, 4, 8, 8, 12, 12, 12, 20, 20])
    plan = generate_policy(p, budget_bytes=110, bandwidth_bps=50.0, min_bytes=0)  # 2 s copies
    d, = plan.decisions
    # Off from B's pack (the first event 2 s after A's) until B's use (8 s before A's).
    assert (d.uid, d.out_event, d.prefetch_event) == (0, 1, 5)
    assert plan.expected_stall_s == 0.0
    assert plan.planned_peak_bytes == 110
