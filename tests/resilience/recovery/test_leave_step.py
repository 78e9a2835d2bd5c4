"""How the recovery controller leaves its groups, with a recording stand-in for the
process-group API (no abort watcher running, unless a test starts it: the watcher's own
interrupt must not hide a missing one on the main thread)."""

from __future__ import annotations

import queue
import time
from types import SimpleNamespace

import pytest
import torch.distributed as dist
from megatron.core.dist_checkpointing.strategies import filesystem_async

from chameleon_megatron.megatron.teardown import Teardown
from chameleon_megatron.resilience.config import ResilienceConfig
from chameleon_megatron.resilience.decision.center import uniform_plan
from chameleon_megatron.resilience.decision.layout import UniformLayout
from chameleon_megatron.resilience.recovery.controller import RecoveryController
from chameleon_megatron.resilience.recovery.detector import FailureDetector, derive_timeouts
from chameleon_megatron.resilience.recovery.faults import FaultInjector
from chameleon_megatron.resilience.recovery.shard_replica import ShardReplicas
from chameleon_megatron.resilience.store.announce import FailureRecord, announce
from chameleon_megatron.resilience.store.heartbeat import read_beats
from chameleon_megatron.resilience.store.job_store import JobStore
from recording_groups import RecordingGroups

pytestmark = pytest.mark.timeout(60)

STORE_PORT = 4321
NCCL_JOB = {"world": "nccl", "tp": "nccl", "dp_gloo": "gloo", "host": "gloo"}
LEFT = [("abort", ("world", "tp")), ("aborted",), ("close", frozenset({STORE_PORT})),
        ("destroy",)]
"""An NCCL rank leaving its groups: communicators aborted, then every connection but the
job store's shut down (gloo's groups), then the groups destroyed."""


def _controller(rec: RecordingGroups) -> RecoveryController:
    job = JobStore(dist.HashStore(), "run", port=STORE_PORT)
    ft = ResilienceConfig()
    # shard copies not taken yet: the rank holds no state (no trainer model needed)
    return RecoveryController(job=job, detector=FailureDetector(job, 0, ft),
                              injector=FaultInjector(0), ft=ft, me=0,
                              plan=uniform_plan(UniformLayout(1, 1, 1), [0], 4, 8),
                              backend="nccl", shards=ShardReplicas(1),
                              teardown=Teardown("nccl", STORE_PORT, api=rec))


def test_a_rank_leaving_its_step_aborts_interrupts_then_destroys_before_recovering() -> None:
    rec = RecordingGroups(NCCL_JOB)
    controller = _controller(rec)
    seen: list[list] = []
    controller._serve = lambda *_: seen.append(rec.calls()) or "redo"  # the recovery proper
    assert controller.abandon(SimpleNamespace(iteration=4), "oom") == "redo"
    assert seen == [LEFT]


def test_a_failed_recovery_attempt_leaves_its_groups_before_the_next() -> None:
    """The others' watchers abort the failed attempt's communicators: this rank must abort
    them too before the next attempt destroys them."""
    rec = RecordingGroups(NCCL_JOB)
    controller = _controller(rec)
    seen: list[list] = []

    def attempt(*_) -> bool:
        seen.append(rec.calls())
        if len(seen) == 1:
            raise RuntimeError("Connection closed by peer")
        return True

    controller._attempt = attempt
    trainer = SimpleNamespace(drop_layout=lambda: None)  # it holds no layout to free
    assert controller._recover(trainer, None, controller.detector.timeouts, time.time())
    assert seen == [[], LEFT] and controller.generation == 2


def test_the_watcher_interrupts_through_the_controllers_teardown() -> None:
    """One teardown, one lock: the watcher's abort cannot interleave with the main
    thread's destroy."""
    rec = RecordingGroups(NCCL_JOB)
    controller = _controller(rec).watch()
    try:
        announce(controller.job, FailureRecord(rank=1, time=0.0, reason="exit", exitcode=1))
        deadline = time.monotonic() + 10
        while len(rec.log) < 3:
            assert time.monotonic() < deadline, rec.log
            time.sleep(0.01)
    finally:
        controller.watcher.stop()
    assert [entry[0] for entry in rec.log] == ["abort-watcher"] * 3
    assert rec.calls() == LEFT[:3]


def test_a_communication_error_is_handled_under_a_hold(beat_dir) -> None:
    """Finding what caused the error reads the job store, and over a slow link each read may
    take seconds without a beat: the rank is held for the recovery's allowance first, and the
    wait keeps that hold (it beat with the step's 10 s and was killed as hung)."""
    controller = _controller(RecordingGroups(NCCL_JOB))
    controller.detector.timeouts = derive_timeouts(1.0, controller.ft)  # heartbeat 10 s
    controller.detector.beat()  # the step's beat
    announce(controller.job, FailureRecord(rank=1, time=0.0, reason="exit", exitcode=1))
    allowed: list[float] = []
    controller._leave_step = lambda *_: allowed.append(
        read_beats(beat_dir, [0])[0].timeout_s) or "redo"
    error = RuntimeError("Connection closed by peer")
    assert controller.handle(error, SimpleNamespace(iteration=4, rank=0)) == "redo"
    assert allowed == [pytest.approx(controller.ft.startup_timeout_s)]


def test_a_rank_leaving_its_step_drops_the_results_of_a_save_the_failure_cut_off(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Else the redo of that save reads them as its own (``megatron/ckpt_writes``)."""
    stale: queue.Queue = queue.Queue()
    stale.put({0: []})  # the cut-off save's, written before its barrier failed
    monkeypatch.setattr(filesystem_async, "_results_queue", stale)
    controller = _controller(RecordingGroups(NCCL_JOB))
    left: list[bool] = []
    controller._serve = lambda *_: left.append(stale.empty()) or "redo"
    assert controller.abandon(SimpleNamespace(iteration=4), "oom") == "redo"
    assert left == [True]
