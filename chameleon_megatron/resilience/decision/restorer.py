"""The restorer's plan for moving to a new layout: who takes which slot, what state moves,
how gradients are all-reduced, and whether anything was lost.

* Slots are assigned to intact TP groups by the Hungarian algorithm, minimising the bytes
  of parameters and optimizer state each group lacks for its new slot.
* Each missing piece (a layer's shard at one TP index) comes from a surviving holder of
  that shard; among several, the one that has sent the least so far.
* A layer's gradients are all-reduced among the ranks holding it; layers with the same
  holders form one group; groups sharing a rank conflict, so they are coloured (DSATUR)
  into rounds of concurrent all-reduces.
* A shard with no surviving holder is lost: the new layout cannot be reached in memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Mapping, Sequence

import numpy as np

from chameleon_megatron.resilience.decision.layout import (
    EMBEDDING,
    OUTPUT,
    Pipeline,
    Plan,
    Stage,
    StateUnit,
    contiguous_layers,
)
from chameleon_megatron.resilience.decision.perf_model import unit_cost
from chameleon_megatron.resilience.decision.planner import PipelineShape
from chameleon_megatron.resilience.decision.profile import Profile

Holdings = Mapping[int, tuple[int, Sequence[StateUnit]]]
"""Live rank -> (TP index, state units whose shard at that index it holds)."""


def live_holdings(plan: Plan, dead_ranks: Sequence[int] | set[int]) -> Holdings:
    """What the surviving ranks of ``plan`` hold."""
    dead = set(dead_ranks)
    return {r: h for r, h in plan.holdings().items() if r not in dead}


StateKind = Literal["params", "optimizer"]
"""The two halves of a unit's state: its parameters, and its optimizer state."""


@dataclass(frozen=True)
class Transfer:
    src: int
    dst: int
    layer: StateUnit
    kind: StateKind
    bytes: float


@dataclass(frozen=True)
class AllReduceGroup:
    ranks: tuple[int, ...]
    layers: tuple[StateUnit, ...]
    """State units (at one TP index) whose gradients this group all-reduces."""
    bytes: float


@dataclass(frozen=True)
class RestorePlan:
    assignment: tuple[tuple[int, int, int, int], ...]
    """(rank, pipeline, stage, tp_index) of every rank of the new plan."""
    transfers: tuple[Transfer, ...]
    groups: tuple[AllReduceGroup, ...]
    rounds: tuple[tuple[int, ...], ...]
    """Indices into ``groups``; no rank appears twice in one round."""
    lost: tuple[tuple[StateUnit, int], ...]
    """(state unit, TP index) with no surviving copy."""

    @property
    def unrecoverable(self) -> bool:
        """Some state has no surviving copy: fall back to the last checkpoint."""
        return bool(self.lost)

    def bytes_moved(self) -> float:
        return sum(t.bytes for t in self.transfers)

    def busiest_rank_bytes(self) -> float:
        """Largest bytes one rank sends or receives (links are full duplex)."""
        sent: dict[int, float] = {}
        received: dict[int, float] = {}
        for t in self.transfers:
            sent[t.src] = sent.get(t.src, 0.0) + t.bytes
            received[t.dst] = received.get(t.dst, 0.0) + t.bytes
        return max([*sent.values(), *received.values()], default=0.0)

    def to_dict(self) -> dict[str, Any]:
        return {
            "unrecoverable": self.unrecoverable,
            "lost": [[u, i] for u, i in self.lost],
            "bytes_moved": self.bytes_moved(),
            "assignment": [list(a) for a in self.assignment],
            "transfers": [[t.src, t.dst, t.layer, t.kind, t.bytes] for t in self.transfers],
            "allreduce_groups": [
                {"ranks": list(g.ranks), "layers": list(g.layers), "bytes": g.bytes}
                for g in self.groups
            ],
            "rounds": [list(r) for r in self.rounds],
        }


def transition_s(restore: RestorePlan, profile: Profile) -> float:
    """Regroup cost plus the busiest rank's transfers at the migration bandwidth."""
    return profile.regroup_s + restore.busiest_rank_bytes() / profile.transfer_bandwidth_Bps


def unit_order(unit: StateUnit) -> tuple[int, int, str]:
    """Sort key: layers by index, then embedding and output."""
    return (1, 0, unit) if isinstance(unit, str) else (0, unit, "")


def _state_index(num_layers: int) -> dict[StateUnit, int]:
    return {**{i: i for i in range(num_layers)}, EMBEDDING: num_layers, OUTPUT: num_layers + 1}


