"""The recovery record: phase times from the failure on, and the log line."""

from __future__ import annotations

import pytest

from chameleon_megatron.resilience.store.announce import FailureRecord
from chameleon_megatron.resilience.recovery.record import PhaseClock, recovery_record, summary

pytestmark = pytest.mark.timeout(10)


def test_phases_start_at_the_failure_and_retries_accumulate() -> None:
    clock = PhaseClock(failed_at=100.0)
    for phase, now in [("detect", 103.0), ("decide", 103.5), ("regroup", 104.0),
                       ("decide", 106.0), ("regroup", 106.25), ("migrate", 107.0)]:
        clock.mark(phase, now)
    assert clock.phases() == {"detect": 3.0, "decide": 2.5, "regroup": 0.75, "migrate": 0.75,
                              "total": 7.0}
    with pytest.raises(ValueError, match="phase='rest'"):
        clock.mark("rest")


def test_record_and_summary() -> None:
    hung = FailureRecord(rank=3, time=12.0, reason="heartbeat", signal="SIGKILL", last_seen=9.0)
    dead = FailureRecord(rank=0, time=10.0, reason="exit", exitcode=43)
    rec = recovery_record(generation=1, failures=[hung, dead], decision={"choice": "replan"},
                          phases={"detect": 1.0, "decide": 0.5, "regroup": 0.25,
                                  "migrate": 0.25, "total": 2.0},
                          layout_after={"tp": 1, "pp": 1, "dp": 2}, spares=[2],
                          redo_iteration=6, migrated_bytes=3 * 2**20)
    assert rec["failed_ranks"] == [0, 3] and rec["failures"][1]["failed_at"] == 9.0
    assert rec["event"] == "recovery" and rec["fallback"] is None
    line = summary(rec)
    assert "in memory from failure of ranks [0, 3]" in line
    assert "redo iteration 6" in line and "total 2.00 s, 3.0 MiB moved" in line
    assert "from checkpoint" in summary({**rec, "fallback": "checkpoint"})
