"""The partition rule: at most one side of any cut goes on; its edges on 2 and 3 hosts."""

from __future__ import annotations

import itertools
import threading
import time

import pytest

from chameleon_megatron.resilience.launch import quorum
from chameleon_megatron.resilience.launch.deadline import Unanswered, within


def _sides(n: int):
    """Every way to split agents 0..n-1 (agent 0 hosts the store) into labelled sides."""
    for labels in itertools.product(range(n), repeat=n):
        sides: dict[int, set[int]] = {}
        for agent, label in enumerate(labels):
            sides.setdefault(label, set()).add(agent)
        yield list(sides.values())


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_no_cut_lets_two_sides_go_on(n: int) -> None:
    for sides in _sides(n):
        going = []
        for side in sides:
            verdict = quorum.store_side(n, n - len(side)) if 0 in side else \
                quorum.storeless_side(n, len(side))
            if verdict.go_on:
                going.append(side)
        assert len(going) <= 1, (n, sides, going)
        # the whole job, undivided, goes on
        if len(sides) == 1:
            assert going == sides


def test_two_hosts_the_store_side_goes_on_either_way() -> None:
    # host 1 cut off (or dead): host 0 keeps training, host 1 stops
    assert quorum.store_side(2, lost=1).go_on
    assert not quorum.storeless_side(2, holding=1).go_on
    # the store host cut off: the same verdicts, seen from the other side
    assert "no majority" in quorum.storeless_side(2, holding=1).why


def test_three_hosts_with_the_store_host_cut_off_the_majority_resumes() -> None:
    assert quorum.storeless_side(3, holding=2).go_on
    cut = quorum.store_side(3, lost=2)
    assert not cut.go_on and "lost 2 of the launch's 3 agents (a majority)" in cut.why
    # one other host cut off: the store's side (2 of 3) goes on, that host stops
    assert quorum.store_side(3, lost=1).go_on
    assert not quorum.storeless_side(3, holding=1).go_on


def test_the_cut_off_message_names_what_was_lost_and_the_status() -> None:
    message = str(quorum.CutOff("job store lost (no answer from the job store for 10 s)",
                                quorum.storeless_side(2, 1)))
    assert message.startswith("cut off from the job: job store lost (no answer")
    assert message.endswith(f"exits ({quorum.CUT_OFF_EXIT})") and "\n" not in message


def test_a_call_that_blocks_is_given_up_at_its_deadline() -> None:
    release = threading.Event()
    start = time.monotonic()
    with pytest.raises(Unanswered, match="no answer from the job store for 0.5 s"):
        within(0.5, release.wait)
    assert time.monotonic() - start < 5
    release.set()
    assert within(5, lambda: 7) == 7
    with pytest.raises(KeyError):
        within(5, lambda: {}["x"])


def test_a_call_given_up_on_is_known_until_it_returns() -> None:
    from chameleon_megatron.resilience.launch.deadline import abandoned

    release = threading.Event()
    with pytest.raises(Unanswered):
        within(0.2, release.wait)
    assert abandoned()
    release.set()
    deadline = time.monotonic() + 5
    while abandoned() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not abandoned()
