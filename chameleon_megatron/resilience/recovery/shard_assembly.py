"""Whole units from the distributed optimizer's shard copies, at a recovery.

Each member publishes what it holds (``ShardReplicas``: its committed copies, its own and
its predecessor's at each of its two newest committed steps, with their run states) in the
generation's store; the copy in flight is not among them. ``choose`` picks the step the
recovery resumes at: the newest at which every member holding model state can rebuild its
units, so that all agree on one step's copies (a failure while a copy was in flight leaves
some members committed to it and others not: they all still hold the step before).
A survivor can serve its units as a transfer source when every rank of its old
data-parallel group has a copy at that step on some member: the rank's own, or the replica
its successor holds. ``unassemblable`` names the survivors that cannot (two neighbours of
one group dead): the decision treats them as stale, so units nobody can assemble fall back
to the checkpoint. ``assemble`` moves the copies each survivor lacks (point-to-point in the
recovery group) and returns its units at that step as a ``StateView`` that builds a unit
whole only when it is read.
"""

from __future__ import annotations

import base64
import json
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist

from chameleon_megatron.resilience.decision.layout import EMBEDDING, OUTPUT, StateUnit
from chameleon_megatron.resilience.decision.restorer import StateKind
from chameleon_megatron.resilience.recovery.host_copies import dtype_of
from chameleon_megatron.resilience.recovery.run_state import RunState
from chameleon_megatron.resilience.recovery.shard_replica import ShardCopy, ShardReplicas

Held = Mapping[int, Sequence[Mapping[str, Any]]]
"""Member -> its committed copy sets, oldest first: {"own": copy metadata, "replica": copy
metadata or None, "run": its run state (base64)}."""
Move = tuple[int, str, int, int]
"""(source member, "own" or "replica", destination member, job rank whose copy)."""
MAX_BUFFERS = 64
"""Message tags are job rank x this + the copy's buffer index (one per dtype)."""


def publish(scope: dist.Store, me: int, replicas: ShardReplicas | None) -> None:
    sets = replicas.sets if replicas is not None else []
    scope.set(f"shards/{me}", json.dumps([
        {"own": s.own.meta(), "replica": s.replica and s.replica.meta(),
         "run": base64.b64encode(s.run.to_bytes()).decode()} for s in sets]))


def keys(members: Sequence[int]) -> list[str]:
    return [f"shards/{m}" for m in members]


def read(scope: dist.Store, members: Sequence[int]) -> dict[int, list]:
    return {m: json.loads(scope.get(k)) for m, k in zip(members, keys(members))}


def _at(sets: Sequence[Mapping[str, Any]], iteration: int) -> Mapping[str, Any] | None:
    return next((s for s in sets if s["own"]["iteration"] == iteration), None)


def providers(held: Held, iteration: int) -> dict[int, tuple[int, str]]:
    """Job rank -> (member, slot) holding its copy at ``iteration`` (its own copy first)."""
    out: dict[int, tuple[int, str]] = {}
    for slot in ("own", "replica"):
        for member, sets in sorted(held.items()):
            found = _at(sets, iteration)
            copy = found and found[slot]
            if copy:
                out.setdefault(copy["rank"], (member, slot))
    return out


def _groups(held: Held) -> dict[int, tuple[int, ...]]:
    """Member -> its data-parallel group (of its newest copies), for members holding any."""
    return {m: tuple(sets[-1]["own"]["group"]) for m, sets in held.items() if sets}


def unassemblable(held: Held, iteration: int) -> tuple[int, ...]:
    """Members holding a shard that cannot rebuild their units at ``iteration``."""
    have = providers(held, iteration)
    return tuple(sorted(m for m, group in _groups(held).items()
                        if have.get(m, (None, ""))[1] != "own"
                        or any(x not in have for x in group)))


def choose(held: Held, holders: Sequence[int]) -> int:
    """The step whose copies the recovery uses: the newest at which every member of
    ``holders`` (those holding model state) can rebuild its units; when there is none, the
    newest any holds (the others are stale then); -1 when none holds a copy (pure)."""
    steps = sorted({s["own"]["iteration"] for m in holders for s in held.get(m, ())},
                   reverse=True)
    for step in steps:
        if not set(unassemblable(held, step)) & set(holders):
            return step
    return steps[0] if steps else -1


def agreed_states(held: Held, states: Mapping[int, RunState]) -> dict[int, RunState]:
    """Each member's run state at the step ``choose`` picks: a member holding model state
    is at that step with the run state of its copies of it, or holds none (-1) without
    them; spares keep theirs. A published state of that very step is kept (it says which
    work after the step the member was inside)."""
    holders = [m for m, s in states.items() if s.iteration >= 0]
    step = choose(held, holders)
    out = dict(states)
    for m in holders:
        if states[m].iteration == step:
            continue
        found = _at(held.get(m, ()), step)
        out[m] = RunState.from_bytes(base64.b64decode(found["run"])) if found else \
            RunState(iteration=-1, consumed_samples=0)
    return out


def sources(held: Held, iteration: int, completed: int) -> dict[str, Any]:
    """Where the recovery takes the state from, for its record: the shard copies of step
    ``iteration`` (``completed`` - ``iteration`` steps rolled back), dead ranks' from their
    replicas."""
    have = providers(held, iteration)
    return {"source": "shard copies", "iteration": iteration,
            "rolled_back_steps": max(completed - iteration, 0),
            "replicas_of": sorted(r for r, (_, slot) in have.items() if slot == "replica")}


