"""The point-to-point program of a rerouted step: each rank's operations, with the messages
they exchange posted in batches that cannot deadlock on NCCL.

NCCL does not buffer sends beyond a few MB: a send completes only once its receive is
posted, and a rank's point-to-point calls to one peer run one after another (one
communicator, one stream). A stage that sends F(k) and then receives B(j) while its next
stage sends B(j) and then receives F(k) therefore deadlocks once a message outgrows that
buffering (a 4096 x 4096 bf16 activation is 32 MB); gloo buffers, so CPU runs do not show it.

The routed schedule (``reroute_schedule.timed_schedule``) runs in unit time steps, a message
sent in step t received in a later step. Here every message travels in the step it is sent:
each rank posts, after its step-t operation, one batch (``Exchange``, one
``batch_isend_irecv``) of that operation's send and of every message sent to it in step t,
and keeps what arrives until the operation that uses it. By induction on t no program
deadlocks, even with unbuffered sends and batches that complete only as a whole: once every
rank has finished its batches of the steps before t, every rank runs its step-t operation
(its input arrived in an earlier batch) and posts its step-t batch, and every message of
that batch has its counterpart in the peer's step-t batch, so all of them complete. Keeping
only the forward operations and activations (evaluation) keeps the argument.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Literal, Mapping, Sequence, Union

from chameleon_megatron.resilience.decision.layout import Plan
from chameleon_megatron.resilience.decision.reroute import ReroutePlan
from chameleon_megatron.resilience.decision.reroute_schedule import (
    Op,
    routes,
    timed_schedule,
    tp_peers,
)


@dataclass(frozen=True)
class Transfer:
    """One message: the activation (F) or the gradient (B) of a microbatch."""

    kind: Literal["F", "B"]
    microbatch: int
    src: int
    dst: int


@dataclass(frozen=True)
class Exchange:
    """Messages a rank posts together and that complete together (sends: outputs of its
    operations already run; receives: inputs of later ones)."""

    sends: tuple[Transfer, ...]
    recvs: tuple[Transfer, ...]


Step = Union[Op, Exchange]


def programs(route_of: Mapping[int, Sequence[int]]) -> dict[int, tuple[Step, ...]]:
    """Every rank's steps in order (see the module docstring)."""
    timed = timed_schedule(route_of)
    incoming: dict[tuple[int, int], list[Transfer]] = {}  # (receiver, step) -> messages
    for rank, seq in timed.items():
        for tick, op in seq:
            if op.send is not None:
                incoming.setdefault((op.send, tick), []).append(
                    Transfer(op.kind, op.microbatch, rank, op.send))
    out = {}
    for rank, seq in timed.items():
        op_at = dict(seq)
        steps: list[Step] = []
        for tick in sorted(set(op_at) | {t for r, t in incoming if r == rank}):
            op = op_at.get(tick)
            sends: tuple[Transfer, ...] = ()
            if op is not None:
                steps.append(op)
                if op.send is not None:
                    sends = (Transfer(op.kind, op.microbatch, rank, op.send),)
            recvs = tuple(sorted(incoming.get((rank, tick), ()), key=lambda m: m.src))
            if sends or recvs:
                steps.append(Exchange(sends, recvs))
        out[rank] = tuple(steps)
    return out


def rank_program(plan: Plan, reroute: ReroutePlan, ids: Sequence[Sequence[int]],
                 me: int) -> tuple[Step, ...]:
    """``me``'s steps (``plan_programs``; none for a stopped rank)."""
    return plan_programs(plan, reroute, ids).get(me, ())


def plan_programs(plan: Plan, reroute: ReroutePlan,
                  ids: Sequence[Sequence[int]]) -> dict[int, tuple[Step, ...]]:
    """Every running rank's steps: its stage's (``programs`` over ``routes``), exchanged
    with the ranks of its TP index in the neighbouring stages (as
    ``reroute_schedule.rank_ops``)."""
    by_stage = programs(routes(plan, reroute, ids))
    if plan.tp == 1:
        return by_stage
    out = {}
    for me in plan.ranks():
        leader, peer = tp_peers(plan, me)
        if leader in by_stage:
            out[me] = tuple(_mapped(step, peer) for step in by_stage[leader])
    return out


def _mapped(step: Step, peer: Callable[[int | None], int | None]) -> Step:
    if isinstance(step, Op):
        return dataclasses.replace(step, recv=peer(step.recv), send=peer(step.send))

    def moved(m: Transfer) -> Transfer:
        return dataclasses.replace(m, src=peer(m.src), dst=peer(m.dst))

    return Exchange(tuple(map(moved, step.sends)), tuple(map(moved, step.recvs)))


def forward_only(program: Sequence[Step]) -> tuple[Step, ...]:
    """The forward operations and the activations' messages of ``program`` (evaluation)."""
    out: list[Step] = []
    for step in program:
        if isinstance(step, Exchange):
            kept = Exchange(tuple(m for m in step.sends if m.kind == "F"),
                            tuple(m for m in step.recvs if m.kind == "F"))
            if kept.sends or kept.recvs:
                out.append(kept)
        elif step.kind == "F":
            out.append(step)
    return tuple(out)