def assign_slots(shape: Sequence[PipelineShape], units: Sequence[tuple[int, ...]],
                 holdings: Holdings, profile: Profile) -> Plan:
    """The plan of ``shape`` with a TP group of ``units`` in every stage, chosen to
    minimise the bytes of state the groups must receive."""
    slots = [(j, s) for j, p in enumerate(shape) for s in range(p.depth)]
    if len(slots) > len(units):
        raise ValueError(f"{len(slots)} stages but only {len(units)} TP groups")
    L = profile.num_layers
    index = _state_index(L)
    weight = np.array([unit_cost(profile, u).state_bytes for u in index])
    held = np.zeros((len(units), len(index)), dtype=bool)
    for row, group in enumerate(units):
        common = None
        for i, rank in enumerate(group):
            tp_index, owned = holdings.get(rank, (i, ()))
            mine = set(owned) if tp_index == i else set()
            common = mine if common is None else common & mine
        for u in common or ():
            held[row, index[u]] = True
    layer_sets = [contiguous_layers(p.layer_counts) for p in shape]
    need = np.zeros((len(slots), len(index)), dtype=bool)
    for col, (j, s) in enumerate(slots):
        need[col, list(layer_sets[j][s])] = True
        need[col, index[EMBEDDING]] |= s == 0
        need[col, index[OUTPUT]] |= s == shape[j].depth - 1
    cost = (need @ weight)[None, :] - (held * weight) @ need.T
    from scipy.optimize import linear_sum_assignment  # heavy: imported when needed

    rows, cols = linear_sum_assignment(cost)
    owner = {slots[c]: units[r] for r, c in zip(rows, cols)}
    pipes = tuple(
        Pipeline(stages=tuple(Stage(layers=layer_sets[j][s], ranks=owner[(j, s)])
                              for s in range(p.depth)), microbatches=p.microbatches)
        for j, p in enumerate(shape)
    )
    return Plan(num_layers=L, pipelines=pipes)


def restore_plan(holdings: Holdings, new: Plan, profile: Profile) -> RestorePlan:
    """Transfers, all-reduce groups and rounds, and lost state, for moving to ``new``."""
    sources: dict[tuple[StateUnit, int], list[int]] = {}
    for rank, (i, owned) in holdings.items():
        for u in owned:
            sources.setdefault((u, i), []).append(rank)
    sent: dict[int, float] = {}
    transfers: list[Transfer] = []
    lost: set[tuple[StateUnit, int]] = set()
    assignment = []
    for j, s, i, rank in new.slots():
        assignment.append((rank, j, s, i))
        tp_index, owned = holdings.get(rank, (i, ()))
        have = set(owned) if tp_index == i else set()
        for u in new.pipelines[j].stage_units(s):
            if u in have:
                continue
            holders = sources.get((u, i))
            if not holders:
                lost.add((u, i))
                continue
            src = min(holders, key=lambda r: (sent.get(r, 0.0), r))
            cost = unit_cost(profile, u)
            sent[src] = sent.get(src, 0.0) + cost.state_bytes
            transfers.append(Transfer(src, rank, u, "params", cost.param_bytes))
            transfers.append(Transfer(src, rank, u, "optimizer", cost.optimizer_bytes))
    groups, rounds = _groups_and_rounds(new, profile)
    return RestorePlan(
        assignment=tuple(assignment), transfers=tuple(transfers), groups=groups, rounds=rounds,
        lost=tuple(sorted(lost, key=lambda x: (unit_order(x[0]), x[1]))),
    )


def allreduce_groups(plan: Plan, profile: Profile) -> tuple[AllReduceGroup, ...]:
    """One group per distinct set of ranks holding the same state units at one TP index."""
    return _groups_and_rounds(plan, profile)[0]


def allreduce_rounds(plan: Plan, profile: Profile) -> tuple[tuple[int, ...], ...]:
    """Rounds of ``allreduce_groups(plan)`` in which no rank is in two groups."""
    return _groups_and_rounds(plan, profile)[1]


def _groups_and_rounds(plan: Plan, profile: Profile) -> tuple[tuple[AllReduceGroup, ...],
                                                                tuple[tuple[int, ...], ...]]:
    """Groups are formed over stages (TP groups) and then split per TP index: the copies at
    different TP indices have disjoint ranks, so one colouring of the stage-level conflict
    graph (DSATUR; stages shared = conflict) serves every index."""
    holders: dict[StateUnit, list[int]] = {}
    stages = [st.ranks for p in plan.pipelines for st in p.stages]
    k = 0
    for pipe in plan.pipelines:
        for s in range(pipe.depth):
            for u in pipe.stage_units(s):
                holders.setdefault(u, []).append(k)
            k += 1
    merged: dict[tuple[int, ...], list[StateUnit]] = {}
    for u, owners in holders.items():
        if len(owners) > 1:
            merged.setdefault(tuple(owners), []).append(u)
    keys = list(merged)
    import networkx as nx  # heavy: imported when needed

    graph = nx.Graph()
    graph.add_nodes_from(range(len(keys)))
    by_stage: dict[int, list[int]] = {}
    for g, owners in enumerate(keys):
        for st in owners:
            by_stage.setdefault(st, []).append(g)
    for members in by_stage.values():
        graph.add_edges_from((a, b) for i, a in enumerate(members) for b in members[i + 1:])
    colour = nx.coloring.greedy_color(graph, strategy="DSATUR")
    groups: list[AllReduceGroup] = []
    rounds: dict[int, list[int]] = {}
    for g, owners in enumerate(keys):
        units = tuple(merged[owners])
        size = sum(unit_cost(profile, u).param_bytes for u in units)
        for i in range(plan.tp):
            rounds.setdefault(colour[g], []).append(len(groups))
            groups.append(AllReduceGroup(ranks=tuple(sorted(stages[st][i] for st in owners)),
                                         layers=units, bytes=size))
    return tuple(groups), tuple(tuple(rounds[c]) for c in sorted(rounds))
