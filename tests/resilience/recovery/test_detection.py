"""Detection building blocks: derived timeouts, heartbeat deadlines, announcements, agent
liveness, the error classifier, and the survivors' membership agreement (threads on one
in-memory store)."""

from __future__ import annotations

import datetime
import json
import logging
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from chameleon_megatron.resilience.store.announce import (
    AbandonRecord, FailureRecord, announce, announce_abandon, failed_ranks, failure_count,
    read_failures,
)
from chameleon_megatron.resilience.config import ResilienceConfig
from chameleon_megatron.resilience.recovery.detector import (
    AbortWatcher, FailureDetector, StepTimer, derive_timeouts, is_communication_error,
)
from chameleon_megatron.resilience.recovery.faults import InjectedFault
from chameleon_megatron.resilience.store.heartbeat import Beat, Heartbeat, overdue, read_beats
from chameleon_megatron.resilience.store.job_store import JobStore
from chameleon_megatron.resilience.launch.nodes import (
    Launch, NodeWatch, publish_launch, read_launch, register_joined_node,
)
from chameleon_megatron.resilience.recovery.regroup import DeclaredFailed, agree_membership

pytestmark = [pytest.mark.timeout(30), pytest.mark.serial]


def job() -> JobStore:
    return JobStore(dist.HashStore(), "run")


def test_timeouts_follow_the_step_time_with_a_floor() -> None:
    ft = ResilienceConfig(startup_timeout_s=120, pg_timeout_factor=4, min_pg_timeout_s=2)
    start = derive_timeouts(None, ft)
    assert (start.pg_s, start.heartbeat_s, start.rendezvous_s) == (120, 240, 480)
    slow = derive_timeouts(1.5, ft)
    assert (slow.pg_s, slow.heartbeat_s, slow.rendezvous_s) == (6.0, 12.0, 24.0)
    assert derive_timeouts(0.1, ft).pg_s == 2  # the floor
    with pytest.raises(ValueError, match="step time=0 s: must be > 0"):
        derive_timeouts(0, ft)


def test_step_time_skips_the_warm_up_step_and_takes_the_worst_of_the_window() -> None:
    timer = StepTimer(steps=2)
    for seconds, known in [(9.0, None), (1.0, None), (1.4, 1.4), (5.0, 1.4)]:
        timer.record(seconds)
        assert timer.step_time == known
    timer.reset()
    assert timer.step_time is None


