"""Shard copies taken off the training thread, over real gloo processes.

Four processes share one parameter (each owns a quarter: fp32 main, bf16 moment, a 0-dim
step) and copy their pieces every 2 of 6 fake steps around the ring 0 -> 1 -> 2 -> 3 -> 0,
overlapped (the exchange on its thread) or synchronous. Then the survivors publish what
they hold, choose the step, assemble the whole parameter over a recovery group and compare
it, bit for bit, with the state of that step. A failure inside the exchange of step 4 (rank
0 exits after the exchange, before the commit) must leave everyone at step 2.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from chameleon_megatron.megatron.groups import unregistered_gloo_group
from chameleon_megatron.resilience.dist_opt import Owned, Piece
from chameleon_megatron.resilience.recovery import shard_assembly as sa
from chameleon_megatron.resilience.recovery import shard_replica
from chameleon_megatron.resilience.recovery.run_state import RunState

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(480)]  # (4 spawned processes)

WORLD, STEPS, INTERVAL, FAIL_STEP, EXIT = 4, 6, 2, 4, 43


def piece_values(rank: int, step: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s piece after step ``step`` (0-dim step count included)."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    main = torch.randn(2, generator=g)
    return {"main": main, "exp_avg": torch.randn(2, generator=g).to(torch.bfloat16),
            "step": torch.tensor(float(step))}


def whole(step: int) -> dict[str, torch.Tensor]:
    parts = [piece_values(r, step) for r in range(WORLD)]
    return {"w": torch.cat([p["main"] for p in parts]).view(4, 2),
            "w/exp_avg": torch.cat([p["exp_avg"] for p in parts]).view(4, 2),
            "w/step": torch.tensor(float(step))}


def _worker(rank: int, port: int, sync: bool, fail: bool, out: str) -> None:
    timeout = datetime.timedelta(seconds=10)  # a survivor's exchange may wait it out
    patience = datetime.timedelta(seconds=60)  # (then the others wait for that survivor)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=patience)
    # everyone started (a loaded machine starts them seconds apart) before the group's
    # short timeout applies
    store.set(f"started/{rank}", "1")
    store.wait([f"started/{r}" for r in range(WORLD)], patience)
    dist.init_process_group("gloo", store=dist.PrefixStore("world/", store), rank=rank,
                            world_size=WORLD, timeout=timeout)
    param = torch.zeros(4, 2)
    state = {"main": torch.zeros(2), "exp_avg": torch.zeros(2, dtype=torch.bfloat16),
             "step": torch.tensor(0.0)}
    mine = Owned(Piece(0, "w", 2 * rank, 2 * rank + 2, (4, 2)), param, state["main"],
                 {"exp_avg": state["exp_avg"], "step": state["step"]})
    shard_replica.owned = lambda model, optimizer: [mine]  # a fake distributed optimizer
    shard_replica.state_keys = lambda optimizer: ("exp_avg", "step")
    shard_replica.tied_embedding = lambda model: None
    shard_replica.unit_parameters = lambda model: {0: {"w": param}}

    def fault(step: int) -> None:
        if fail and rank == 0 and step == FAIL_STEP:
            os._exit(EXIT)
    replicas = shard_replica.ShardReplicas(INTERVAL, fault=fault)
    error = ""
    try:
        for step in range(1, STEPS + 1):
            for key, value in piece_values(rank, step).items():  # the optimizer's step
                state[key].copy_(value)
            if replicas.due(step):
                replicas.refresh([], None, RunState(step, 10 * step), me=rank,
                                 world_to_job=tuple(range(WORLD)), ring=dist.group.WORLD,
                                 wait=sync)
        replicas.settle()
    except RuntimeError as exc:  # the failed exchange, raised at the next refresh
        error = str(exc)
    survivors = [r for r in range(WORLD) if not (fail and r == 0)]
    scope = dist.PrefixStore("recovery/", store)
    sa.publish(scope, rank, replicas)
    scope.wait(sa.keys(survivors), patience)
    held = sa.read(scope, survivors)
    chosen = sa.choose(held, survivors)
    states = sa.agreed_states(held, {m: RunState(STEPS, 10 * STEPS) for m in survivors})
    group = unregistered_gloo_group(dist.PrefixStore("rec/", store), survivors.index(rank),
                                    len(survivors), timeout_s=60)
    units = sa.assemble(group, survivors, rank, held, replicas, chosen)
    torch.save({"step": chosen, "error": error, "run": states[rank].iteration,
                "samples": states[rank].consumed_samples,
                "held": [s.iteration for s in replicas.sets],
                "units": {**units.tensors(0, "params"), **units.tensors(0, "optimizer")}},
               Path(out) / f"{rank}.pt")
    os._exit(0)  # (the world has a dead member: no teardown)


def run(tmp_path: Path, *, sync: bool, fail: bool) -> dict[int, dict]:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    # spawn: a fork of this multi-threaded test process can deadlock in the child
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, server.port, sync, fail, str(tmp_path)))
             for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(180)
    codes = [p.exitcode for p in procs]
    for p in procs:  # a hung worker must not hold the test session at its exit
        if p.is_alive():
            p.kill()
            p.join()
    assert codes == [EXIT if fail and r == 0 else 0 for r in range(WORLD)], codes
    return {r: torch.load(tmp_path / f"{r}.pt") for r in range(WORLD)
            if (tmp_path / f"{r}.pt").exists()}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def assert_state_of(result: dict, step: int) -> None:
    want = whole(step)
    assert sorted(result["units"]) == sorted(want)
    for name, t in want.items():
        got = result["units"][name]
        assert got.dtype == t.dtype and torch.equal(bits(got), bits(t)), name


@pytest.mark.parametrize("fail", [False, True], ids=["no-failure", "failure-in-flight"])
def test_overlapped_copies_recover_what_synchronous_ones_do(tmp_path: Path, fail: bool) -> None:
    (tmp_path / "sync").mkdir()
    (tmp_path / "overlap").mkdir()
    sync = run(tmp_path / "sync", sync=True, fail=fail)
    overlap = run(tmp_path / "overlap", sync=False, fail=fail)
    step = 2 if fail else STEPS
    assert sorted(sync) == sorted(overlap) == ([1, 2, 3] if fail else [0, 1, 2, 3])
    for rank in overlap:
        for result in (sync[rank], overlap[rank]):
            assert result["step"] == step and result["run"] == step, result
            assert result["samples"] == 10 * step  # the run state of those copies
            assert_state_of(result, step)
        assert bool(overlap[rank]["error"]) == fail, overlap[rank]["error"]  # (reset, timeout)
    # overlapped, the two newest committed pairs stay (the older one recycled at a refresh)
    assert overlap[1]["held"] == ([2] if fail else [4, 6])


def test_after_a_failed_step_a_copy_stuck_on_a_rank_that_left_is_dropped(monkeypatch) -> None:
    """A copy whose exchange waits on a rank that left would hold the recovery for its
    group's whole timeout (measured: 5-39 s): after a failed step it gets a bounded wait,
    then is dropped and the committed copies stand. Without a failure, settling waits for
    the copy and commits it."""
    import threading
    import time
    import types

    monkeypatch.setattr(shard_replica, "PATIENCE_S", 0.2)
    release = threading.Event()
    copy = types.SimpleNamespace(iteration=11, rank=0, nbytes=0)
    replicas = shard_replica.ShardReplicas(interval=1)
    replicas._flight = shard_replica._Flight(copy, RunState(iteration=11, consumed_samples=0),
                                             lambda _: release.wait(30) and None)
    start = time.monotonic()
    replicas.settle(failed=True)
    assert time.monotonic() - start < 5 and replicas.sets == [] and replicas._flight is None
    release.set()

    replicas._flight = shard_replica._Flight(copy, RunState(iteration=11, consumed_samples=0),
                                             lambda _: time.sleep(0.5))
    replicas.settle()
    assert [s.iteration for s in replicas.sets] == [11]


def test_a_new_layouts_first_copy_lets_the_old_layouts_pairs_go(monkeypatch) -> None:
    """In a world of one, two overlapped copies of a 2-element piece are held; then the
    layout changes (a 3-element piece) and its first copy is taken and waited for (as after
    a recovery): the older pair, which does not fit it, is let go before the new copy
    allocates, and the newer one is not kept for reuse afterwards. In the same layout the
    older pair's memory is reused and the newer one kept."""
    import weakref

    size = [2]
    state = {}

    def mine(model, optimizer):
        n = size[0]
        state.update(main=torch.ones(n), exp_avg=torch.ones(n), step=torch.tensor(1.0))
        return [Owned(Piece(0, "w", 0, n, (n,)), torch.zeros(n), state["main"],
                      {"exp_avg": state["exp_avg"], "step": state["step"]})]
    monkeypatch.setattr(shard_replica, "owned", mine)
    monkeypatch.setattr(shard_replica, "state_keys", lambda optimizer: ("exp_avg", "step"))
    monkeypatch.setattr(shard_replica, "tied_embedding", lambda model: None)
    monkeypatch.setattr(shard_replica, "unit_parameters", lambda model: {0: {}})
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        def refresh(step: int, wait: bool) -> None:
            replicas.refresh([], None, RunState(step, step), me=0, world_to_job=(0,),
                             ring=dist.group.WORLD, wait=wait)

        def older_alive_at_copy(step: int) -> bool:
            older = weakref.ref(replicas.sets[0].own.data.buffers)
            seen = []
            real = replicas.mover.copy_out
            replicas.mover.copy_out = lambda *a: seen.append(older() is not None) or real(*a)
            refresh(step, wait=True)
            replicas.mover.copy_out = real
            return seen == [True]

        replicas = shard_replica.ShardReplicas(interval=1)
        refresh(1, wait=False)
        refresh(2, wait=False)
        replicas.settle()
        assert older_alive_at_copy(3)  # same layout: reused
        assert replicas._spare is not None and [s.iteration for s in replicas.sets] == [3]
        refresh(4, wait=False)
        replicas.settle()
        size[0] = 3  # a new layout
        assert not older_alive_at_copy(5)
        assert replicas._spare is None and [s.iteration for s in replicas.sets] == [5]
    finally:
        dist.destroy_process_group()
