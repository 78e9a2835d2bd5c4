"""New members waiting to join a running job, as the job's ranks see them.

A joiner (a restarted worker, ``joiners.py``) queues itself in the job store; between two
steps the active world's rank 0 reads how many wait (``waiting``), takes them in queue order
(``take``) and offers them to the others (``offer``: the store changes while ranks read it,
so one rank decides), who learn of it in their between-steps all-reduce and read the offer
(``offered``); each admits them into the generation that follows (``admit``); the joiner
waits for that (``wait_for_invitation``).
"""

from __future__ import annotations

import json
import time
from typing import Callable

from chameleon_megatron.resilience.store.announce import failed_ranks
from chameleon_megatron.resilience.store.job_store import JobStore


class JoinQueue:
    """Keys under ``join/``: ``count``, ``<i>`` (the i-th joiner's rank), ``gen/<rank>``."""

    def __init__(self, job: JobStore) -> None:
        self.job = job
        self._settled = 0
        """Queue entries known admitted or failed (a cache: the store decides)."""

    def enqueue(self, rank: int) -> None:
        index = self.job.store.add("join/count", 1) - 1
        self.job.store.set(f"join/{index}", str(rank))

    def waiting(self) -> int:
        """How many joiners have queued so far, admitted or not (non-blocking)."""
        return self.job.counter("join/count")

    def take(self, count: int) -> tuple[int, ...]:
        """The first ``count`` queued joiners not yet admitted nor announced failed."""
        if count <= self._settled:
            return ()
        queued = [int(self.job.store.get(f"join/{i}")) for i in range(count)]
        dead = failed_ranks(self.job)
        fresh = tuple(r for r in queued
                      if r not in dead and not self.job.store.check([f"join/gen/{r}"]))
        if not fresh:
            self._settled = count
        return fresh

    def offer(self, generation: int, ranks: tuple[int, ...]) -> None:
        """The joiners the world of ``generation`` admits next (said by its rank 0)."""
        self.job.store.set(f"join/offer/{generation}", json.dumps(list(ranks)))

    def offered(self, generation: int) -> tuple[int, ...]:
        return tuple(json.loads(self.job.store.get(f"join/offer/{generation}")))

    def admit(self, rank: int, generation: int) -> None:
        self.job.store.set(f"join/gen/{rank}", str(generation))

    def wait_for_invitation(self, rank: int, *, on_wait: Callable[[], None],
                            poll_s: float = 0.2) -> int | None:
        """Queue ``rank`` and wait: the generation that admits it, or None when the job
        finished first or cannot go on (``JobStore.failure``)."""
        self.enqueue(rank)
        while True:
            if self.job.store.check([f"join/gen/{rank}"]):
                return int(self.job.store.get(f"join/gen/{rank}"))
            if self.job.is_done() or self.job.failure() is not None:
                return None
            on_wait()
            time.sleep(poll_s)
