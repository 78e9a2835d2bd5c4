"""Copies of the distributed optimizer's shards in host memory, so that a dead rank's shard
outlives it.

Every ``ft.shard_replica_interval`` steps (and before the first step, after each recovery
and before a join) each rank copies its pieces (``dist_opt.owned``: the fp32 main piece and
the optimizer state of every parameter piece it owns) to host memory, tensor by tensor
(``host_copies``; step counts as metadata), and sends the copy to its successor in a ring
(job ranks in ascending order, cyclic), receiving its predecessor's. The ring is the rank's
data-parallel group on a megatron layout, and every live rank in a plan (whose parts are
sharded over different holder sets).

The exchange runs off the training thread: a background thread sends and receives over a
gloo group of its own (one per world, ``_HostRing``), then all-reduces over it, which
commits the pair: every rank of the world then holds the copies of that step, so a rank may
recycle the buffers of its older pair at the next refresh. One copy is in flight at most
(the next refresh waits for it); on a GPU the device-to-host copy runs on a side stream and
the next optimizer step waits for it. Each rank keeps its two newest committed pairs (four
shards of host memory): a recovery (``recovery/shard_assembly``) chooses the newest step
whose copies every survivor can use, never the copy in flight, rebuilds whole units from
them, and the job resumes at that step.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from chameleon_megatron.megatron import groups
from chameleon_megatron.resilience.decision.layout import StateUnit
from chameleon_megatron.resilience.dist_opt import Owned, Piece, owned, state_keys
from chameleon_megatron.resilience.model_state import (
    megatron_leaves,
    tied_embedding,
    unit_parameters,
)
from chameleon_megatron.resilience.recovery.host_copies import (
    HostBuffers,
    HostCopy,
    HostMover,
    Scalar,
    spec_of,
)
from chameleon_megatron.resilience.recovery.run_state import RunState

Pieces = tuple[list[Owned], tuple[str, ...], list[tuple[str, torch.Tensor]]]
"""This rank's pieces, its optimizer's state keys, and the tensors a copy takes (``_pieces``)."""

logger = logging.getLogger(__name__)

PATIENCE_S = 2.0
"""After a failed step, the least time a copy still exchanging gets to land."""


@dataclass(frozen=True)
class ShardCopy:
    """One rank's pieces at one step, in host memory."""

    rank: int
    """The job rank whose shard this is."""
    group: tuple[int, ...]
    """The ranks sharing its units (job ranks, ascending; its data-parallel group on a
    megatron layout): their copies make its units whole."""
    iteration: int
    pieces: tuple[Piece, ...]
    keys: tuple[str, ...]
    """Optimizer-state keys (each piece has each)."""
    dtype: str
    """The model parameters' dtype (they are the main pieces cast to it)."""
    tied: bool
    """The model serves its word embedding as output weight too (one stage)."""
    data: HostCopy
    """Per piece ``i``: ``"i/main"`` and ``"i/<key>"`` in their own dtypes (a 0-dim state
    entry, such as Adam's step, as a scalar)."""
    units: tuple[StateUnit, ...] = ()
    """The units the rank holds (the others' copies also hold pieces of units it lacks)."""

    def tensor(self, index: int, key: str) -> torch.Tensor:
        """Piece ``index``'s ``key`` ("main" or an optimizer-state key), flat (0-dim for a
        scalar)."""
        t = self.data.tensor(f"{index}/{key}")
        return t if t.dim() == 0 else t.reshape(-1)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def meta(self) -> dict[str, Any]:
        """Everything but the data; the scalars are complete (after ``data.wait``)."""
        return {"rank": self.rank, "group": list(self.group), "iteration": self.iteration,
                "pieces": [[p.unit, p.name, p.start, p.end, list(p.shape)]
                           for p in self.pieces],
                "keys": list(self.keys), "dtype": self.dtype, "tied": self.tied,
                "units": list(self.units),
                "tensors": [[n, list(s), d] for n, s, d in self.data.spec],
                "scalars": self.data.scalars()}

    @classmethod
    def from_meta(cls, meta: dict[str, Any], reuse: HostBuffers | None = None) -> ShardCopy:
        """A copy to receive the data of (``reuse``'s host memory when it fits)."""
        pieces = tuple(Piece(u, n, s, e, tuple(shape)) for u, n, s, e, shape in meta["pieces"])
        spec = tuple((n, tuple(s), d) for n, s, d in meta["tensors"])
        scalars: dict[str, Scalar] = {n: (v, d) for n, (v, d) in meta["scalars"].items()}
        return cls(rank=meta["rank"], group=tuple(meta["group"]), iteration=meta["iteration"],
                   pieces=pieces, keys=tuple(meta["keys"]), dtype=meta["dtype"],
                   tied=meta["tied"], data=HostCopy.received(spec, scalars, reuse),
                   units=tuple(meta["units"]))


