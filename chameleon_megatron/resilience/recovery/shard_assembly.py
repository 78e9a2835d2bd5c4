"""Whole units from the distributed optimizer's shard copies, at a recovery.

Each member publishes what it holds (``ShardReplicas``: its own copy and its predecessor's,
as metadata) in the generation's store. A survivor can serve its units as a transfer source
when every rank of its old data-parallel group has a copy at the agreed step on some member:
the rank's own, or the replica its successor holds. ``unassemblable`` names the survivors
that cannot (two neighbours of one group dead, copies of different steps): the decision
treats them as stale, so units nobody can assemble fall back to the checkpoint.
``assemble`` moves the copies each survivor lacks (point-to-point in the recovery group) and
returns its units at that step as a ``StateView``.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist

from chameleon_megatron.resilience.decision.layout import EMBEDDING, OUTPUT, StateUnit
from chameleon_megatron.resilience.decision.restorer import StateKind
from chameleon_megatron.resilience.recovery.shard_replica import ShardCopy, ShardReplicas

Held = Mapping[int, Mapping[str, Any]]
"""Member -> {"own": copy metadata or None, "replica": copy metadata or None}."""
Move = tuple[int, str, int, int]
"""(source member, "own" or "replica", destination member, job rank whose copy)."""


def publish(scope: dist.Store, me: int, replicas: ShardReplicas | None) -> None:
    own = replicas.own if replicas is not None else None
    replica = replicas.replica if replicas is not None else None
    scope.set(f"shards/{me}", json.dumps({"own": own and own.meta(),
                                          "replica": replica and replica.meta()}))


def keys(members: Sequence[int]) -> list[str]:
    return [f"shards/{m}" for m in members]


def read(scope: dist.Store, members: Sequence[int]) -> dict[int, dict]:
    return {m: json.loads(scope.get(k)) for m, k in zip(members, keys(members))}


def providers(held: Held, iteration: int) -> dict[int, tuple[int, str]]:
    """Job rank -> (member, slot) holding its copy at ``iteration`` (its own copy first)."""
    out: dict[int, tuple[int, str]] = {}
    for slot in ("own", "replica"):
        for member, h in sorted(held.items()):
            copy = h[slot]
            if copy and copy["iteration"] == iteration:
                out.setdefault(copy["rank"], (member, slot))
    return out


def _groups(held: Held) -> dict[int, tuple[int, ...]]:
    """Member -> its old data-parallel group, for members holding a copy of their own."""
    return {m: tuple(h["own"]["group"]) for m, h in held.items() if h["own"]}


def unassemblable(held: Held, iteration: int) -> tuple[int, ...]:
    """Members holding a shard that cannot rebuild their units at ``iteration``."""
    have = providers(held, iteration)
    return tuple(sorted(m for m, group in _groups(held).items()
                        if have.get(m, (None, ""))[1] != "own"
                        or any(x not in have for x in group)))


def sources(held: Held, iteration: int, completed: int) -> dict[str, Any]:
    """Where the recovery takes the state from, for its record: the shard copies of step
    ``iteration`` (``completed`` - ``iteration`` steps rolled back), dead ranks' from their
    replicas."""
    have = providers(held, iteration)
    return {"source": "shard copies", "iteration": iteration,
            "rolled_back_steps": max(completed - iteration, 0),
            "replicas_of": sorted(r for r, (_, slot) in have.items() if slot == "replica")}


def moves(held: Held, iteration: int) -> list[Move]:
    """Every copy each assembling member lacks, and who sends it (pure)."""
    have, refused = providers(held, iteration), set(unassemblable(held, iteration))
    return [(*have[x], m, x) for m, group in sorted(_groups(held).items()) if m not in refused
            for x in group if x != m]


@torch.no_grad()
def assemble(group: Any, members: Sequence[int], me: int, held: Held,
             replicas: ShardReplicas | None, iteration: int) -> Any:
    """Exchange the copies (collective over the recovery ``group``: every member calls it)
    and return this member's whole units at ``iteration`` (empty when it has none)."""
    index = {m: i for i, m in enumerate(members)}
    works, got = [], []
    for src, slot, dst, rank in moves(held, iteration):
        if src == me:
            copy = replicas.own if slot == "own" else replicas.replica
            if dst == me:
                got.append(copy)
            else:
                works.append(group.send([copy.flat], index[dst], rank))
        elif dst == me:
            meta = held[src][slot]
            empty = ShardCopy.from_meta(meta, torch.zeros(0))
            copy = ShardCopy.from_meta(meta, torch.zeros(empty.numel()))
            works.append(group.recv([copy.flat], index[src], rank))
            got.append(copy)
    for work in works:
        work.wait()
    if replicas is None or replicas.own is None or me in unassemblable(held, iteration):
        return AssembledUnits([])
    return AssembledUnits([replicas.own, *got], keep=replicas.own.units)


