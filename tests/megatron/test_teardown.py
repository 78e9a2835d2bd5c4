"""The teardown's order (abort NCCL, shut connections down, destroy), its lock against the
abort watcher, and the refusal of NCCL fault tolerance on a torch without
``ProcessGroup.abort``. The process-group API is a recording stand-in."""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from chameleon_megatron.megatron import torch_seams
from chameleon_megatron.megatron.teardown import Teardown, TorchGroups
from recording_groups import RecordingGroups

pytestmark = pytest.mark.timeout(30)

NCCL_JOB = {"world": "nccl", "tp": "nccl", "dp_gloo": "gloo", "host": "gloo"}
"""An NCCL job: its world and megatron's groups on NCCL; megatron's gloo data-parallel group
and the plan's host ring, where the shard copies travel, on gloo."""
STORE_PORT = 4321


def test_leaving_aborts_nccl_then_shuts_connections_but_the_stores_then_destroys() -> None:
    """Destroying an NCCL group waits for its queued work, and a peer that aborted forces an
    abort: abort comes first. The gloo groups of an NCCL job are interrupted too."""
    rec = RecordingGroups(NCCL_JOB)
    assert Teardown("nccl", STORE_PORT, api=rec).leave() == 3  # 2 communicators, 1 connection
    assert rec.calls() == [("abort", ("world", "tp")), ("aborted",),
                           ("close", frozenset({STORE_PORT})), ("destroy",)]


def test_interrupting_leaves_the_groups_registered() -> None:
    rec = RecordingGroups(NCCL_JOB)
    Teardown("nccl", STORE_PORT, api=rec).interrupt()
    assert rec.calls() == [("abort", ("world", "tp")), ("aborted",),
                           ("close", frozenset({STORE_PORT}))]


def test_without_a_store_port_no_connection_is_shut_down() -> None:
    """An in-process store's connections cannot be told apart from the groups'."""
    rec = RecordingGroups({"world": "gloo"})
    assert Teardown("gloo", None, api=rec).leave() == 0
    assert rec.calls() == [("abort", ()), ("aborted",), ("destroy",)]


def test_the_watchers_interrupt_and_the_main_threads_leave_never_interleave() -> None:
    """The watcher aborts while the main thread leaves: the main thread's abort and destroy
    wait until the watcher's interrupt is over."""
    rec = RecordingGroups(NCCL_JOB, hold_first_abort=True)
    teardown = Teardown("nccl", STORE_PORT, api=rec)
    watcher = threading.Thread(target=teardown.interrupt, name="watcher")
    main = threading.Thread(target=teardown.leave, name="main")
    watcher.start()
    assert rec.entered.wait(5)
    main.start()
    time.sleep(0.3)  # the main thread, unlocked, would abort and destroy meanwhile
    assert [entry[0] for entry in rec.log] == ["watcher"]
    rec.release.set()
    watcher.join(5)
    main.join(5)
    assert [(entry[0], entry[1]) for entry in rec.log] == [
        ("watcher", "abort"), ("watcher", "aborted"), ("watcher", "close"),
        ("main", "abort"), ("main", "aborted"), ("main", "close"), ("main", "destroy")]


def test_a_torch_without_process_group_abort_refuses_nccl_at_start() -> None:
    class OldProcessGroup:  # torch < 2.7: no ProcessGroup.abort
        pass

    with pytest.raises(torch_seams.TorchSeamError,
                       match=r"ProcessGroup.abort is missing \(torch 2.7 added it\)"):
        torch_seams.check_abort(OldProcessGroup)
    torch_seams.check_abort(dist.ProcessGroup)  # this torch has it
    TorchGroups("nccl")
