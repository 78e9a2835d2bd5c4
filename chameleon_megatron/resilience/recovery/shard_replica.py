"""Copies of the distributed optimizer's shards in host memory, so that a dead rank's shard
outlives it.

Every ``ft.shard_replica_interval`` steps (and before the first step, and after each
recovery) each rank copies its pieces (``dist_opt.owned``: the fp32 main piece and the
optimizer state of every parameter piece it owns) to host memory and sends the copy to its
successor in a ring (job ranks in ascending order, cyclic), receiving its predecessor's. The
ring is the rank's data-parallel group on a megatron layout, and every live rank in a plan
(whose parts are sharded over different holder sets). A barrier over the ring then commits
both, with the run state of that step; a failure before the commit leaves the previous pair
in force everywhere in the ring.

The host memory used is two shards per rank (its own, its predecessor's). The recovery
(``recovery/shard_assembly``) rebuilds whole units from the survivors' copies and the dead
ranks' replicas, and the job resumes at their step.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from chameleon_megatron.megatron import groups
from chameleon_megatron.resilience.decision.layout import StateUnit
from chameleon_megatron.resilience.dist_opt import Piece, owned, state_keys
from chameleon_megatron.resilience.model_state import tied_embedding, unit_parameters
from chameleon_megatron.resilience.recovery.run_state import RunState

logger = logging.getLogger(__name__)


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
    """Optimizer-state keys; ``step`` takes one element per piece, the others the piece's."""
    dtype: str
    """The model parameters' dtype (they are the main pieces cast to it)."""
    tied: bool
    """The model serves its word embedding as output weight too (one stage)."""
    flat: torch.Tensor
    """fp32; per piece, its main elements, then each key's."""
    units: tuple[StateUnit, ...] = ()
    """The units the rank holds (the others' copies also hold pieces of units it lacks)."""

    def sizes(self, piece: Piece) -> list[int]:
        return [piece.numel] + [1 if key == "step" else piece.numel for key in self.keys]

    def numel(self) -> int:
        return sum(sum(self.sizes(p)) for p in self.pieces)

    def meta(self) -> dict[str, Any]:
        return {"rank": self.rank, "group": list(self.group), "iteration": self.iteration,
                "pieces": [[p.unit, p.name, p.start, p.end, list(p.shape)]
                           for p in self.pieces],
                "keys": list(self.keys), "dtype": self.dtype, "tied": self.tied,
                "units": list(self.units)}

    @classmethod
    def from_meta(cls, meta: dict[str, Any], flat: torch.Tensor) -> ShardCopy:
        pieces = tuple(Piece(u, n, s, e, tuple(shape)) for u, n, s, e, shape in meta["pieces"])
        return cls(rank=meta["rank"], group=tuple(meta["group"]), iteration=meta["iteration"],
                   pieces=pieces, keys=tuple(meta["keys"]), dtype=meta["dtype"],
                   tied=meta["tied"], flat=flat, units=tuple(meta["units"]))


@torch.no_grad()
def collect(model: list[torch.nn.Module], optimizer: Any, *, rank: int,
            group: tuple[int, ...], iteration: int) -> ShardCopy:
    """This rank's pieces, copied to host memory."""
    mine = owned(model, optimizer)
    keys = state_keys(optimizer)
    parts = []
    for own in mine:
        parts.append(own.main.detach().reshape(-1))
        parts += [own.state[key].detach().reshape(-1).float() for key in keys]
    flat = torch.cat([p.float() for p in parts]).cpu() if parts else torch.zeros(0)
    dtype = str(mine[0].param.dtype) if mine else "torch.float32"
    return ShardCopy(rank=rank, group=tuple(sorted(group)), iteration=iteration,
                     pieces=tuple(o.piece for o in mine), keys=keys, dtype=dtype,
                     tied=tied_embedding(model) is not None, flat=flat,
                     units=tuple(unit_parameters(model)))


class ShardReplicas:
    """This rank's committed copies: its own shard and its predecessor's."""

    def __init__(self, interval: int) -> None:
        self.interval = interval
        self.own: ShardCopy | None = None
        self.replica: ShardCopy | None = None
        self.run: RunState | None = None
        """The run state of the step the copies hold."""
        self.seconds = 0.0
        """Time spent refreshing, in total (the steps wait for it)."""

    def due(self, iteration: int) -> bool:
        """Whether the copies are refreshed after step ``iteration``."""
        return self.own is None or (iteration % self.interval == 0
                                    and self.own.iteration != iteration)

    def refresh(self, model: list[torch.nn.Module], optimizer: Any, run: RunState, *,
                me: int, world_to_job: tuple[int, ...], ring: dist.ProcessGroup,
                partners: tuple[int, ...] | None = None) -> None:
        """Copy, exchange around ``ring`` (a gloo group), commit (collective over it).
        ``partners``: the job ranks sharing this rank's units (None: the ring's)."""
        start = time.perf_counter()
        world = dist.get_process_group_ranks(ring)
        job = [world_to_job[w] for w in world]
        copy = collect(model, optimizer, rank=me, group=partners or tuple(job),
                       iteration=run.iteration)
        order = sorted(job)
        replica = None
        if len(order) > 1:
            k = order.index(me)
            after, before = order[(k + 1) % len(order)], order[k - 1]
            to, frm = world[job.index(after)], world[job.index(before)]
            sends = _send(copy, to, ring)
            replica = _recv(frm, ring)
            for work in sends:
                work.wait(groups.current_timeout(ring))
            dist.all_reduce(torch.zeros(1), group=ring)  # everyone holds both: commit
        self.own, self.replica, self.run = copy, replica, run
        self.seconds += time.perf_counter() - start
        logger.debug({"event": "shard_replica", "rank": me, "iteration": run.iteration,
                      "bytes": copy.flat.numel() * 4, "replica_of": replica and replica.rank})


    def metrics(self) -> dict[str, Any]:
        """Host memory held (own and replica copies) and the time spent refreshing them."""
        held = sum(c.flat.numel() * 4 for c in (self.own, self.replica) if c is not None)
        return {"shard_copy_bytes": held, "shard_copy_s": round(self.seconds, 6)}


def _send(copy: ShardCopy, dst: int, group: dist.ProcessGroup) -> list[dist.Work]:
    meta = torch.frombuffer(bytearray(json.dumps(copy.meta()).encode()), dtype=torch.uint8)
    head = torch.tensor([meta.numel(), copy.flat.numel()], dtype=torch.int64)
    return [dist.isend(t, dst=dst, group=group) for t in (head, meta, copy.flat)]


def _recv(src: int, group: dist.ProcessGroup) -> ShardCopy:
    timeout = groups.current_timeout(group)
    head = torch.zeros(2, dtype=torch.int64)
    dist.irecv(head, src=src, group=group).wait(timeout)
    meta = torch.zeros(int(head[0]), dtype=torch.uint8)
    dist.irecv(meta, src=src, group=group).wait(timeout)
    flat = torch.zeros(int(head[1]), dtype=torch.float32)
    dist.irecv(flat, src=src, group=group).wait(timeout)
    return ShardCopy.from_meta(json.loads(meta.numpy().tobytes().decode()), flat)
