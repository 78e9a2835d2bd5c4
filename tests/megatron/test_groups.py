"""The group builder in one process (world, megatron layout, timeouts), and the teardown
that interrupts a peer blocked on this rank."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist
from megatron.core import parallel_state

from chameleon_megatron.megatron import groups, torch_seams
from chameleon_megatron.megatron.platform import cpu_platform
from chameleon_megatron.megatron.teardown import Teardown
from chameleon_megatron.resilience.config import ResilienceConfig
from chameleon_megatron.resilience.recovery.detector import FailureDetector
from chameleon_megatron.resilience.store.heartbeat import Heartbeat, read_beats
from chameleon_megatron.resilience.store.job_store import JobStore

pytestmark = [pytest.mark.timeout(60), pytest.mark.serial]


def test_build_use_and_tear_down_a_world(tmp_path: Path) -> None:
    with cpu_platform():
        with pytest.raises(ValueError, match=r"rank=1: must be in \[0, 1\)"):
            groups.init_world(dist.HashStore(), 1, 1, backend="gloo", timeout_s=5)
        groups.init_world(dist.HashStore(), 0, 1, backend="gloo", timeout_s=5)
        try:
            with pytest.raises(ValueError, match="tp=2 x pp=1: must divide the world size 1"):
                groups.build_uniform(2, 1, timeout_s=5)
            groups.build_uniform(1, 1, timeout_s=2)
            assert parallel_state.get_data_parallel_world_size() == 1
            n = groups.set_timeouts(1.5)
            assert n == len(torch_seams.registered_groups()) > 5  # the world and megatron's groups
            assert Teardown("gloo", None).interrupt() == 0  # no NCCL; no store port: no shutdown
            _detector_derives_timeouts_once_steps_are_measured(tmp_path)
            with pytest.raises(ValueError, match="timeout=0 s: must be > 0"):
                groups.set_timeouts(0)
        finally:
            groups.destroy()
        assert not dist.is_initialized() and not parallel_state.model_parallel_is_initialized()
        groups.destroy()  # idempotent


def _detector_derives_timeouts_once_steps_are_measured(beats: Path) -> None:
    job = JobStore(dist.HashStore(), "run")
    ft = ResilienceConfig(startup_timeout_s=50, timing_steps=2, pg_timeout_factor=3,
                          min_pg_timeout_s=0.5)
    detector = FailureDetector(job, 0, ft, Heartbeat(beats, 0))
    for iteration, seconds, heartbeat in [(1, 10.0, 100.0), (2, 0.4, 100.0), (3, 0.6, 3.6)]:
        detector.step_done(iteration, seconds)
        beat = read_beats(beats, [0])[0]
        assert (beat.iteration, beat.timeout_s) == (iteration, pytest.approx(heartbeat))
    assert detector.timeouts.pg_s == pytest.approx(1.8)
    detector.new_layout()
    assert detector.timeouts.pg_s == 50 and read_beats(beats, [0])[0].timeout_s == 100


def _blocked_peer(rank: int, port: int, backend: str, out) -> None:
    """Rank 0 waits in a recv from rank 1 (alive, in a gloo group with a 60 s timeout); rank 1
    leaves the world (``Teardown.leave`` of a job on ``backend``) instead of sending."""
    import datetime
    import time

    import torch

    store = dist.TCPStore("127.0.0.1", port, is_master=False,
                          timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=60))
    dist.barrier()
    if rank == 1:
        held = dist.group.WORLD  # as a model holds its groups: destroy alone closes nothing
        time.sleep(0.5)
        out.put(("interrupted", Teardown(backend, port).leave()))
        assert not dist.is_initialized()
        store.set("after", "1")  # the store survives
        store.wait(["seen"], datetime.timedelta(seconds=30))  # alive until rank 0 is done
        del held
        return
    start = time.monotonic()
    try:
        dist.recv(torch.zeros(4), src=1)
        out.put(("received", None))
    except RuntimeError as exc:
        out.put(("raised", (time.monotonic() - start, str(exc), store.get("after").decode())))
    finally:
        store.set("seen", "1")
        groups.destroy()


@pytest.mark.timeout(180)  # two spawned interpreters importing megatron on a loaded machine
@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_leaving_makes_a_peer_blocked_on_a_live_rank_raise_at_once(backend: str) -> None:
    """gloo's abort/shutdown/destroy leave an op blocked on a live peer waiting for the
    group's timeout; shutting the leaving rank's connections down ends it within a second
    (and the job store's connection stays usable). In an NCCL job too: the shard copies
    and the recovery travel over gloo."""
    import multiprocessing

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_blocked_peer, args=(r, server.port, backend, out))
             for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        results = dict(out.get(timeout=150) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert results["interrupted"] >= 1
    waited, message, after = results["raised"]
    assert waited < 1.5 and after == "1", (waited, message)
