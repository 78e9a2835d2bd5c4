"""Swap-aware stage memory against numbers worked out by hand."""

import numpy as np
import pytest

from chameleon_megatron.resilience.decision.swap_model import stage_swap, swap_times

# static 10 B, 4 B of activations per microbatch, 3 in flight: 22 B at the peak.
STAGE = dict(static=10.0, act=4.0, in_flight=3, forward_s=1.0, backward_s=2.0, microbatches=8)


def test_a_stage_that_fits_needs_no_swap():
    assert stage_swap(**STAGE, cap=22.0, bandwidth_Bps=1.0) is None


def test_the_copies_hide_behind_compute_when_fast_enough():
    # cap 18: 4 B over, 2 B on the host per waiting microbatch; at 2 B/s a copy takes 1 s,
    # no more than the forward (1 s) or the backward (2 s): no stall.
    sw = stage_swap(**STAGE, cap=18.0, bandwidth_Bps=2.0)
    assert (sw.budget_bytes, sw.swapped_bytes, sw.forward_s, sw.backward_s, sw.stall_s) == \
        (8.0, 2.0, 1.0, 2.0, 0.0)
    assert sw.fraction == pytest.approx(8 / 12)


def test_slow_copies_stall_the_stage():
    # at 1 B/s a copy takes 2 s: the forward waits 1 s more, 8 microbatches: 8 s per step.
    sw = stage_swap(**STAGE, cap=18.0, bandwidth_Bps=1.0)
    assert (sw.forward_s, sw.backward_s, sw.stall_s) == (2.0, 2.0, 8.0)


def test_what_swapping_cannot_fit_is_refused():
    with pytest.raises(ValueError, match="one microbatch resident"):
        stage_swap(**STAGE, cap=13.0, bandwidth_Bps=1.0)  # 10 + 4 > 13
    with pytest.raises(ValueError, match="does not swap"):
        stage_swap(**STAGE, cap=18.0, bandwidth_Bps=0.0)


def test_the_array_form_agrees_with_the_scalar_one():
    f, b = np.array([[1.0, 1.0]]), np.array([[2.0, 2.0]])
    static, act = np.array([[10.0, 10.0]]), np.array([[4.0, 4.0]])
    inflight = np.array([3, 1])  # the last stage holds one microbatch: 14 B
    f2, b2, fits = swap_times(f, b, static, act, inflight, 18.0, 1.0)
    assert fits.tolist() == [[True, True]]
    assert f2.tolist() == [[2.0, 1.0]] and b2.tolist() == [[2.0, 2.0]]
    assert swap_times(f, b, static, act, inflight, 13.0, 1.0)[2].tolist() == [[False, False]]
    assert swap_times(f, b, static, act, inflight, 18.0, 0.0)[2].tolist() == [[False, True]]
