"""The restorer's executor: move parameters and optimizer state between survivors.

The transfer list is the restorer's (``restorer.Transfer``): a sender and a receiver
(survivors, by the rank ids of the plan; ``members`` maps them to recovery-group ranks), a
state unit (a global layer index, ``"embedding"`` or ``"output"``) and a kind (``"params"`` or
``"optimizer"``); a sender equal to its receiver is a local copy. The receiver decides which tensors it needs: it publishes
their names, shapes and dtypes in the store, and the sender sends exactly those, after
checking it holds each with the same shape (so differences such as tied output weights or a
different pipeline split are resolved by name, and a mismatch is a clear error, not garbage).

The receiver writes into its new model and optimizer; the sender reads from its old ones,
which the caller keeps until ``migrate`` returns: it returns only after every member has
confirmed that all its transfers completed, and raises ``MigrationError`` everywhere if any
did not, so that recovery can be retried from intact old state.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch
import torch.distributed as dist

from chameleon_megatron.resilience.decision.layout import StateUnit
from chameleon_megatron.resilience.decision.restorer import StateKind, Transfer
from chameleon_megatron.resilience.recovery.host_copies import HostMover
from chameleon_megatron.resilience.store.waits import wait_keys

logger = logging.getLogger(__name__)

MAX_TENSORS_PER_TRANSFER = 4096
"""Message tags are transfer index x this + tensor index."""


class StateView(Protocol):
    """Named tensors of one state unit on this rank (old state: to read; new: to fill)."""

    def tensors(self, unit: StateUnit, kind: StateKind) -> dict[str, torch.Tensor]: ...


@dataclass(frozen=True)
class MigrationReport:
    sent_bytes: int
    received_bytes: int
    copied_bytes: int
    """Moved locally, old state to new, on this rank."""
    seconds: float


class MigrationError(RuntimeError):
    """Some transfer did not complete; old state is intact on every rank."""


def _spec(tensors: dict[str, torch.Tensor]) -> str:
    return json.dumps([[n, list(t.shape), str(t.dtype)] for n, t in sorted(tensors.items())])


def _matching(have: dict[str, torch.Tensor], want: list, where: str) -> list[torch.Tensor]:
    out = []
    for name, shape, dtype in want:
        tensor = have.get(name)
        if tensor is None:
            raise MigrationError(f"{where}: the sender holds no tensor {name!r}")
        if list(tensor.shape) != shape or str(tensor.dtype) != dtype:
            raise MigrationError(f"{where}: {name!r} is {list(tensor.shape)} {tensor.dtype} on "
                                 f"the sender, the receiver wants {shape} {dtype}")
        out.append(tensor)
    return out


class _Exchange:
    """This rank's posted sends and receives of one migration."""

    def __init__(self, group: dist.ProcessGroup, me: int, members: Sequence[int]) -> None:
        self.group = group
        self.me = me
        self.rank_of = {m: i for i, m in enumerate(members)}
        self.works: list = []
        self.unstage: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.sent = self.received = self.copied = 0
        self.mover = HostMover()

    def send(self, tensors: list[torch.Tensor], dst: int, base_tag: int) -> None:
        for j, buf in enumerate(self.mover.to_host(tensors)):  # gloo moves host memory
            self.works.append(self.group.send([buf], self.rank_of[dst], base_tag + j))
            self.sent += buf.numel() * buf.element_size()

    def recv(self, tensors: list[torch.Tensor], src: int, base_tag: int) -> None:
        for j, t in enumerate(tensors):
            buf = self.mover.staging(t)
            if buf is not t:
                self.unstage.append((buf, t))
            self.works.append(self.group.recv([buf], self.rank_of[src], base_tag + j))
            self.received += buf.numel() * buf.element_size()

    def copy(self, src: list[torch.Tensor], dst: list[torch.Tensor]) -> None:
        for s, d in zip(src, dst):
            if not _same_memory(s, d):  # else adopted by the new state (recovery.overlap)
                d.copy_(s)
            self.copied += d.numel() * d.element_size()

    def finish(self) -> None:
        for work in self.works:
            work.wait()
        self.mover.to_device(self.unstage)


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.shape == b.shape
            and a.stride() == b.stride() and a.device == b.device)


