"""Full-mode recorder: event order and the spreading of segment times."""

from __future__ import annotations

import pytest

from chameleon_megatron.swap.profile import FREE, PACK, USE
from chameleon_megatron.swap.recorder import FullRecorder, spread_times
from chameleon_megatron.swap.signature import StepSignature

pytestmark = pytest.mark.timeout(30)


def test_segment_time_is_shared_evenly_among_its_events():
    segments = [(10.0, 12.0), (20.0, 21.0)]  # 2 s then 1 s of compute; the gap is not
    assert spread_times([0, 0, 1, -1, 1], segments) == (1.0, 2.0, 2.5, 2.5, 3.0)


def test_records_carry_their_events():
    rec = FullRecorder()
    a = rec.on_pack(("F", 0, 0, 1), 0, 3, 0, 0, 100, (5, 5), True, 0, 7)
    b = rec.on_pack(("F", 0, 0, 1), 1, 4, 3, 0, 50, (5,), False, 0, 8)
    rec.on_use(b, 1)
    rec.on_free(b, 1)
    rec.on_use(a, 1)
    prof = rec.finish([(0.0, 1.0), (1.0, 3.0)], ["x", "y", "z", "op3", "op4"],
                      StepSignature({}))
    assert prof.events == ((0, PACK), (1, PACK), (1, USE), (1, FREE), (0, USE))
    ra, rb = prof.records
    assert (ra.pack_event, ra.use_event, ra.free_event) == (0, 4, -1)
    assert (rb.pack_event, rb.use_event, rb.free_event) == (1, 2, 3)
    assert (ra.op, rb.op, ra.shape, rb.swappable, rb.device_bytes) == ("op3", "op4", (5, 5),
                                                                        False, 8)
    assert prof.event_times == pytest.approx((0.5, 1.0, 1 + 2 / 3, 1 + 4 / 3, 3.0))
