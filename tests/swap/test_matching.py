"""Fuzzy matching of live tensors to profile records."""

from __future__ import annotations

import pytest

from chameleon_megatron.swap.matching import MatchIndex
from chameleon_megatron.swap.profile import TensorRecord

pytestmark = pytest.mark.timeout(30)

S = ("F", 0, 0, 1)


def _rec(uid: int, ordinal: int, code: int, history: int, occurrence: int, nbytes: int,
         stage=S) -> TensorRecord:
    return TensorRecord(uid=uid, stage=stage, ordinal=ordinal, op="x", code=code,
                        history=history, occurrence=occurrence, nbytes=nbytes, shape=(nbytes,),
                        swappable=True, pack_event=uid, use_event=-1, free_event=-1,
                        device_bytes=0)


# A stage that saved: code 7 (4 KiB), code 8 (4 KiB), code 7 (4 KiB) again.
RECORDS = [_rec(0, 0, 7, 0, 0, 4096), _rec(1, 1, 8, 7, 0, 4096),
           _rec(2, 2, 7, (7 << 16) | 8, 0, 4096)]


def test_the_same_sequence_matches_by_position():
    index = MatchIndex(RECORDS)
    assert [index.match(S, r.ordinal, r.code, r.nbytes, r.history, r.occurrence)
            for r in RECORDS] == [0, 1, 2]


def test_changed_sizes_still_match_on_operator_and_history():
    index = MatchIndex(RECORDS)
    # Sequence length doubled: every size class moved.
    assert index.match(S, 1, 8, 8192, 7, 0) == 1
    assert index.match(S, 2, 7, 8192, (7 << 16) | 8, 0) == 2


def test_an_inserted_tensor_does_not_shift_the_ones_after_it():
    index = MatchIndex(RECORDS)
    # A new code-9 tensor before the second one moves every later ordinal by one.
    assert index.match(S, 1, 9, 64, 7, 0) == -1
    assert index.match(S, 2, 8, 4096, (7 << 16) | 9, 0) == -1  # history changed as well
    assert index.match(S, 3, 7, 4096, (9 << 16) | 8, 0) == -1
    # Only the history right after the insertion differs; a code seen with the same
    # history elsewhere in the stage is still found by occurrence.
    index2 = MatchIndex(RECORDS + [_rec(3, 3, 8, (8 << 16) | 7, 0, 4096)])
    assert index2.match(S, 4, 8, 4096, (8 << 16) | 7, 0) == 3


def test_other_stages_and_operators_do_not_match():
    index = MatchIndex(RECORDS)
    assert index.match(("F", 1, 0, 1), 0, 7, 4096, 0, 0) == -1
    assert index.match(S, 0, 5, 4096, 0, 0) == -1


def test_a_size_class_change_at_the_same_position_is_not_a_strict_match():
    """Same stage, position and operator but another size class and history: neither
    lookup may take the profiled record (without the size class in the strict key, the
    tensor would be swapped as record 1)."""
    index = MatchIndex(RECORDS)
    assert index.match(S, 1, 8, 4096, 7, 0) == 1  # the profiled size: strict match
    assert index.match(S, 1, 8, 1 << 20, 9, 0) == -1
    assert index.match(S, 1, 8, 4097, 9, 0) == 1  # 4097 is still in 4096's class
