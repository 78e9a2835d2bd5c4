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
import math
import time
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch
import torch.distributed as dist

from chameleon_megatron.resilience.decision.layout import StateUnit
from chameleon_megatron.resilience.decision.restorer import StateKind, Transfer
from chameleon_megatron.resilience.recovery.host_copies import HostMover, dtype_of
from chameleon_megatron.resilience.recovery.packing import (Bundle, Item, Pool, bundles,
                                                            laid_out)
from chameleon_megatron.resilience.store.waits import wait_keys

logger = logging.getLogger(__name__)

MAX_TENSORS_PER_TRANSFER = 4096
"""Message tags are transfer index x this + tensor index."""
WAVE_BYTES = 32 * 2**20
"""The size of a wave (``waves``); two are in flight at once, one moving while the next is
read. Beyond that, the units a rank rebuilds to send and the whole units a sink stages add
up."""


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


Spec = dict[str, tuple[list[int], str]]
"""Name -> (shape, dtype) of the tensors of one unit and kind."""


def _specs(view: StateView, unit: StateUnit, kind: StateKind) -> Spec:
    """What ``view.tensors(unit, kind)`` returns, without building it where the view can
    say (``specs``: assembled units, a sink's staging)."""
    specs = getattr(view, "specs", None)
    if specs is not None:
        return specs(unit, kind)
    return {n: (list(t.shape), str(t.dtype)) for n, t in view.tensors(unit, kind).items()}


def _check(have: Spec, want: list, where: str) -> None:
    for name, shape, dtype in want:
        if name not in have:
            raise MigrationError(f"{where}: the sender holds no tensor {name!r}")
        if list(have[name][0]) != shape or have[name][1] != dtype:
            raise MigrationError(f"{where}: {name!r} is {list(have[name][0])} {have[name][1]} "
                                 f"on the sender, the receiver wants {shape} {dtype}")


def _nbytes(want: list) -> int:
    return sum(math.prod(shape) * dtype_of(dtype).itemsize for _, shape, dtype in want)


def waves(wants: Sequence[list], budget: int) -> list[range]:
    """Consecutive transfers moved together, about ``budget`` bytes each (a larger one
    alone). Every member splits the same list the same way, so both ends of a transfer post
    it in the same wave and each wave's operations are all posted before anyone waits:
    no member waits on one the other has not posted."""
    out: list[range] = []
    start, size = 0, 0
    for idx, want in enumerate(wants):
        n = _nbytes(want)
        if idx > start and size + n > budget:
            out.append(range(start, idx))
            start, size = idx, 0
        size += n
    if start < len(wants):
        out.append(range(start, len(wants)))
    return out


class _Exchange:
    """This rank's sends and receives of one migration: listed as a wave's units are read,
    posted (``packing.bundles``) when the wave is ``take``n."""

    def __init__(self, group: dist.ProcessGroup, me: int, members: Sequence[int]) -> None:
        self.group = group
        self.me = me
        self.rank_of = {m: i for i, m in enumerate(members)}
        self.sending: list[Item] = []
        self.receiving: list[Item] = []
        self.works: list = []
        self.unstage: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.sent = self.received = self.copied = 0
        self.mover = HostMover()
        self.pool = Pool(pinned=self.mover.pinned)
        self.pooled: list[torch.Tensor] = []

    def send(self, tensors: list[torch.Tensor], dst: int, base_tag: int) -> None:
        self.sending += [Item(dst, base_tag + j, t) for j, t in enumerate(tensors)]

    def recv(self, tensors: list[torch.Tensor], src: int, base_tag: int) -> None:
        self.receiving += [Item(src, base_tag + j, t) for j, t in enumerate(tensors)]

    def _post_sends(self) -> None:
        out = bundles(self.sending)
        lone = iter(self.mover.to_host([b.tensors[0] for b in out if not b.packed]))
        for b in out:  # gloo moves host memory
            buf = self.mover.pack(b.tensors, self._pooled(b)) if b.packed else next(lone)
            self.works.append(self.group.send([buf], self.rank_of[b.peer], b.tag))
            self.sent += b.nbytes
        self.sending = []

    def _post_recvs(self) -> None:
        for b in bundles(self.receiving):
            if b.packed:
                buf = self._pooled(b)
                self.unstage += laid_out(buf, b.tensors)
            else:
                buf = self.mover.staging(b.tensors[0])
                if buf is not b.tensors[0]:
                    self.unstage.append((buf, b.tensors[0]))
            self.works.append(self.group.recv([buf], self.rank_of[b.peer], b.tag))
            self.received += b.nbytes
        self.receiving = []

    def _pooled(self, b: Bundle) -> torch.Tensor:
        """A host buffer for packed message ``b``, back in the pool once its wave landed."""
        buf = self.pool.take(b.tensors[0].dtype, sum(t.numel() for t in b.tensors))
        self.pooled.append(buf)
        return buf

    def copy(self, src: list[torch.Tensor], dst: list[torch.Tensor]) -> None:
        for s, d in zip(src, dst):
            if not _same_memory(s, d):  # else adopted by the new state (recovery.overlap)
                d.copy_(s)
            self.copied += d.numel() * d.element_size()

    def take(self) -> _Posted:
        """Post what was listed since the last ``take``; its operations, to wait for later."""
        self._post_sends()
        self._post_recvs()
        posted = _Posted(self.works, self.unstage, self.mover, self.pool, self.pooled)
        self.works, self.unstage, self.pooled = [], [], []
        return posted


