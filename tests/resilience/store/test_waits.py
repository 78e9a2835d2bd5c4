"""Waits in the job store that a recovery attempt can leave at once."""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from chameleon_megatron.resilience.store.waits import Abandoned, barrier, wait_keys


def test_a_wait_returns_once_the_keys_are_set_and_beats_meanwhile() -> None:
    store, beats = dist.HashStore(), []
    threading.Timer(0.2, lambda: store.set("k", "1")).start()
    wait_keys(store, ["k"], timeout_s=5, abandoned=lambda: False,
              on_wait=lambda: beats.append(1))
    assert store.check(["k"]) and beats


def test_the_polls_start_a_millisecond_apart_and_slow_down_to_the_poll_interval(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A recovery's waits mostly end within milliseconds: a fixed 50 ms poll added 50 ms to
    each (the migration's exchange of wants among them)."""
    store, pauses = dist.HashStore(), []

    def sleep(seconds: float) -> None:
        pauses.append(seconds)
        if len(pauses) == 9:
            store.set("k", "1")
    monkeypatch.setattr(time, "sleep", sleep)
    wait_keys(store, ["k"], timeout_s=5, abandoned=lambda: False, poll_s=0.05)
    assert pauses == [0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.05, 0.05, 0.05]


def test_an_abandoned_attempt_leaves_the_wait_at_once() -> None:
    store = dist.HashStore()
    threading.Timer(0.2, lambda: store.set("retry", "3")).start()
    start = time.monotonic()
    with pytest.raises(Abandoned, match="the attempt was abandoned"):
        wait_keys(store, ["never"], timeout_s=30, abandoned=lambda: store.check(["retry"]))
    assert time.monotonic() - start < 2


def test_a_wait_nobody_ends_times_out() -> None:
    with pytest.raises(TimeoutError, match=r"waited 0.2 s for \['never'\]"):
        wait_keys(dist.HashStore(), ["never"], timeout_s=0.2, abandoned=lambda: False)


def test_a_barrier_lets_members_through_together_and_only_then() -> None:
    store, passed = dist.HashStore(), []

    def member(me: int) -> None:
        barrier(store, "world", me, [0, 1, 2], timeout_s=5, abandoned=lambda: False)
        passed.append((me, time.monotonic()))

    threads = [threading.Thread(target=member, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    assert passed == []  # rank 2 has not arrived
    arrived = time.monotonic()
    member(2)
    for t in threads:
        t.join()
    assert sorted(r for r, _ in passed) == [0, 1, 2]
    assert all(at >= arrived for _, at in passed)