class AssembledUnits:
    """Whole units rebuilt from shard copies: a ``StateView`` to read (the model parameters
    are their main copies cast to the model's dtype, as the optimizer writes them)."""

    def __init__(self, copies: Sequence[ShardCopy], keep: Sequence[StateUnit] = ()) -> None:
        """``keep``: the units to rebuild (default: every unit the copies hold pieces of)."""
        self._keep = set(keep)
        self._placed: set = set()
        self._entries: dict[StateUnit, dict[str, dict[str, torch.Tensor]]] = {}
        self._shapes: dict[tuple[StateUnit, str], tuple[int, ...]] = {}
        covered: dict[tuple[StateUnit, str], int] = {}
        for copy in copies:
            self._place(copy, covered)
        for (unit, name), count in covered.items():
            whole = _numel(self._shapes[(unit, name)])
            if count != whole:
                raise ValueError(f"unit {unit!r} {name}: the shard copies hold {count} of its "
                                 f"{whole} elements")
        first = copies[0] if copies else None
        self._dtype = getattr(torch, first.dtype.removeprefix("torch.")) if first else None
        self._keys = first.keys if first else ()
        if first and first.tied and "word_embeddings.weight" in self._entries.get(EMBEDDING, {}):
            self._entries.setdefault(OUTPUT, {})["output_layer.weight"] = \
                self._entries[EMBEDDING]["word_embeddings.weight"]
            self._shapes[(OUTPUT, "output_layer.weight")] = \
                self._shapes[(EMBEDDING, "word_embeddings.weight")]

    def _place(self, copy: ShardCopy, covered: dict) -> None:
        offset = 0
        for piece in copy.pieces:
            sizes = copy.sizes(piece)
            chunks = copy.flat[offset:offset + sum(sizes)].split(sizes)
            offset += sum(sizes)
            if (self._keep and piece.unit not in self._keep) or piece in self._placed:
                continue  # (a plan keeps the tied copy whole on each holder: the same piece)
            self._placed.add(piece)
            whole = _numel(piece.shape)
            entry = self._entries.setdefault(piece.unit, {}).setdefault(piece.name, {})
            self._shapes[(piece.unit, piece.name)] = piece.shape
            for key, chunk in zip(("main", *copy.keys), chunks):
                if key == "step":
                    entry[key] = chunk.reshape(()).clone()
                    continue
                entry.setdefault(key, torch.zeros(whole))[piece.start:piece.end] = chunk
            key = (piece.unit, piece.name)
            covered[key] = covered.get(key, 0) + piece.numel

    def units(self) -> tuple[StateUnit, ...]:
        return tuple(self._entries)

    def tensors(self, unit: StateUnit, kind: StateKind) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for name, entry in self._entries.get(unit, {}).items():
            shape = self._shapes[(unit, name)]
            if kind == "params":
                out[name] = entry["main"].view(shape).to(self._dtype)
                if self._dtype != torch.float32:
                    out[f"{name}/main"] = entry["main"].view(shape)
            else:
                out.update({f"{name}/{key}": entry[key] if key == "step" else
                            entry[key].view(shape) for key in self._keys})
        return out


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