@torch.no_grad()
def migrate(group: dist.ProcessGroup, members: Sequence[int], me: int,
            transfers: Sequence[Transfer], *, old: StateView, new: StateView, store: dist.Store,
            timeout_s: float,
            abandoned: Callable[[], bool] = lambda: False) -> MigrationReport:
    """Run this rank's part of ``transfers`` (identical list on every member), then confirm.

    ``members``: the rank ids of the recovery group, in group-rank order; ``me`` is this
    rank's id.

    Three votes of all members: at the start (a member already gone fails everyone at once,
    before senders wait in the store for what a dead receiver will never ask), after every
    sender has checked what its receivers want (so a mismatch fails fast, before anyone waits
    on a message that will not come), and after every transfer completed. ``store`` must be
    private to this migration; a sender's wait there ends early once ``abandoned()`` (the
    recovery attempt is over).
    """
    start = time.perf_counter()
    _confirm(group, None, "start")
    ex = _Exchange(group, me, members)
    mine = [(idx, t) for idx, t in enumerate(transfers) if me in (t.src, t.dst)]
    error: Exception | None = None
    try:
        for idx, t in mine:
            if t.dst == me:
                _publish_want(store, idx, t, new)
        sending = {idx: _check_send(store, idx, t, old, timeout_s, abandoned) for idx, t in mine
                   if t.src == me}
    except Exception as exc:  # noqa: BLE001 - every member must still vote
        error = exc
    _confirm(group, error, "checking")
    try:
        for idx, t in mine:
            tag = idx * MAX_TENSORS_PER_TRANSFER
            receiving = (None if t.dst != me
                         else [v for _, v in sorted(new.tensors(t.layer, t.kind).items())])
            if t.src == t.dst:
                ex.copy(sending[idx], receiving)
            elif t.src == me:
                ex.send(sending[idx], t.dst, tag)
            else:
                ex.recv(receiving, t.src, tag)
        ex.finish()
    except Exception as exc:  # noqa: BLE001
        error = exc
    _confirm(group, error, "transfer")
    return MigrationReport(sent_bytes=ex.sent, received_bytes=ex.received,
                           copied_bytes=ex.copied, seconds=time.perf_counter() - start)


def _publish_want(store: dist.Store, idx: int, t: Transfer, new: StateView) -> None:
    wanted = new.tensors(t.layer, t.kind)
    if len(wanted) > MAX_TENSORS_PER_TRANSFER:
        raise MigrationError(f"unit {t.layer!r}: {len(wanted)} tensors, more than "
                             f"{MAX_TENSORS_PER_TRANSFER}")
    store.set(f"want/{idx}", _spec(wanted))


def _check_send(store: dist.Store, idx: int, t: Transfer, old: StateView, timeout_s: float,
                abandoned: Callable[[], bool]) -> list[torch.Tensor]:
    """The tensors the receiver of transfer ``idx`` wants, in its order, checked."""
    wait_keys(store, [f"want/{idx}"], timeout_s=timeout_s, abandoned=abandoned)
    want = json.loads(store.get(f"want/{idx}"))
    where = f"transfer {idx} ({t.kind} of {t.layer!r}, {t.src}->{t.dst})"
    return _matching(old.tensors(t.layer, t.kind), want, where)


def _confirm(group: dist.ProcessGroup, error: Exception | None, stage: str) -> None:
    """All members vote; any failure (or a member gone) fails the migration everywhere."""
    if error is not None:
        logger.error("migration %s failed on this rank: %s", stage, error)
    failed = torch.tensor([0 if error is None else 1], dtype=torch.int64)
    try:
        group.allreduce([failed]).wait()
    except RuntimeError as exc:
        raise MigrationError(f"{stage} vote failed (a member is gone?): {exc}") from error
    if error is not None:
        raise MigrationError(f"{stage} failed on this rank: {error}") from error
    if failed.item():
        raise MigrationError(f"{stage} failed on {failed.item()} member(s)")
