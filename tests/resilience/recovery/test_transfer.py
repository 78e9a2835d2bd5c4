"""The restorer's executor over real gloo groups (one thread per member, in this process)."""

from __future__ import annotations

import datetime
import threading
import time
import weakref
from typing import Callable

import pytest
import torch
import torch.distributed as dist

from chameleon_megatron.megatron.groups import unregistered_gloo_group
from chameleon_megatron.resilience.decision.restorer import Transfer
from chameleon_megatron.resilience.recovery.packing import PACK_BELOW
from chameleon_megatron.resilience.recovery.transfer import MigrationError, migrate, waves

pytestmark = [pytest.mark.timeout(60), pytest.mark.serial]


class DictView:
    """item -> kind -> name -> tensor."""

    def __init__(self, data: dict) -> None:
        self.data = data

    def tensors(self, item, kind):
        return self.data.get(item, {}).get(kind, {})


def run_members(size: int, body: Callable[[int, dist.ProcessGroup, dist.Store], object],
                timeout_s: float = 5.0) -> list:
    """Run body(group rank, group, store) on ``size`` threads; results or raised exceptions.
    Bodies start once every member's group is built: a member that leaves at once must not
    close its connections while the others' gloo is still connecting (that fails their group
    construction, not what the test asks about)."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    results: list = [None] * size
    built = threading.Barrier(size)

    def member(rank: int) -> None:
        try:
            client = dist.TCPStore("127.0.0.1", server.port, is_master=False,
                                   timeout=datetime.timedelta(seconds=timeout_s))
            group = unregistered_gloo_group(dist.PrefixStore("pg/", client), rank, size,
                                            timeout_s=timeout_s)
            built.wait(timeout=30)
            results[rank] = body(rank, group, dist.PrefixStore("mig/", client))
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            results[rank] = exc
    threads = [threading.Thread(target=member, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    return results


def layer(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)}


def test_transfers_and_local_copies_land_in_the_new_state() -> None:
    """Survivors 4, 7, 9 (group ranks 0, 1, 2): 4 holds layer 0 (params and Adam moments), 7
    layer 1; afterwards 9 holds both, 4 keeps layer 0 by a local copy, old state untouched."""
    src = {0: {"params": layer(0), "optimizer": {"w/exp_avg": torch.full((4, 3), 7.0)}},
           1: {"params": layer(1)}}
    old = [DictView({0: src[0]}), DictView({1: src[1]}), DictView({})]
    new = [DictView({0: {"params": {k: torch.zeros_like(v) for k, v in layer(0).items()}}}),
           DictView({}),
           DictView({i: {k: {n: torch.zeros_like(t) for n, t in d.items()}
                         for k, d in src[i].items()} for i in (0, 1)})]
    ids = (4, 7, 9)
    plan = [Transfer(4, 9, 0, "params", 60), Transfer(4, 9, 0, "optimizer", 48),
            Transfer(7, 9, 1, "params", 60), Transfer(4, 4, 0, "params", 60)]

    reports = run_members(3, lambda r, g, s: migrate(g, ids, ids[r], plan, old=old[r],
                                                     new=new[r], store=s, timeout_s=5))
    assert not any(isinstance(r, Exception) for r in reports), reports
    for item in (0, 1):
        for kind, tensors in src[item].items():
            for name, t in tensors.items():
                assert torch.equal(new[2].tensors(item, kind)[name], t)
    assert torch.equal(new[0].tensors(0, "params")["w"], layer(0)["w"])
    assert torch.equal(old[0].tensors(0, "params")["w"], layer(0)["w"])
    bytes_l0 = (12 + 3) * 4
    assert reports[0].sent_bytes == bytes_l0 + 12 * 4 and reports[0].copied_bytes == bytes_l0
    assert reports[2].received_bytes == 2 * bytes_l0 + 12 * 4


def mixed_unit(seed: int) -> dict[str, torch.Tensor]:
    """Tensors that travel packed (small fp32, small bf16) and alone (large, 0-dim)."""
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(3, generator=g), "b": torch.randn(64, 64, generator=g),
            "c": torch.randn(10, generator=g).bfloat16(), "d": torch.tensor(7.0 + seed),
            "e": torch.randn(PACK_BELOW // 4 + 1, generator=g),
            "f": torch.randn(5, generator=g).bfloat16(), "g": torch.randn(2, 3, generator=g)}


@pytest.mark.parametrize("wave_bytes", [1, 2**30])
def test_packed_and_lone_tensors_land_bitwise(wave_bytes: int) -> None:
    """Three units from rank 0 to rank 1, one wave each or all in one: small tensors of one
    dtype go as one message (unpacked at the receiver in name order), large and 0-dim ones
    alone; every tensor lands exactly."""
    src = {i: {"params": mixed_unit(i)} for i in range(3)}
    new = DictView({i: {"params": {n: torch.zeros_like(t) for n, t in mixed_unit(i).items()}}
                    for i in range(3)})
    views = [(DictView(src), DictView({})), (DictView({}), new)]
    plan = [Transfer(0, 1, i, "params", 1.0) for i in range(3)]
    reports = run_members(2, lambda r, g, s: migrate(g, (0, 1), r, plan, old=views[r][0],
                                                     new=views[r][1], store=s, timeout_s=5,
                                                     wave_bytes=wave_bytes))
    assert not any(isinstance(r, Exception) for r in reports), reports
    for i in range(3):
        for name, t in src[i]["params"].items():
            assert torch.equal(new.data[i]["params"][name], t), (i, name)
    assert reports[1].received_bytes == reports[0].sent_bytes == sum(
        t.numel() * t.element_size() for u in src.values() for t in u["params"].values())


def test_a_shape_mismatch_fails_every_member_and_leaves_state_alone() -> None:
    old = [DictView({0: {"params": {"w": torch.ones(4, 3)}}}), DictView({})]
    target = torch.zeros(3, 4)
    new = [DictView({}), DictView({0: {"params": {"w": target}}})]
    plan = [Transfer(0, 1, 0, "params", 48)]
    results = run_members(2, lambda r, g, s: migrate(g, (0, 1), r, plan, old=old[r],
                                                     new=new[r], store=s, timeout_s=5))
    assert all(isinstance(r, MigrationError) for r in results), results
    assert "'w' is [4, 3] torch.float32 on the sender, the receiver wants [3, 4]" in str(results[0])
    assert torch.equal(target, torch.zeros(3, 4))


def test_a_missing_tensor_is_named() -> None:
    old = [DictView({0: {"params": {"w": torch.ones(2)}}}), DictView({})]
    new = [DictView({}), DictView({0: {"params": {"w": torch.zeros(2), "b": torch.zeros(2)}}})]
    plan = [Transfer(0, 1, 0, "params", 48)]
    results = run_members(2, lambda r, g, s: migrate(g, (0, 1), r, plan, old=old[r],
                                                     new=new[r], store=s, timeout_s=5))
    assert all(isinstance(r, MigrationError) for r in results), results
    assert "the sender holds no tensor 'b'" in str(results[0])


def test_a_member_that_never_takes_part_fails_the_migration_for_the_others() -> None:
    """Rank 2 (a receiver) is gone after joining the group: the sender and the bystander
    both get MigrationError within the group timeout instead of returning success."""
    old = [DictView({0: {"params": {"w": torch.ones(2)}}}), DictView({}), DictView({})]
    new = [DictView({}), DictView({}), DictView({0: {"params": {"w": torch.zeros(2)}}})]
    plan = [Transfer(0, 2, 0, "params", 8)]

    def body(rank, group, store):
        if rank == 2:
            return "gone"
        return migrate(group, (0, 1, 2), rank, plan, old=old[rank], new=new[rank],
                       store=store, timeout_s=1.5)
    results = run_members(3, body, timeout_s=1.5)
    assert isinstance(results[0], MigrationError) and isinstance(results[1], MigrationError)


def test_a_sender_waiting_for_a_receiver_leaves_when_the_attempt_is_abandoned() -> None:
    """The receiver never says what it wants (it left the attempt): the sender's wait in the
    store ends as soon as the attempt is abandoned, not after its timeout."""
    from chameleon_megatron.resilience.recovery.transfer import _read_wants
    from chameleon_megatron.resilience.store.waits import Abandoned

    store, start = dist.HashStore(), time.monotonic()
    threading.Timer(0.2, lambda: store.set("retry", "1")).start()
    with pytest.raises(Abandoned):
        _read_wants(store, [Transfer(0, 1, 0, "params", 1.0)], timeout_s=60, abandoned=lambda: store.check(["retry"]))
    assert time.monotonic() - start < 5


def test_waves_split_the_transfers_by_bytes_the_same_way_everywhere() -> None:
    """100 fp32 elements are 400 bytes: a 1000-byte budget takes two, then one more is over
    it; a transfer larger than the budget goes alone."""
    small, big = [["w", [100], "torch.float32"]], [["w", [10, 100], "torch.bfloat16"]]
    assert waves([small, small, small, big, small], 1000) == [range(0, 2), range(2, 3),
                                                             range(3, 4), range(4, 5)]
    assert waves([], 1000) == []


class BuiltOnRead(DictView):
    """Old state whose every read builds new tensors (as assembled units do), with their
    specs known beforehand; it counts how many built tensors are alive at each read."""

    def __init__(self, data: dict) -> None:
        super().__init__(data)
        self.alive: list[weakref.ref] = []
        self.most_alive = 0

    def specs(self, item, kind):
        return {n: (list(t.shape), str(t.dtype)) for n, t in self.data.get(item, {}).get(
            kind, {}).items()}

    def tensors(self, item, kind):
        self.alive = [r for r in self.alive if r() is not None]
        self.most_alive = max(self.most_alive, len(self.alive))
        built = {n: t.clone() for n, t in super().tensors(item, kind).items()}
        self.alive += [weakref.ref(t) for t in built.values()]
        return built


class Settling(DictView):
    """New state that records, per unit it settles, whether the unit had landed whole."""

    def __init__(self, data: dict, expect: dict) -> None:
        super().__init__(data)
        self.expect = expect
        self.settled: list[tuple] = []

    def settle(self, item, kind):
        landed = all(torch.equal(self.data[item][kind][n], t)
                     for n, t in self.expect[item][kind].items())
        self.settled.append((item, kind, landed))


def test_units_move_in_waves_read_when_sent_and_settled_when_landed() -> None:
    """Rank 0 sends four layers to rank 1 in waves of one transfer: it reads each layer
    just before sending it, while the wave before moves (at most two waves' tensors alive:
    all four layers' were held before waves), and rank 1 settles each unit once it has
    landed."""
    src = {i: {"params": layer(i)} for i in range(4)}
    old = BuiltOnRead(src)
    new = Settling({i: {"params": {k: torch.zeros_like(v) for k, v in layer(i).items()}}
                    for i in range(4)}, src)
    plan = [Transfer(0, 1, i, "params", 60) for i in range(4)]
    views = [(old, DictView({})), (DictView({}), new)]
    reports = run_members(2, lambda r, g, s: migrate(g, (0, 1), r, plan, old=views[r][0],
                                                     new=views[r][1], store=s, timeout_s=5,
                                                     wave_bytes=1))
    assert not any(isinstance(r, Exception) for r in reports), reports
    assert new.settled == [(i, "params", True) for i in range(4)]
    assert old.most_alive <= 4, old.most_alive  # two layers' tensors, not four layers'
    for i in range(4):
        assert all(torch.equal(new.data[i]["params"][n], t) for n, t in layer(i).items())


class Logged(DictView):
    """A view that appends its reads ("read", layer) and settles ("settle", layer) to a
    log shared by the old and new state of one rank."""

    def __init__(self, data: dict, log: list) -> None:
        super().__init__(data)
        self.log = log

    def tensors(self, item, kind):
        if item in self.data:
            self.log.append(("read", item))
        return super().tensors(item, kind)

    def settle(self, item, kind):
        self.log.append(("settle", item))


def test_a_wave_is_read_and_posted_while_the_one_before_moves() -> None:
    """Transfers alternate direction, one per wave: rank 1 reads the layer it sends in wave
    k + 1 before it settles the one it received in wave k (each wave waited for only after
    the next is posted), and every layer lands."""
    plan = [Transfer(i % 2, 1 - i % 2, i, "params", 60) for i in range(4)]
    logs: list[list] = [[], []]
    views = []
    for r in range(2):
        mine = {i: {"params": layer(i)} for i in range(4) if i % 2 == r}
        empty = {i: {"params": {k: torch.zeros_like(v) for k, v in layer(i).items()}}
                 for i in range(4) if i % 2 != r}
        views.append((Logged(mine, logs[r]), Logged(empty, logs[r])))
    reports = run_members(2, lambda r, g, s: migrate(g, (0, 1), r, plan, old=views[r][0],
                                                     new=views[r][1], store=s, timeout_s=5,
                                                     wave_bytes=1))
    assert not any(isinstance(r, Exception) for r in reports), reports
    receiving = [entry for entry in logs[1] if entry != ("read", 0) and entry != ("read", 2)]
    assert receiving[-4:] == [("read", 1), ("settle", 0), ("read", 3), ("settle", 2)], logs[1]
    for r in range(2):
        for i in range(4):
            if i % 2 != r:
                got = views[r][1].data[i]["params"]
                assert all(torch.equal(got[n], t) for n, t in layer(i).items())
