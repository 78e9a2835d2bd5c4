"""The pipeline schedule of a rerouted step: who runs which forward and backward, in which
order, exchanging activations and gradients with whom.

Each microbatch follows a *route*, one rank per stage of its pipeline. The layout is kept;
the microbatches of a failed stage go to the same-stage peers that the rerouting plan
names, the forward and the backward of a microbatch on the same peer, so the failed
pipeline's surviving stages send activations to the peer and receive gradients from it.

Each rank's order of operations comes from a unit-time simulation of the whole step (list
scheduling, pure): a rank runs a ready backward first, else its next ready forward while it
holds fewer microbatches than 1F1B allows at its stage (depth - stage), so memory stays at
1F1B's. A rank takes messages from each sender in the order they were sent (as NCCL needs).
The simulation is itself an execution, but one whose sends are buffered; NCCL's are not
(a send completes when its receive is posted), so the runtime follows the per-rank programs
of ``reroute_program``, which post each unit step's messages as one batch.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass
from typing import Callable, Literal, Mapping, Sequence

from chameleon_megatron.resilience.decision.layout import Plan
from chameleon_megatron.resilience.decision.reroute import ReroutePlan


@dataclass(frozen=True)
class Op:
    kind: Literal["F", "B"]
    microbatch: int
    """Global microbatch index of the step."""
    recv: int | None
    """Rank whose activation (F) or gradient (B) this op needs."""
    send: int | None
    """Rank this op's output goes to."""


def routes(plan: Plan, reroute: ReroutePlan,
           ids: Sequence[Sequence[int]]) -> dict[int, tuple[int, ...]]:
    """Global microbatch -> rank of each stage of its pipeline, a stage named by its TP
    index 0 (failed stages replaced by their peers, the failed pipeline's microbatches taken
    in order). ``ids``: the global microbatches of each pipeline. Raises ValueError if a
    route still meets a failed stage."""
    out = {g: [st.ranks[0] for st in pipe.stages]
           for pipe, mine in zip(plan.pipelines, ids) for g in mine}
    for r in reroute.reroutes:
        units = plan.pipelines[r.pipeline].stage_units(r.stage)
        mine = iter(ids[r.pipeline])
        for peer, count in r.targets:
            peer_pipe = plan.pipelines[peer]
            s = next(s for s in range(peer_pipe.depth) if peer_pipe.stage_units(s) == units)
            for _ in range(count):
                out[next(mine)][r.stage] = peer_pipe.stages[s].ranks[0]
    stopped = set(reroute.stopped_ranks)
    for g, route in out.items():
        if stopped.intersection(route):
            raise ValueError(f"microbatch {g} still meets failed stages "
                             f"{sorted(stopped.intersection(route))} on its route {route}")
    return {g: tuple(route) for g, route in out.items()}


def rank_ops(plan: Plan, reroute: ReroutePlan, ids: Sequence[Sequence[int]],
             me: int) -> tuple[Op, ...]:
    """``me``'s operations: those of its stage (``schedule`` over ``routes``), exchanged
    with the ranks of the same TP index in the neighbouring stages (at tp > 1 every rank of
    a stage runs the stage's ops, and each carries the whole activation)."""
    leader, peer = tp_peers(plan, me)
    ops = schedule(routes(plan, reroute, ids)).get(leader, ())
    return tuple(dataclasses.replace(op, recv=peer(op.recv), send=peer(op.send)) for op in ops)


def tp_peers(plan: Plan, me: int) -> tuple[int, Callable[[int | None], int | None]]:
    """The rank of TP index 0 of ``me``'s stage (the schedule names stages by it), and the
    map from such a rank to the rank of ``me``'s TP index in that stage."""
    stage_of = {r: st.ranks for pipe in plan.pipelines for st in pipe.stages for r in st.ranks}
    ranks = stage_of[me]
    i = ranks.index(me)

    def peer(rank: int | None) -> int | None:
        return None if rank is None else stage_of[rank][i]

    return ranks[0], peer


def schedule(route_of: Mapping[int, Sequence[int]]) -> dict[int, tuple[Op, ...]]:
    """Every rank's operations in order (see the module docstring)."""
    return {rank: tuple(op for _, op in timed) for rank, timed in timed_schedule(route_of).items()}


def timed_schedule(route_of: Mapping[int, Sequence[int]]) -> dict[int, tuple[tuple[int, Op], ...]]:
    """Every rank's operations in order, each with the unit time step the simulation ran it
    in: a message sent in step t is received in a later step."""
    todo: dict[int, list[tuple[int, int]]] = {}  # rank -> (microbatch, stage) of its forwards
    for g in sorted(route_of):
        for s, rank in enumerate(route_of[g]):
            todo.setdefault(rank, []).append((g, s))
    # 1F1B's bound on the microbatches a stage holds, depth - stage (the least of its routes)
    cap = {rank: min(len(route_of[g]) - s for g, s in work) for rank, work in todo.items()}
    links: dict[tuple[int, int], deque[tuple[str, int]]] = {}
    held: dict[int, list[int]] = {rank: [] for rank in todo}  # microbatches forwarded, not back
    order: dict[int, list[tuple[int, Op]]] = {rank: [] for rank in todo}
    remaining = sum(2 * len(work) for work in todo.values())
    tick = 0
    while remaining:
        chosen = {rank: _pick(rank, todo[rank], held[rank], cap[rank], route_of, links)
                  for rank in todo}
        if not any(chosen.values()):
            raise RuntimeError("the rerouted schedule deadlocks (a bug: please report the routes)")
        for rank, op in chosen.items():
            if op is None:
                continue
            _apply(rank, op, todo[rank], held[rank], links)
            order[rank].append((tick, op))
            remaining -= 1
        tick += 1
    return {rank: tuple(ops) for rank, ops in order.items()}


def _pick(rank: int, forwards: list[tuple[int, int]], held: list[int], cap: int,
          route_of: Mapping[int, Sequence[int]],
          links: dict[tuple[int, int], deque[tuple[str, int]]]) -> Op | None:
    for g in held:  # backward first, oldest first
        route = route_of[g]
        s = route.index(rank)
        prev = route[s - 1] if s > 0 else None
        if s == len(route) - 1:
            return Op("B", g, None, prev)
        if _head(links, route[s + 1], rank) == ("B", g):
            return Op("B", g, route[s + 1], prev)
    if len(held) >= cap:
        return None
    for g, s in forwards:
        route = route_of[g]
        nxt = route[s + 1] if s + 1 < len(route) else None
        if s == 0:
            return Op("F", g, None, nxt)
        if _head(links, route[s - 1], rank) == ("F", g):
            return Op("F", g, route[s - 1], nxt)
    return None


def _head(links: dict[tuple[int, int], deque[tuple[str, int]]], src: int,
          dst: int) -> tuple[str, int] | None:
    queue = links.get((src, dst))
    return queue[0] if queue else None


def _apply(rank: int, op: Op, forwards: list[tuple[int, int]], held: list[int],
           links: dict[tuple[int, int], deque[tuple[str, int]]]) -> None:
    if op.recv is not None:
        links[(op.recv, rank)].popleft()
    if op.kind == "F":
        forwards[:] = [w for w in forwards if w[0] != op.microbatch]
        held.append(op.microbatch)
    else:
        held.remove(op.microbatch)
    if op.send is not None:
        links.setdefault((rank, op.send), deque()).append((op.kind, op.microbatch))