def moves(held: Held, iteration: int) -> list[Move]:
    """Every copy each assembling member needs besides its own, and who sends it: the
    replica it holds itself where it is that copy (no transfer), else the copy's provider
    (pure)."""
    have, refused = providers(held, iteration), set(unassemblable(held, iteration))
    out: list[Move] = []
    for m, group in sorted(_groups(held).items()):
        if m in refused:
            continue
        replica = (_at(held[m], iteration) or {}).get("replica")
        out += [(m, "replica", m, x) if replica and replica["rank"] == x else (*have[x], m, x)
                for x in group if x != m]
    return out


@torch.no_grad()
def assemble(group: Any, members: Sequence[int], me: int, held: Held,
             replicas: ShardReplicas | None, iteration: int) -> Any:
    """Exchange the copies (collective over the recovery ``group``: every member calls it)
    and return this member's whole units at ``iteration`` (empty when it has none)."""
    index = {m: i for i, m in enumerate(members)}
    mine = replicas.at(iteration) if replicas is not None else None
    works, got = [], []
    for src, slot, dst, rank in moves(held, iteration):
        if src == me:
            copy = mine.own if slot == "own" else mine.replica
            if dst == me:
                got.append(copy)
            else:
                works += [group.send([flat], index[dst], rank * MAX_BUFFERS + j)
                          for j, flat in enumerate(copy.data.buffers.flats)]
        elif dst == me:
            copy = ShardCopy.from_meta(_at(held[src], iteration)[slot])
            works += [group.recv([flat], index[src], rank * MAX_BUFFERS + j)
                      for j, flat in enumerate(copy.data.buffers.flats)]
            got.append(copy)
    for work in works:
        work.wait()
    if mine is None or me in unassemblable(held, iteration):
        return AssembledUnits([])
    return AssembledUnits([mine.own, *got], keep=mine.own.units)


class AssembledUnits:
    """Whole units rebuilt from shard copies: a ``StateView`` to read (the model parameters
    are their main copies cast to the model's dtype, as the optimizer writes them).

    Each read builds the unit it asks for, from the pieces, and keeps nothing: the migration
    reads a unit just before it sends it, so a rank never holds all its units whole at once
    (it holds the copies already). ``specs`` names what a read returns without building it."""

    def __init__(self, copies: Sequence[ShardCopy], keep: Sequence[StateUnit] = ()) -> None:
        """``keep``: the units to rebuild (default: every unit the copies hold pieces of)."""
        self._keep = set(keep)
        placed: set = set()
        self._pieces: dict[StateUnit, dict[str, list[tuple[ShardCopy, int]]]] = {}
        self._shapes: dict[tuple[StateUnit, str], tuple[int, ...]] = {}
        covered: dict[tuple[StateUnit, str], int] = {}
        for copy in copies:
            for i, piece in enumerate(copy.pieces):
                if (self._keep and piece.unit not in self._keep) or piece in placed:
                    continue  # (a plan keeps the tied copy whole on each holder: the same piece)
                placed.add(piece)
                self._pieces.setdefault(piece.unit, {}).setdefault(piece.name, []).append(
                    (copy, i))
                key = (piece.unit, piece.name)
                self._shapes[key] = piece.shape
                covered[key] = covered.get(key, 0) + piece.numel
        for (unit, name), count in covered.items():
            whole = _numel(self._shapes[(unit, name)])
            if count != whole:
                raise ValueError(f"unit {unit!r} {name}: the shard copies hold {count} of its "
                                 f"{whole} elements")
        first = copies[0] if copies else None
        self._dtype = dtype_of(first.dtype) if first else None
        self._keys = first.keys if first else ()
        if first and first.tied and "word_embeddings.weight" in self._pieces.get(EMBEDDING, {}):
            self._pieces.setdefault(OUTPUT, {})["output_layer.weight"] = \
                self._pieces[EMBEDDING]["word_embeddings.weight"]
            self._shapes[(OUTPUT, "output_layer.weight")] = \
                self._shapes[(EMBEDDING, "word_embeddings.weight")]

    def units(self) -> tuple[StateUnit, ...]:
        return tuple(self._pieces)

    def specs(self, unit: StateUnit, kind: StateKind) -> dict[str, tuple[list[int], str]]:
        """Name -> (shape, dtype) of what ``tensors(unit, kind)`` returns."""
        out: dict[str, tuple[list[int], str]] = {}
        for name, parts in self._pieces.get(unit, {}).items():
            shape = list(self._shapes[(unit, name)])
            if kind == "params":
                out[name] = (shape, str(self._dtype))
                if self._dtype != torch.float32:
                    out[f"{name}/main"] = (shape, str(torch.float32))
                continue
            copy, i = parts[0]
            for key in self._keys:
                chunk = copy.tensor(i, key)
                out[f"{name}/{key}"] = ([] if chunk.dim() == 0 else shape, str(chunk.dtype))
        return out

    def tensors(self, unit: StateUnit, kind: StateKind) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for name, parts in self._pieces.get(unit, {}).items():
            shape = self._shapes[(unit, name)]
            if kind == "params":
                main = _whole(parts, "main", shape)
                out[name] = main.to(self._dtype)
                if self._dtype != torch.float32:  # (in the dtype a sink stages it in)
                    out[f"{name}/main"] = main.to(torch.float32)
            else:
                out.update({f"{name}/{key}": _whole(parts, key, shape) for key in self._keys})
        return out


def _whole(parts: Sequence[tuple[ShardCopy, int]], key: str,
           shape: tuple[int, ...]) -> torch.Tensor:
    """The tensor ``key`` of one parameter, its pieces put together (a scalar, such as
    Adam's step, is the same on every piece: the first one's)."""
    copy, i = parts[0]
    first = copy.tensor(i, key)
    if first.dim() == 0:
        return first.clone()
    whole = torch.empty(_numel(shape), dtype=first.dtype)
    for copy, i in parts:
        piece = copy.pieces[i]
        whole[piece.start:piece.end] = copy.tensor(i, key)
    return whole.view(shape)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
