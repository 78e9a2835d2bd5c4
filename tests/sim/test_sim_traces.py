"""Failure traces: drawn deterministically at the stated rate, validated when given."""

import pytest

from chameleon_megatron.sim.traces import Event, check_trace, draw_trace, load_trace, save_trace

pytestmark = pytest.mark.timeout(30)


def test_same_seed_same_trace_and_repairs_follow_failures():
    a = draw_trace(32, 86400.0, 3600.0, 7200.0, seed=5)
    assert a == draw_trace(32, 86400.0, 3600.0, 7200.0, seed=5)
    assert a != draw_trace(32, 86400.0, 3600.0, 7200.0, seed=6)
    assert check_trace(a, 32) == a
    assert {e.kind for e in a} == {"fail", "repair"}


def test_failure_count_matches_the_mtbf():
    events = draw_trace(64, 3000.0, 1.0, 1e-3, seed=1)  # repairs are immediate: full size
    fails = sum(e.kind == "fail" for e in events)
    assert 2700 <= fails <= 3300  # Poisson(3000): +-5.5 sigma


def test_without_repair_devices_only_fail():
    events = draw_trace(8, 1e9, 10.0, None, seed=2)
    assert [e.kind for e in events] == ["fail"] * 8


@pytest.mark.parametrize("events,match", [
    ([Event(1.0, "fail", 9)], "outside"),
    ([Event(1.0, "fail", 1), Event(2.0, "fail", 1)], "already down"),
    ([Event(1.0, "repair", 1)], "not down"),
])
def test_bad_traces_are_refused(events, match):
    with pytest.raises(ValueError, match=match):
        check_trace(events, 4)


def test_trace_file_round_trip(tmp_path):
    events = draw_trace(8, 1000.0, 100.0, 50.0, seed=3)
    save_trace(events, tmp_path / "t.json")
    assert load_trace(tmp_path / "t.json") == events