def test_communication_errors_are_told_from_local_ones() -> None:
    assert is_communication_error(RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4242"))
    assert is_communication_error(RuntimeError("[.../unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation to complete"))
    assert is_communication_error(dist.DistBackendError("NCCL communicator was aborted"))
    assert not is_communication_error(InjectedFault("injected fault rank=1,iteration=2,phase=forward,kind=exception"))
    assert not is_communication_error(ValueError("shapes do not match"))


def test_overdue_uses_each_ranks_own_timeout_and_the_start_up_grace() -> None:
    beats = {0: Beat(time=100.0, timeout_s=5.0), 1: Beat(time=100.0, timeout_s=20.0)}
    late = overdue(beats, [0, 1, 2, 3], now=106.0, started_at=50.0, startup_timeout_s=60.0)
    assert late == {0: 100.0}
    late = overdue(beats, [0, 1, 2], now=111.0, started_at=50.0, startup_timeout_s=60.0)
    assert late == {0: 100.0, 2: 50.0}


def test_heartbeats_round_trip_through_the_agents_folder(beat_dir: Path) -> None:
    Heartbeat.from_env(3).beat(timeout_s=7.5, iteration=12)
    beats = read_beats(beat_dir, [2, 3])
    assert list(beats) == [3] and (beats[3].timeout_s, beats[3].iteration) == (7.5, 12)


STACKS_CHILD = """
import os, signal, sys, time
from chameleon_megatron.resilience.store.heartbeat import STACKS_SIGNAL, dump_stacks_on_request
seen = []
if sys.argv[1] == "prior":  # e.g. Megatron-LM's --exit-signal handler, installed first
    signal.signal(STACKS_SIGNAL, lambda *_: seen.append(1))
dump_stacks_on_request()
os.kill(os.getpid(), STACKS_SIGNAL)
time.sleep(0.5)
print("alive", len(seen))
"""


@pytest.mark.parametrize("prior", ["none", "prior"])
def test_a_stack_request_dumps_every_thread_and_keeps_a_prior_handler(prior: str) -> None:
    """The signal an agent sends before killing a silent worker writes the worker's stacks
    and nothing else: the worker lives on, and a handler installed before still runs."""
    out = subprocess.run([sys.executable, "-c", STACKS_CHILD, prior], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "most recent call first" in out.stderr, out.stderr[-2000:]
    assert out.stdout.split() == ["alive", "1" if prior == "prior" else "0"]


def test_a_step_pulses_at_most_once_a_second_and_keeps_a_hold(monkeypatch,
                                                               beat_dir: Path) -> None:
    """Forward passes beat (a slowed step is alive), rate-limited; a pulse inside work under
    a hold (an evaluation before a checkpoint) keeps the hold's deadline."""
    import chameleon_megatron.resilience.recovery.detector as detector_module

    clock = [1000.0]
    monkeypatch.setattr(detector_module.time, "monotonic", lambda: clock[0])
    j = job()
    detector = FailureDetector(j, 0, ResilienceConfig(startup_timeout_s=30))
    detector.timeouts = derive_timeouts(1.0, detector._ft)  # heartbeat 2 x 5 s floor

    def last() -> float:
        return read_beats(beat_dir, [0])[0].time
    detector.pulse()
    first = last()
    clock[0] += 0.5
    detector.pulse()
    assert last() == first  # within a second: no beat written
    clock[0] += 0.6
    time.sleep(0.01)  # the beat's own (wall) time moves on
    detector.pulse()
    assert last() > first and read_beats(beat_dir, [0])[0].timeout_s == 10.0
    detector.hold(100.0)
    clock[0] += 30.0
    detector.pulse()
    assert read_beats(beat_dir, [0])[0].timeout_s == pytest.approx(70.0)
    detector.beat()  # a step's end: the hold is over
    clock[0] += 1.0
    detector.pulse()
    assert read_beats(beat_dir, [0])[0].timeout_s == 10.0


def test_each_rank_is_announced_once_in_one_order() -> None:
    j = job()
    first = FailureRecord(rank=5, time=1.0, reason="exit", exitcode=3)
    assert announce(j, first)
    assert not announce(j, FailureRecord(rank=5, time=2.0, reason="node"))  # another agent
    assert announce(j, FailureRecord(rank=2, time=3.0, reason="heartbeat", last_seen=1.5))
    assert failure_count(j) == 2
    records = read_failures(j)
    assert records[0] == first and records[1].failed_at == 1.5
    assert [r.rank for r in read_failures(j, start=1)] == [2]
    assert failed_ranks(j) == {2, 5}


def test_a_silent_agent_is_lost_with_its_ranks_and_a_finished_one_is_not() -> None:
    j = job()
    watch = {g: NodeWatch(j, g, 3, [2 * g, 2 * g + 1], timeout_s=10.0) for g in range(3)}
    for now in (0.0, 1.0):
        for g in (1, 2, 0):  # agent 0 reads last, so it has seen the others' latest beats
            assert watch[g].tick(now, node=f"n{g}", finished=(g == 2 and now == 1.0)) == []
    # agent 1 goes silent; agent 2 has finished and stays silent too
    assert watch[0].tick(11.0, node="n0", finished=False) == []  # silent 10 s: not yet
    lost = watch[0].tick(12.5, node="n0", finished=False)
    assert [(r.rank, r.reason, r.node, r.last_seen) for r in lost] == [
        (2, "node", "n1", 1.0), (3, "node", "n1", 1.0)]
    assert watch[0].tick(30.0, node="n0", finished=True) == []  # announced once
    assert watch[0].job_finished()
    assert not watch[2].job_finished()  # it has not seen agent 0 finish or agent 1 get lost


def test_a_lost_node_takes_its_restarted_workers_with_it() -> None:
    j = job()
    watch = {g: NodeWatch(j, g, 2, [g], timeout_s=10.0) for g in range(2)}
    watch[1].add_rank(7)  # agent 1 restarted a worker as joiner 7
    for now in (0.0, 1.0):
        for g in (1, 0):
            watch[g].tick(now, node=f"n{g}", finished=False)
    lost = watch[0].tick(12.0, node="n0", finished=False)
    assert [r.rank for r in lost] == [1, 7]


def test_a_node_that_joins_later_is_watched_and_waited_for() -> None:
    j = job()
    publish_launch(j, world_size=4, nodes=2)
    launch = read_launch(j, timeout_s=1)
    assert launch == Launch(world_size=4, nodes=2)
    watch = {g: NodeWatch(j, g, 2, [g], timeout_s=10.0) for g in range(2)}
    late = register_joined_node(j, launch)
    assert (late, register_joined_node(j, launch)) == (2, 3)  # numbers are never reused
    watch[late] = NodeWatch(j, late, 2, [4], timeout_s=10.0)
    for now in (0.0, 1.0):
        for g in (late, 1, 0):
            watch[g].tick(now, node=f"n{g}", finished=g != late)
    assert not watch[0].job_finished()  # the late node's worker still trains
    # agent 3 registered but never beat: given up after the timeout, with no ranks; the
    # late node goes silent too and is announced with its worker
    lost = watch[0].tick(12.0, node="n0", finished=True)
    assert [(r.rank, r.node) for r in lost] == [(4, "n2")]
    assert watch[0].job_finished()


def test_no_launch_to_join_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match="no chameleon-run job with run id 'run'"):
        read_launch(job(), timeout_s=0.3, poll_s=0.1)


def test_an_agent_that_finished_stops_waiting_once_the_store_is_gone() -> None:
    host = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=5))
    watch = NodeWatch(JobStore.connect("127.0.0.1", host.port, "run", timeout_s=5), 1, 2, [1],
                      timeout_s=10.0)
    watch.tick(0.0, node="n1", finished=False)
    del host  # the host's agent leaves
    with pytest.raises(dist.DistNetworkError):  # workers still running: a real failure
        watch.tick(1.0, node="n1", finished=False)
    assert not watch.job_finished()
    assert watch.tick(2.0, node="n1", finished=True) == []
    assert watch.job_finished()


