"""Survivors meet under a new generation and rebuild their groups.

Generation g's keys live under ``gen/<g>/`` of the job store. Each survivor joins; once every
rank of the previous membership has either joined or been announced failed, the first one to
see it writes the membership with compare-and-set, so all read the same list. The decision
center then gives each member a rank in the new world or none (a spare). Active members start
a new default group and megatron's parallel state; spares wait for the next failure (or the
end of the job) and join the next generation. A rank that neither joins nor is announced
within the regroup window is suspected (announced, reason ``regroup_timeout``) and left out.
A failure during recovery makes the current generation fail everywhere (its group cannot
form or its vote fails); everyone retries with the next one.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Literal

from chameleon_megatron.megatron import groups
from chameleon_megatron.resilience.store.announce import FailureRecord, announce, failed_ranks
from chameleon_megatron.resilience.store.job_store import JobStore

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Membership:
    """Who survived into one generation."""

    generation: int
    members: tuple[int, ...]
    """Launch ranks of the survivors, ascending; a member's index is its recovery-group rank."""
    failed: frozenset[int]
    """Launch ranks known failed when the membership was fixed."""

    def index(self, rank: int) -> int:
        return self.members.index(rank)


class DeclaredFailed(RuntimeError):
    """This rank was announced failed (e.g. suspected as too slow): it must leave, not
    retry."""


def retry_key(generation: int) -> str:
    """Set by a member whose attempt under ``generation`` failed: every member leaves the
    attempt (``AbortWatcher``) and all meet again under the next generation."""
    return f"gen/{generation}/retry"


def expect(job: JobStore, generation: int, ranks: Iterable[int], *, window_s: float) -> None:
    """Before ``generation`` opens: its members wait for ``ranks`` (invited new members
    among them), and the invited wait ``window_s`` (``expected_window``)."""
    scope = job.scoped(f"gen/{generation}")
    scope.set("expected", json.dumps(sorted(set(ranks))))
    scope.set("window_s", str(window_s))


def expected_window(job: JobStore, generation: int) -> float:
    """How long a member invited into ``generation`` waits in its rendezvous."""
    return float(job.scoped(f"gen/{generation}").get("window_s"))


def failed_before(job: JobStore, generation: int) -> frozenset[int]:
    """The ranks known failed when ``generation`` opened (those its previous generation
    agreed on): a member invited into it recovers from none of them."""
    scope = job.scoped(f"gen/{generation - 1}")
    if generation <= 1 or not scope.check(["members"]):
        return frozenset()
    return frozenset(json.loads(scope.get("members"))["failed"])


def agree_membership(job: JobStore, generation: int, me: int, previous: Iterable[int], *,
                     timeout_s: float, on_wait: Callable[[], None] = lambda: None,
                     poll_s: float = 0.05) -> Membership:
    """Join generation ``generation`` and return the membership every survivor agrees on.
    Besides ``previous``, it waits for the ranks the generation ``expected`` (new members
    invited by whoever opened it, which writes them before opening); those still missing
    after ``timeout_s`` are suspected (``suspect``) and left out."""
    scope = job.scoped(f"gen/{generation}")
    if scope.check(["expected"]):
        previous = set(previous) | set(json.loads(scope.get("expected")))
    scope.set("opened", "1")
    scope.set(f"join/{me}", "1")
    previous = sorted(set(previous))
    deadline = time.monotonic() + timeout_s
    while True:
        if scope.check(["members"]):
            return _decided(scope.get("members"), generation, me)
        failed = failed_ranks(job)
        expected = [r for r in previous if r not in failed]
        missing = [r for r in expected if not scope.check([f"join/{r}"])]
        if not missing:
            proposal = json.dumps({"members": expected, "failed": sorted(failed)})
            return _decided(scope.compare_set("members", "", proposal), generation, me)
        if time.monotonic() > deadline:
            suspect(job, generation, me, missing, timeout_s)
            continue  # they count as failed now: the others go on without them
        on_wait()
        time.sleep(poll_s)


def suspect(job: JobStore, generation: int, me: int, missing: list[int],
            timeout_s: float) -> None:
    """Announce ``missing`` failed (reason regroup_timeout): slow or gone, the job cannot
    wait for them. A suspect that is alive finds itself declared failed when it arrives,
    and leaves (its agent may restart it as a joiner)."""
    now = time.time()
    for rank in missing:
        if announce(job, FailureRecord(rank=rank, time=now, reason="regroup_timeout",
                                       node=f"rank {me}")):
            logger.warning({"event": "suspected", "rank": rank, "generation": generation,
                            "by": me, "waited_s": timeout_s,
                            "next": "the others form the generation without it"})


def _decided(value: bytes, generation: int, me: int) -> Membership:
    data = json.loads(value)
    membership = Membership(generation=generation, members=tuple(data["members"]),
                            failed=frozenset(data["failed"]))
    if me not in membership.members:
        raise DeclaredFailed(f"generation {generation}: rank {me} was declared failed")
    return membership


def join_world(job: JobStore, membership: Membership, new_rank: int, world_size: int, *,
               backend: str, timeout_s: float) -> None:
    """Leave the old world and start this generation's default group (active members)."""
    groups.destroy()
    groups.init_world(job.scoped(f"gen/{membership.generation}/world"), new_rank, world_size,
                      backend=backend, timeout_s=timeout_s)


def recovery_group(job: JobStore, membership: Membership, me: int, *, timeout_s: float):
    """The gloo group over every member of this generation (spares included)."""
    return groups.unregistered_gloo_group(job.scoped(f"gen/{membership.generation}/members"),
                                          membership.index(me), len(membership.members),
                                          timeout_s=timeout_s)


def wait_as_spare(job: JobStore, generation: int, *, active: Iterable[int],
                  on_wait: Callable[[], None],
                  poll_s: float = 0.2) -> Literal["rejoin", "done"]:
    """A spare of ``generation`` idles until it must join the next generation (an active
    member opened it, or every ``active`` member is announced failed: none is left to open
    it) or the job ends. Another failure alone is no reason to rejoin: when a spare dies,
    no active member notices, and nobody else would come."""
    groups.destroy()
    following = job.scoped(f"gen/{generation + 1}")
    active = frozenset(active)
    while True:
        if following.check(["opened"]):
            return "rejoin"
        if job.is_done():
            return "done"
        if active and active <= failed_ranks(job):
            logger.warning({"event": "actives_lost", "generation": generation,
                            "active": sorted(active),
                            "next": "the spares open the next generation"})
            return "rejoin"
        on_wait()
        time.sleep(poll_s)
