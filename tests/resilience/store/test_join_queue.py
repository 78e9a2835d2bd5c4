"""Joiners queue in the job store; rank 0 takes them and offers them to the whole world."""

from __future__ import annotations

import threading

import pytest
import torch.distributed as dist

from chameleon_megatron.resilience.store.announce import FailureRecord, announce
from chameleon_megatron.resilience.store.job_store import JobStore
from chameleon_megatron.resilience.store.join_queue import JoinQueue

pytestmark = pytest.mark.timeout(30)


def test_old_and_new_members_invite_the_same_joiners() -> None:
    job = JobStore(dist.HashStore(), "run")
    old = JoinQueue(job)
    old.enqueue(8)
    old.enqueue(9)
    old.enqueue(10)
    announce(job, FailureRecord(rank=10, time=0.0, reason="exit", exitcode=1))
    assert old.waiting() == 3
    assert old.take(2) == (8, 9)
    old.admit(8, generation=3)
    new = JoinQueue(job)  # a member that joined in generation 3 knows nothing cached
    assert old.take(2) == new.take(2) == (9,)
    old.admit(9, generation=4)
    assert old.take(3) == new.take(3) == ()  # 10 failed before it was admitted


def test_the_offer_of_rank_0_is_what_every_rank_admits() -> None:
    """Rank 0 takes the queue and offers it for its generation; a rank reading the queue
    itself after a faster one admitted the joiner would see nobody to invite (the race
    that split a world between a join and the next step)."""
    job = JobStore(dist.HashStore(), "run")
    lead, other = JoinQueue(job), JoinQueue(job)
    lead.enqueue(4)
    invited = lead.take(lead.waiting())
    lead.offer(2, invited)
    lead.admit(4, generation=3)  # rank 0 went ahead
    assert other.take(other.waiting()) == ()  # what a slower rank would have read
    assert other.offered(2) == invited == (4,)


def test_a_joiner_waits_for_its_generation_or_the_end_of_the_job() -> None:
    job = JobStore(dist.HashStore(), "run")
    got: dict[int, int | None] = {}

    def wait(rank: int) -> None:
        got[rank] = JoinQueue(job).wait_for_invitation(rank, on_wait=lambda: None, poll_s=0.01)

    first = threading.Thread(target=wait, args=(8,))
    first.start()
    while JoinQueue(job).waiting() < 1:
        pass
    JoinQueue(job).admit(8, generation=5)
    first.join(10)
    assert got == {8: 5}
    job.mark_done()
    wait(9)
    assert got[9] is None


def test_an_offer_belongs_to_its_generation() -> None:
    """A rank that reads the offer of its generation never sees another generation's
    (a late reader of generation 3 after generation 4 offered must still see 3's)."""
    job = JobStore(dist.HashStore(), "run")
    queue = JoinQueue(job)
    queue.offer(3, (4,))
    queue.offer(4, (5, 6))
    assert queue.offered(3) == (4,)
    assert queue.offered(4) == (5, 6)
    assert JoinQueue(job).offered(3) == (4,)


def test_a_joiner_stops_waiting_once_the_job_failed() -> None:
    job = JobStore(dist.HashStore(), "run")
    assert job.failure() is None
    job.mark_failed("some state has no surviving copy")
    assert JoinQueue(job).wait_for_invitation(8, on_wait=lambda: None, poll_s=0.01) is None
    assert job.failure() == "some state has no surviving copy" and not job.is_done()
