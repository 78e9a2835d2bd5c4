"""Lightweight signature: change detection per stage, including equal-length changes."""

from __future__ import annotations

import pytest

from chameleon_megatron.swap.signature import StageStats, StepSignature, changed_stages

pytestmark = pytest.mark.timeout(30)

A, B, C = ("F", 0, 0, 1), ("F", 0, 0, 2), ("B", 0, 0, 1)


def _sig(stages: dict[tuple, list[tuple[int, int]]]) -> StepSignature:
    stats = {}
    for key, seq in stages.items():
        stats[key] = StageStats(key)
        for code, nbytes in seq:
            stats[key].add(code, nbytes)
    return StepSignature.of(stats)


def test_same_sequence_is_unchanged():
    seq = [(1, 100), (2, 50), (3, 10)]
    assert changed_stages(_sig({A: seq, B: seq}), _sig({A: seq, B: seq}), 0.0) == ()


def test_reordered_operators_of_equal_count_and_bytes_are_a_change():
    ref = _sig({A: [(1, 100), (2, 100)], B: [(1, 10)]})
    cur = _sig({A: [(2, 100), (1, 100)], B: [(1, 10)]})
    r, c = ref.stages[A], cur.stages[A]
    assert (r.count, r.nbytes) == (c.count, c.nbytes)
    assert changed_stages(ref, cur, 0.5) == (A,)


def test_a_different_operator_at_equal_length_is_a_change():
    ref = _sig({A: [(1, 100), (2, 100), (3, 100)]})
    cur = _sig({A: [(1, 100), (4, 100), (3, 100)]})
    assert changed_stages(ref, cur, 0.5) == (A,)


def test_size_changes_count_beyond_the_tolerance_only():
    ref = _sig({A: [(1, 1000), (2, 1000)]})
    moved = _sig({A: [(1, 1200), (2, 800)]})  # MoE-like: bytes moved, total kept
    grown = _sig({A: [(1, 1040), (2, 1040)]})  # +4 %
    doubled = _sig({A: [(1, 2000), (2, 2000)]})  # sequence length doubled
    assert changed_stages(ref, moved, 0.05) == ()
    assert changed_stages(ref, grown, 0.05) == ()
    assert changed_stages(ref, grown, 0.03) == (A,)
    assert changed_stages(ref, doubled, 0.05) == (A,)


def test_stages_that_appear_or_vanish_are_changes():
    ref = _sig({A: [(1, 10)], B: [(1, 10)]})
    cur = _sig({A: [(1, 10)], C: [(1, 10)]})
    assert changed_stages(ref, cur, 0.0) == (C, B)  # sorted: 'B' < 'F'


def test_history_holds_the_two_previous_codes():
    s = StageStats(A)
    for code in (5, 6, 7):
        s.add(code, 1)
    assert s.history() == (6 << 16) | 7
