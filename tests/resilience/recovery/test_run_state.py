"""Where survivors resume: the newest completed step, from the replicas that completed it."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from chameleon_megatron.resilience.recovery.run_state import (
    RunState,
    agree,
    keys,
    publish,
    read_all,
)

pytestmark = pytest.mark.timeout(30)


def test_a_failure_between_replicas_optimizer_steps_resumes_at_the_newest_step() -> None:
    """Ranks 0 and 2 applied step 5 before the failure surfaced, rank 3 had not; rank 4 is
    a spare without state."""
    sched = {"num_steps": 40}
    states = {0: RunState(5, 40, sched), 2: RunState(5, 40, sched), 3: RunState(4, 32),
              4: RunState(-1, 0)}
    agreed = agree(states)
    assert (agreed.iteration, agreed.consumed_samples, agreed.scheduler) == (5, 40, sched)
    assert (agreed.fresh, agreed.stale) == ((0, 2), (3, 4))


@pytest.mark.parametrize("states, message", [
    ({}, "no survivor"),
    ({1: RunState(-1, 0)}, "no survivor holds model state"),
    ({1: RunState(3, 24), 2: RunState(3, 16)}, "consumed 24 vs 16 samples"),
])
def test_inconsistent_or_empty_states_are_refused(states, message) -> None:
    with pytest.raises(ValueError, match=message):
        agree(states)


def test_states_round_trip_through_the_store_with_rng_tensors() -> None:
    store = dist.HashStore()
    rng = {"torch": torch.get_rng_state(), "tracker": {"model-parallel-rng": torch.arange(4)}}
    publish(store, 3, RunState(7, 56, {"num_steps": 56}, rng))
    publish(store, 1, RunState(6, 48))
    assert store.check(keys((1, 3))) and not store.check(keys((1, 2)))
    back = read_all(store, (1, 3))
    assert back[1] == RunState(6, 48)
    assert back[3].iteration == 7 and torch.equal(back[3].rng["torch"], rng["torch"])
    assert torch.equal(back[3].rng["tracker"]["model-parallel-rng"], torch.arange(4))


def test_the_work_after_the_step_resumes_from_the_earliest_phase_a_fresh_member_was_in() -> None:
    """Rank 0 still waits in the evaluation after step 5, rank 1 reached the checkpoint,
    rank 2 finished both and started step 6, rank 3 (stale, behind) was evaluating step 4:
    everyone redoes the work after step 5 from its evaluation."""
    states = {0: RunState(5, 40, after_step="eval"), 1: RunState(5, 40, after_step="save"),
              2: RunState(5, 40), 3: RunState(4, 32, after_step="eval")}
    assert agree(states).after_step == "eval"
    states[0] = RunState(5, 40)
    assert agree(states).after_step == "save"  # rank 3's evaluation belongs to an older step
    del states[1]
    assert agree(states).after_step == ""
    states = {0: RunState(6, 48, after_step="final-eval"),
              1: RunState(6, 48, after_step="final-save")}  # Megatron-LM's end-of-job work
    assert agree(states).after_step == "final-save"
    store = dist.HashStore()
    publish(store, 1, RunState(5, 40, after_step="save"))
    assert read_all(store, (1,))[1].after_step == "save"


def test_the_validation_position_is_where_the_redone_work_began() -> None:
    """Megatron-LM's evaluations move through the validation set: the job resumes at the
    position of a member inside the agreed work (it began there), or past it when none is;
    a spare made active (-1) holds none and takes it."""
    states = {0: RunState(5, 40, after_step="eval", valid_samples=16),
              1: RunState(5, 40, after_step="save", valid_samples=24),
              2: RunState(5, 40, valid_samples=24), 3: RunState(-1, 0)}
    assert agree(states).valid_samples == 16  # the evaluation is redone from 16
    states[0] = RunState(5, 40, valid_samples=24)
    assert agree(states).valid_samples == 24  # only the checkpoint is redone
    store = dist.HashStore()
    publish(store, 1, states[1])
    assert read_all(store, (1,))[1].valid_samples == 24