@dataclass(frozen=True)
class _Posted:
    """Operations of one wave: its sends and receives, its staged receive buffers and the
    pooled buffers its messages use."""

    works: list
    unstage: list[tuple[torch.Tensor, torch.Tensor]]
    mover: HostMover
    pool: Pool
    pooled: list[torch.Tensor]

    def wait(self) -> None:
        """Every operation completed, received tensors in place (what they held goes)."""
        for work in self.works:
            work.wait()
        self.mover.to_device(self.unstage)
        self.pool.give(self.pooled)


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.shape == b.shape
            and a.stride() == b.stride() and a.device == b.device)


@torch.no_grad()
def migrate(group: dist.ProcessGroup, members: Sequence[int], me: int,
            transfers: Sequence[Transfer], *, old: StateView, new: StateView, store: dist.Store,
            timeout_s: float, abandoned: Callable[[], bool] = lambda: False,
            wave_bytes: int = WAVE_BYTES) -> MigrationReport:
    """Run this rank's part of ``transfers`` (identical list on every member), then confirm.

    ``members``: the rank ids of the recovery group, in group-rank order; ``me`` is this
    rank's id.

    Three votes of all members: at the start (a member already gone fails everyone at once,
    before senders wait in the store for what a dead receiver will never ask), after every
    sender has checked what its receivers want (so a mismatch fails fast, before anyone waits
    on a message that will not come), and after every transfer completed. ``store`` must be
    private to this migration; a wait there ends early once ``abandoned()`` (the recovery
    attempt is over). The transfers move in ``waves`` of about ``wave_bytes``, two in
    flight: a sender reads each unit just before its wave (assembled units are built then)
    while the wave before moves, and a receiver that can ``settle`` a unit does so when its
    wave has landed.
    """
    start = time.perf_counter()
    _confirm(group, None, "start")
    ex = _Exchange(group, me, members)
    wants: list[list] = []
    error: Exception | None = None
    try:
        _publish_wants(store, me, transfers, new)
        wants = _read_wants(store, transfers, timeout_s, abandoned)
        for idx, t in enumerate(transfers):
            if t.src == me:
                _check(_specs(old, t.layer, t.kind), wants[idx], _where(idx, t))
    except Exception as exc:  # noqa: BLE001 - every member must still vote
        error = exc
    _confirm(group, error, "checking")
    try:
        landing: tuple[range, _Posted] | None = None
        for wave in waves(wants, wave_bytes):
            for idx in wave:
                _post(ex, idx, transfers[idx], wants[idx], old, new)
            posted = ex.take()
            if landing is not None:  # the previous wave moves while this one was read
                _land(*landing, transfers, me, new)
            landing = (wave, posted)
        if landing is not None:
            _land(*landing, transfers, me, new)
    except Exception as exc:  # noqa: BLE001
        error = exc
    _confirm(group, error, "transfer")
    return MigrationReport(sent_bytes=ex.sent, received_bytes=ex.received,
                           copied_bytes=ex.copied, seconds=time.perf_counter() - start)


def _land(wave: range, posted: _Posted, transfers: Sequence[Transfer], me: int,
          new: StateView) -> None:
    """Wait for ``wave``'s operations, then settle the units this rank received in it."""
    posted.wait()
    settle = getattr(new, "settle", None)
    for idx in wave:
        if settle is not None and transfers[idx].dst == me:
            settle(transfers[idx].layer, transfers[idx].kind)


def _post(ex: _Exchange, idx: int, t: Transfer, want: list, old: StateView,
          new: StateView) -> None:
    """Post this rank's part of transfer ``idx`` (a local one is copied at once)."""
    me = ex.me
    if me not in (t.src, t.dst):
        return
    sending: list[torch.Tensor] = []
    if t.src == me:
        have = old.tensors(t.layer, t.kind)
        sending = [have[name] for name, _, _ in want]
        adopt = getattr(new, "adopt", None)
        if t.dst == me and adopt is not None:  # staged without a copy where it fits
            adopt(t.layer, t.kind, have)
    receiving = [] if t.dst != me else [v for _, v in sorted(new.tensors(t.layer,
                                                                         t.kind).items())]
    tag = idx * MAX_TENSORS_PER_TRANSFER
    if t.src == t.dst:
        ex.copy(sending, receiving)
    elif t.src == me:
        ex.send(sending, t.dst, tag)
    else:
        ex.recv(receiving, t.src, tag)


def _where(idx: int, t: Transfer) -> str:
    return f"transfer {idx} ({t.kind} of {t.layer!r}, {t.src}->{t.dst})"


def _publish_wants(store: dist.Store, me: int, transfers: Sequence[Transfer],
                   new: StateView) -> None:
    """What this rank receives, every transfer's tensors by name, in one key."""
    wanted: dict[int, list] = {}
    for idx, t in enumerate(transfers):
        if t.dst != me:
            continue
        spec = _specs(new, t.layer, t.kind)
        if len(spec) > MAX_TENSORS_PER_TRANSFER:
            raise MigrationError(f"unit {t.layer!r}: {len(spec)} tensors, more than "
                                 f"{MAX_TENSORS_PER_TRANSFER}")
        wanted[idx] = [[n, shape, dtype] for n, (shape, dtype) in sorted(spec.items())]
    if wanted:
        store.set(f"want/{me}", json.dumps(wanted))


def _read_wants(store: dist.Store, transfers: Sequence[Transfer], timeout_s: float,
                abandoned: Callable[[], bool]) -> list[list]:
    """What the receiver of every transfer wants, in its order (every member splits the
    waves from these)."""
    keys = [f"want/{r}" for r in sorted({t.dst for t in transfers})]
    if keys:
        wait_keys(store, keys, timeout_s=timeout_s, abandoned=abandoned)
    wants: dict[int, list] = {}
    for key in keys:
        wants.update((int(idx), want) for idx, want in json.loads(store.get(key)).items())
    return [wants[idx] for idx in range(len(transfers))]


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