def _agree(j: JobStore, ranks: list[int], previous: list[int], **kw) -> dict:
    out: dict = {}

    def run(r: int) -> None:
        try:
            out[r] = agree_membership(j, 1, r, previous, **kw)
        except DeclaredFailed as exc:
            out[r] = exc
    threads = [threading.Thread(target=run, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return out


def test_survivors_agree_on_one_membership_without_the_announced_failed() -> None:
    j = job()
    announce(j, FailureRecord(rank=1, time=0.0, reason="exit", exitcode=1))
    out = _agree(j, [0, 2, 3], [0, 1, 2, 3], timeout_s=10)
    assert {r: m.members for r, m in out.items()} == {r: (0, 2, 3) for r in (0, 2, 3)}
    assert out[0].failed == {1} and out[3].index(3) == 2


def test_members_invited_by_the_opener_are_waited_for() -> None:
    j = job()
    j.scoped("gen/1").set("expected", json.dumps([0, 2, 5]))  # rank 5 joins the job
    out = _agree(j, [0, 2, 5], [0, 2], timeout_s=10)
    assert {r: m.members for r, m in out.items()} == {r: (0, 2, 5) for r in (0, 2, 5)}


def test_a_rank_that_neither_joins_nor_is_announced_is_suspected_and_left_out() -> None:
    """Slowness is not failure, but the job cannot wait for it: after the regroup window
    rank 1 is announced (regroup_timeout) and the others form the generation; when rank 1
    arrives it finds itself declared failed."""
    j = job()
    start = time.monotonic()
    out = _agree(j, [0, 2], [0, 1, 2], timeout_s=0.5)
    assert time.monotonic() - start < 5
    assert {r: m.members for r, m in out.items()} == {0: (0, 2), 2: (0, 2)}
    (record,) = read_failures(j)
    assert (record.rank, record.reason) == (1, "regroup_timeout")
    assert record.node in ("rank 0", "rank 2")
    with pytest.raises(DeclaredFailed, match="rank 1 was declared failed"):
        agree_membership(j, 1, 1, [0, 1, 2], timeout_s=5)


def test_the_first_decision_stands_for_late_readers() -> None:
    """A member announced failed after the membership was fixed is still in it (its
    generation fails later and the next one drops it); a late reader gets the same list."""
    j = job()
    first = _agree(j, [0, 1], [0, 1], timeout_s=5)
    announce(j, FailureRecord(rank=1, time=0.0, reason="exit", exitcode=1))
    late = agree_membership(j, 1, 0, [0, 1], timeout_s=5)
    assert first[0].members == late.members == (0, 1)
    with pytest.raises(DeclaredFailed, match="rank 7 was declared failed"):
        agree_membership(j, 1, 7, [0, 1, 7], timeout_s=5)


def test_the_abort_watcher_interrupts_once_per_new_announcement() -> None:
    j = job()
    announce(j, FailureRecord(rank=9, time=0.0, reason="exit", exitcode=1))  # before start
    calls: list[float] = []
    watcher = AbortWatcher(j, abort=lambda: calls.append(1) or 3, period_s=0.02).start()
    try:
        time.sleep(0.1)
        assert calls == []
        announce(j, FailureRecord(rank=1, time=0.0, reason="exit", exitcode=1))
        _until(lambda: watcher.aborted_at is not None)
        time.sleep(0.1)
        assert calls == [1]
        announce_abandon(j, AbandonRecord(rank=0, iteration=3, reason="oom", time=0.0))
        _until(lambda: len(calls) == 2)  # an abandoned step interrupts too
    finally:
        watcher.stop()


def test_events_the_main_thread_acknowledged_do_not_interrupt_its_new_groups() -> None:
    j = job()
    calls: list[int] = []
    watcher = AbortWatcher(j, abort=lambda: calls.append(1) or 1)  # ticks driven here
    watcher.acknowledge()
    announce(j, FailureRecord(rank=1, time=0.0, reason="exit", exitcode=1))
    watcher.acknowledge()  # handled by the main thread, which builds new groups next
    watcher._tick()
    assert calls == []
    announce(j, FailureRecord(rank=2, time=0.0, reason="exit", exitcode=1))  # during it
    watcher._tick()
    watcher._tick()
    assert calls == [1]


def test_failures_the_membership_left_out_do_not_interrupt_its_groups() -> None:
    """Rank 2 is suspected in the regroup (after the main thread acknowledged the events):
    the membership it produced leaves it out, so the watcher, noticing it only now, must
    not interrupt that membership's groups. A failure after the membership still does, and
    so does an abandoned step."""
    j = job()
    calls: list[int] = []
    watcher = AbortWatcher(j, abort=lambda: calls.append(1) or 1)
    watcher.acknowledge("gen/1/retry")
    j.scoped("gen/1").set("join/1", "1")
    membership = agree_membership(j, 1, 0, [0, 1, 2], timeout_s=0.1)
    assert membership.members == (0, 1) and membership.failed == {2}
    watcher.covered(len(membership.failed))
    watcher._tick()
    assert calls == []
    announce(j, FailureRecord(rank=1, time=0.0, reason="exit", exitcode=1))
    watcher._tick()
    assert calls == [1]
    watcher.covered(1)  # an older count never hides a newer failure
    announce_abandon(j, AbandonRecord(rank=0, iteration=3, reason="oom", time=0.0))
    watcher._tick()
    assert calls == [1, 1]


def test_a_failed_attempt_interrupts_its_own_generation_only() -> None:
    """A member whose recovery attempt under generation 4 failed sets that generation's
    retry key: members still inside generation 4 leave it; members already in generation 5
    are not interrupted (a retry must not cascade through later attempts)."""
    j = job()
    calls: list[int] = []
    watcher = AbortWatcher(j, abort=lambda: calls.append(1) or 1)
    watcher.acknowledge("gen/5/retry")  # this member moved on
    j.store.set("gen/4/retry", "2")
    watcher._tick()
    assert calls == []
    watcher.acknowledge("gen/4/retry")  # this member is still in generation 4
    watcher._tick()
    watcher._tick()  # once per attempt
    assert calls == [1]


def test_an_interruption_the_main_thread_has_not_caught_is_repeated_and_located(caplog) -> None:
    """The main thread is still in its step ``repeat_s`` after an interruption that shut
    something down: the watcher interrupts again, says once where the main thread is, and
    stops repeating once the main thread reports it caught the error."""
    j = job()
    calls: list[int] = []
    watcher = AbortWatcher(j, abort=lambda: calls.append(1) or 2, repeat_s=0.05)
    announce(j, FailureRecord(rank=1, time=0.0, reason="exit", exitcode=1))
    watcher._tick()
    watcher._tick()  # too soon to repeat
    assert calls == [1]
    with caplog.at_level(logging.DEBUG, logger="chameleon_megatron"):
        for _ in range(2):
            time.sleep(0.06)
            watcher._tick()
    assert calls == [1, 1, 1]
    located = [r for r in caplog.records if "has not caught an interruption" in r.getMessage()]
    assert len(located) == 1 and __name__.split(".")[-1] in located[0].getMessage()
    watcher.caught()
    time.sleep(0.06)
    watcher._tick()
    assert calls == [1, 1, 1]


def test_an_interruption_that_shut_nothing_or_was_acknowledged_is_not_repeated() -> None:
    """A process with nothing to interrupt (a spare) is not blocked on a peer; a main thread
    that acknowledged the events is handling them."""
    j = job()
    calls: list[int] = []
    watcher = AbortWatcher(j, abort=lambda: calls.append(1) or 0, repeat_s=0.01)
    announce(j, FailureRecord(rank=1, time=0.0, reason="exit", exitcode=1))
    watcher._tick()
    time.sleep(0.02)
    watcher._tick()
    assert calls == [1]
    shutting = AbortWatcher(j, abort=lambda: calls.append(2) or 3, repeat_s=0.01)
    announce(j, FailureRecord(rank=2, time=0.0, reason="exit", exitcode=1))
    shutting._tick()
    shutting.acknowledge()
    time.sleep(0.02)
    shutting._tick()
    assert calls == [1, 2]


def test_the_abort_watcher_survives_an_abort_that_raises() -> None:
    """The main thread destroys groups while the watcher aborts them: a tick that raises
    must not end the watcher; it tries again on the next one."""
    j = job()
    calls: list[int] = []

    def abort() -> int:
        calls.append(1)
        if len(calls) == 1:
            raise ValueError("Invalid process group specified or has been destroyed.")
        return 2

    watcher = AbortWatcher(j, abort=abort, period_s=0.02).start()
    try:
        announce(j, FailureRecord(rank=1, time=0.0, reason="exit", exitcode=1))
        _until(lambda: watcher.aborted_at is not None)
        assert calls == [1, 1] and watcher._thread.is_alive()
    finally:
        watcher.stop()


def _until(cond, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)