@torch.no_grad()
def collect(model: list[torch.nn.Module], optimizer: Any, mover: HostMover, *, rank: int,
            group: tuple[int, ...], iteration: int, reuse: HostBuffers | None = None,
            pieces: Pieces | None = None) -> ShardCopy:
    """This rank's pieces (``pieces``: as ``_pieces`` found them), being copied to host
    memory (``data.wait`` before reading)."""
    mine, keys, tensors = pieces or _pieces(model, optimizer)
    data = mover.copy_out(tensors, reuse)
    dtype = str(mine[0].param.dtype) if mine else "torch.float32"
    return ShardCopy(rank=rank, group=tuple(sorted(group)), iteration=iteration,
                     pieces=tuple(o.piece for o in mine), keys=keys, dtype=dtype,
                     tied=tied_embedding(model) is not None, data=data,
                     units=tuple(unit_parameters(model)))


def _pieces(model: list[torch.nn.Module], optimizer: Any) -> Pieces:
    """This rank's pieces, its optimizer's state keys, and the tensors a copy takes."""
    mine = owned(model, optimizer)
    keys = state_keys(optimizer)
    tensors = []
    for i, own in enumerate(mine):
        tensors.append((f"{i}/main", own.main))
        tensors += [(f"{i}/{key}", own.state[key]) for key in keys]
    return mine, keys, tensors


def _fits(copies: CopySet, pieces: Pieces) -> bool:
    """Whether a copy of ``pieces`` would reuse ``copies``' host memory."""
    return copies.own.data.buffers.spec == spec_of([(n, t) for n, t in pieces[2]
                                                    if t.dim() > 0])


@dataclass(frozen=True)
class CopySet:
    """A rank's copies of one step: its own shard, its predecessor's, and the run state."""

    own: ShardCopy
    replica: ShardCopy | None
    run: RunState

    @property
    def iteration(self) -> int:
        return self.own.iteration


class _HostRing:
    """A gloo group over the world for the copies alone: the thread exchanging them must
    not share a group with the training thread. Made once per world, by every rank of it at
    its first refresh (refreshes are collective over the world)."""

    def __init__(self) -> None:
        self._world: Any = None
        self._group: dist.ProcessGroup | None = None

    def group(self) -> dist.ProcessGroup:
        world = dist.group.WORLD
        if self._world is not world:  # (holding it: a new world is another object)
            timeout_s = groups.current_timeout().total_seconds()
            self._group = groups.new_groups([tuple(range(dist.get_world_size()))],
                                            timeout_s=timeout_s, backend="gloo")[0]
            self._world = world
        return self._group


class _Flight:
    """The copy being taken: its exchange runs on a thread of its own."""

    def __init__(self, copy: ShardCopy, run: RunState,
                 exchange: Callable[[ShardCopy], ShardCopy | None]) -> None:
        self.copy, self.run = copy, run
        self.replica: ShardCopy | None = None
        self.error: BaseException | None = None
        self.seconds = 0.0
        self.hooks: list[Any] = []
        self.reserved: ShardCopy | None = None
        """The older copy whose host memory the predecessor's is received into."""
        self._thread = threading.Thread(target=self._run, args=(exchange,),
                                        name="shard-copy", daemon=True)
        self._thread.start()

    def _run(self, exchange: Callable[[ShardCopy], ShardCopy | None]) -> None:
        start = time.perf_counter()
        try:
            self.replica = exchange(self.copy)
        except BaseException as exc:  # noqa: BLE001 - reported on the training thread
            self.error = exc
        self.seconds = time.perf_counter() - start

    def join(self, timeout_s: float | None = None) -> bool:
        """Wait for the exchange (at most ``timeout_s``); whether it ended."""
        self._thread.join(timeout_s)
        for hook in self.hooks:
            hook.remove()
        self.hooks = []
        return not self._thread.is_alive()


