"""The covering solvers behind the policy: bound, sweep, scale."""

from __future__ import annotations

import random
import time

import numpy as np
import pytest
from scipy.optimize import linprog

from chameleon_megatron.swap.cover import (
    _constraint_rows, _cover_matrix, fractional_bound, sweep_cover,
)
from chameleon_megatron.swap.policy import generate_policy, min_feasible_budget
from chameleon_megatron.swap.windows import candidate_windows, coverage, resident_curve

from profiles import random_profile

pytestmark = pytest.mark.timeout(60)


def _instances(count: int, seed: int, n=(5, 40)):
    rng = random.Random(seed)
    while count:
        p = random_profile(rng, rng.randint(*n), max_bytes=1000)
        resident = resident_curve(p)
        floor, peak = min_feasible_budget(p, 0), int(resident.max())
        if floor < peak:
            count -= 1
            yield p, resident - rng.randint(max(floor, 1), peak - 1)


def test_fractional_sweep_is_the_linear_relaxation_optimum():
    for p, excess in _instances(60, seed=3):
        w = candidate_windows(p, 0, float("inf"))
        spans, need = _constraint_rows(w, excess)
        lp = linprog(w.nbytes.astype(float), A_ub=-_cover_matrix(w, spans).tocsr(),
                     b_ub=-np.asarray(need, dtype=float), bounds=(0, 1), method="highs")
        assert fractional_bound(w, excess) == pytest.approx(lp.fun, rel=1e-9)


def test_sweep_covers_every_event_and_keeps_nothing_redundant():
    for p, excess in _instances(60, seed=4):
        w = candidate_windows(p, 0, float("inf"))
        chosen = sweep_cover(w, excess)
        cover = coverage(w.subset(chosen), len(excess))
        assert (cover >= excess).all()
        for j in np.nonzero(chosen)[0]:  # removing any one breaks some event
            o, q = w.out_event[j], w.prefetch_event[j]
            assert (cover[o:q] - w.nbytes[j] < excess[o:q]).any()
        assert w.nbytes[chosen].sum() >= fractional_bound(w, excess) - 1e-6


def test_a_large_profile_is_planned_in_well_under_a_second():
    rng = random.Random(7)
    p = random_profile(rng, 3000, max_bytes=1 << 24)
    budget = (min_feasible_budget(p, 0) + int(resident_curve(p).max())) // 2
    start = time.process_time()
    plan = generate_policy(p, budget_bytes=budget, bandwidth_bps=float("inf"), min_bytes=0)
    assert time.process_time() - start < 1.0
    assert plan.planned_peak_bytes <= budget
    assert plan.planned_out_bytes <= 1.05 * plan.lower_bound_bytes
