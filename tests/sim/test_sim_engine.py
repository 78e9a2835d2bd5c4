"""Replay bookkeeping: whole steps, lost steps, downtime, checkpoints, rollback."""

import pytest

from chameleon_megatron.sim.engine import Checkpointing, Reaction, replay
from chameleon_megatron.sim.traces import Event

pytestmark = pytest.mark.timeout(30)


class Scripted:
    """Constant step time; scripted reactions per event."""

    name = "scripted"

    def __init__(self, step, reactions=()):
        self.step, self.reactions = step, list(reactions)

    def step_s(self):
        return self.step

    def react(self, event, now_s):
        return self.reactions.pop(0)


NEVER = Checkpointing(interval_s=1e9)


def test_no_event_counts_whole_steps():
    r = replay(Scripted(2.0), [], horizon_s=11.0, batch=4, ckpt=NEVER)
    assert r.samples == 5 * 4 and r.avg_throughput == pytest.approx(20 / 11)


def test_a_failure_loses_the_step_in_progress_and_the_downtime():
    react = Reaction(downtime_s=1.0, reset_progress=True)
    r = replay(Scripted(2.0, [react]), [Event(5.0, "fail", 0)], horizon_s=11.0, batch=4, ckpt=NEVER)
    assert r.samples == (2 + 2) * 4  # [0,5): 2 steps, half a step lost; down [5,6); [6,11): 2
    assert (5.0, 6.0, 0.0) in r.segments


def test_an_event_that_changes_nothing_keeps_the_step_in_progress():
    react = Reaction(downtime_s=0.0, reset_progress=False)
    r = replay(Scripted(2.0, [react]), [Event(5.0, "repair", 0)], horizon_s=11.0, batch=4, ckpt=NEVER)
    assert r.samples == 5 * 4


def test_a_second_event_during_downtime_restarts_it():
    reactions = [Reaction(10.0, True), Reaction(1.0, True)]
    events = [Event(2.0, "fail", 0), Event(3.0, "fail", 1)]
    r = replay(Scripted(1.0, reactions), events, horizon_s=10.0, batch=1, ckpt=NEVER)
    assert r.samples == 2 + 6  # [0,2): 2; down until 4; [4,10): 6


def test_checkpoint_stalls_and_rollback():
    ckpt = Checkpointing(interval_s=3.0, write_s=1.0)
    r = replay(Scripted(1.0), [], horizon_s=10.0, batch=1, ckpt=ckpt)
    assert r.samples == 3 + 3 + 2  # train 3, write 1, train 3, write 1, train 2
    rollback = Reaction(downtime_s=0.0, reset_progress=True, rollback=True)
    r = replay(Scripted(1.0, [rollback]), [Event(9.5, "fail", 0)], horizon_s=10.0, batch=1, ckpt=ckpt)
    assert r.samples == 6  # the 1.5 steps after the checkpoint written at t=8 are lost


def test_checkpointing_is_validated():
    with pytest.raises(ValueError, match="interval_s=0"):
        Checkpointing(interval_s=0.0)