class ShardReplicas:
    """This rank's committed copies (its own shard and its predecessor's, at the two newest
    committed steps) and the copy in flight."""

    def __init__(self, interval: int, mover: HostMover | None = None,
                 fault: Callable[[int], None] = lambda step: None) -> None:
        """``fault(step)``: called in the exchange of the copy of ``step`` once the pair is
        exchanged, before the commit (fault injection)."""
        self.interval = interval
        self.mover = mover or HostMover()
        self.fault = fault
        self.sets: list[CopySet] = []
        """Committed, oldest first (at most two)."""
        self._flight: _Flight | None = None
        self._spare: CopySet | None = None
        """A set dropped whole (at a layout's first copy): its host memory, for reuse."""
        self._ring = _HostRing()
        self.seconds = 0.0
        """Time the training thread spent in refreshes (the steps wait for it)."""
        self.exchange_seconds = 0.0
        """Time the exchanges took on their thread, overlapping the steps."""
        self._last_exchange_s = 0.0
        """The last committed copy's exchange time."""

    @property
    def run(self) -> RunState | None:
        """The run state of the newest committed copies (the copy in flight lands first:
        committed, or dropped if its exchange failed)."""
        self.settle()
        return self.sets[-1].run if self.sets else None

    def at(self, iteration: int) -> CopySet | None:
        """The committed copies of step ``iteration``, if held."""
        return next((s for s in self.sets if s.iteration == iteration), None)

    def due(self, iteration: int) -> bool:
        """Whether the copies are refreshed after step ``iteration``."""
        newest = self._flight.copy.iteration if self._flight else \
            self.sets[-1].iteration if self.sets else None
        return newest is None or (iteration % self.interval == 0 and newest != iteration)

    def refresh(self, model: list[torch.nn.Module], optimizer: Any, run: RunState, *,
                me: int, world_to_job: tuple[int, ...], ring: dist.ProcessGroup,
                partners: tuple[int, ...] | None = None, wait: bool = True) -> None:
        """Copy, then exchange around ``ring`` (its members: every rank of the world calls
        this) and commit, on a thread; ``wait``: return once committed (raises what the
        exchange raised), and drop older copies (a new layout's first copy). The copy in
        flight before lands first; its error, if any, is raised here. ``partners``: the job
        ranks sharing this rank's units (None: the ring's)."""
        start = time.perf_counter()
        self._land(raise_error=True)
        world = dist.get_process_group_ranks(ring)
        job = [world_to_job[w] for w in world]
        recycled = self.sets.pop(0) if len(self.sets) > 1 else self._spare
        self._spare = None
        pieces = _pieces(model, optimizer)
        if wait and recycled is not None and not _fits(recycled, pieces):
            recycled = None  # another layout's: its memory goes before the new copy's comes
        copy = collect(model, optimizer, self.mover, rank=me, group=partners or tuple(job),
                       iteration=run.iteration, reuse=recycled and recycled.own.data.buffers,
                       pieces=pieces)
        order = sorted(job)
        exchange = _Exchange(self._ring.group(), order, job, world, me,
                             recycled and recycled.replica, self.fault)
        self._flight = _Flight(copy, run, exchange)
        self._flight.reserved = recycled and recycled.replica
        self._flight.hooks = _fence_before_step(optimizer, copy.data)
        if wait:
            self._land(raise_error=True, drop_older=True)
        self.seconds += time.perf_counter() - start

    def settle(self, *, failed: bool = False) -> None:
        """Wait for the copy in flight: committed, or dropped (its error logged). ``failed``:
        the step failed. A copy still exchanging well past the usual exchange time then
        waits on a rank that left (a gloo receive posted after its peer's connection closed
        waits out the group's timeout: 5-39 s measured) and can never commit (the commit
        needs every rank of the world): it is dropped, the committed copies stand."""
        patience = max(PATIENCE_S, 4 * self._last_exchange_s) if failed else None
        self._land(raise_error=False, patience_s=patience)

    def _land(self, *, raise_error: bool, drop_older: bool = False,
              patience_s: float | None = None) -> None:
        flight, self._flight = self._flight, None
        if flight is None:
            return
        if not flight.join(patience_s):  # its thread ends at its group's timeout
            logger.warning("shard copy of step %d dropped: still exchanging after %.1f s "
                           "with a rank that left", flight.copy.iteration, patience_s)
            return
        self.exchange_seconds += flight.seconds
        if flight.error is not None:
            logger.warning("shard copy of step %d failed: %s", flight.copy.iteration,
                           flight.error)
            self._spare = CopySet(flight.copy, flight.replica, flight.run)  # its memory
            if raise_error:
                raise flight.error
            return
        done = CopySet(flight.copy, flight.replica, flight.run)
        self._last_exchange_s = flight.seconds
        if drop_older and self.sets:  # kept for its memory only where the next copy fits
            old = self.sets[-1]
            self._spare = old if old.own.data.buffers.spec == done.own.data.buffers.spec \
                else None
            self.sets = []
        self.sets = [*self.sets[-1:], done]
        logger.debug({"event": "shard_replica", "rank": done.own.rank,
                      "iteration": done.iteration, "bytes": done.own.nbytes,
                      "replica_of": done.replica and done.replica.rank,
                      "exchange_s": round(flight.seconds, 6)})

    def metrics(self) -> dict[str, Any]:
        """Host memory held (committed copies and the one in flight) and the time the
        training thread spent refreshing them."""
        copies = [c for s in self.sets for c in (s.own, s.replica) if c is not None]
        if self._flight is not None:  # its own copy, and the memory its replica lands in
            copies += [c for c in (self._flight.copy, self._flight.reserved) if c is not None]
        return {"shard_copy_bytes": sum(c.nbytes for c in copies),
                "shard_copy_s": round(self.seconds, 6),
                "shard_exchange_s": round(self.exchange_seconds, 6)}


class _Exchange:
    """One copy's exchange around the ring and its commit (run on the copy's thread)."""

    def __init__(self, group: dist.ProcessGroup, order: list[int], job: list[int],
                 world: list[int], me: int, reuse: ShardCopy | None,
                 fault: Callable[[int], None]) -> None:
        self.group, self.reuse, self.fault = group, reuse, fault
        self.to = self.frm = None
        if len(order) > 1:
            k = order.index(me)
            after, before = order[(k + 1) % len(order)], order[k - 1]
            # the copies' group spans the world: its ranks are world ranks
            self.to, self.frm = world[job.index(after)], world[job.index(before)]

    def __call__(self, copy: ShardCopy) -> ShardCopy | None:
        copy.data.wait()
        replica = None
        timeout = groups.current_timeout(self.group)
        if self.to is not None:
            sends = _send(copy, self.to, self.group)
            replica = _recv(self.frm, self.group, self.reuse)
            for work in sends:
                work.wait(timeout)
        self.fault(copy.iteration)
        dist.all_reduce(torch.zeros(1), group=self.group)  # every rank holds its pair: commit
        return replica


def _fence_before_step(optimizer: Any, data: HostCopy) -> list[Any]:
    """On a GPU: the next optimizer step waits for the copy of the state it overwrites
    (hooks removed when the copy lands). On the host the copy is complete already."""
    if not data.asynchronous:
        return []
    return [leaf.optimizer.register_step_pre_hook(lambda *_: data.fence())
            for leaf in megatron_leaves(optimizer)]


def _send(copy: ShardCopy, dst: int, group: dist.ProcessGroup) -> list[dist.Work]:
    meta = torch.frombuffer(bytearray(json.dumps(copy.meta()).encode()), dtype=torch.uint8)
    head = torch.tensor([meta.numel()], dtype=torch.int64)
    return [dist.isend(t, dst=dst, group=group)
            for t in (head, meta, *copy.data.buffers.flats)]


def _recv(src: int, group: dist.ProcessGroup, reuse: ShardCopy | None) -> ShardCopy:
    timeout = groups.current_timeout(group)
    head = torch.zeros(1, dtype=torch.int64)
    dist.irecv(head, src=src, group=group).wait(timeout)
    meta = torch.zeros(int(head[0]), dtype=torch.uint8)
    dist.irecv(meta, src=src, group=group).wait(timeout)
    copy = ShardCopy.from_meta(json.loads(meta.numpy().tobytes().decode()),
                               reuse and reuse.data.buffers)
    for flat in copy.data.buffers.flats:
        dist.irecv(flat, src=src, group=group).wait(timeout)
    return copy
