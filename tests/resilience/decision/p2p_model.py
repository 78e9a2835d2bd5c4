"""A model of point-to-point messaging without buffering, to run rerouting programs on.

Each rank runs its steps in order, blocking on each until it completes:

* an ``Op`` computes; it needs its input message already received (else the program is
  wrong, not stuck: AssertionError) and leaves its output for a later send;
* an ``Exchange`` is a batch: all its sends and receives are posted at once and the rank
  waits until all of them complete. A send completes only once the matching receive is
  posted and a receive only once the matching send is; messages of one link (sender,
  receiver) match in the order they were posted, and must carry the same microbatch.

This is NCCL's behaviour for messages beyond its few MB of buffering, and a rank's
point-to-point calls running one after another on one stream. ``single_ops`` turns an op
list into the programs of a runtime that posts each message on its own (blocking receive
before the op, send after it), to show that the model catches that pattern.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

from chameleon_megatron.resilience.decision.reroute_program import Exchange, Step, Transfer
from chameleon_megatron.resilience.decision.reroute_schedule import Op


@dataclass
class Outcome:
    finished: bool
    stuck: dict[int, Step] = field(default_factory=dict)
    """Rank -> the step it is blocked on (a deadlock) when not finished."""


def single_ops(ops: Mapping[int, Sequence[Op]]) -> dict[int, tuple[Step, ...]]:
    """Each op's receive and send as batches of one, around the op."""
    out = {}
    for rank, seq in ops.items():
        steps: list[Step] = []
        for op in seq:
            if op.recv is not None:
                steps.append(Exchange((), (Transfer(op.kind, op.microbatch, op.recv, rank),)))
            steps.append(op)
            if op.send is not None:
                steps.append(Exchange((Transfer(op.kind, op.microbatch, rank, op.send),), ()))
        out[rank] = tuple(steps)
    return out


def run(programs: Mapping[int, Sequence[Step]]) -> Outcome:
    """Execute every rank's program under unbuffered semantics (see the module docstring)."""
    state = _State(programs)
    while state.advance_any():
        pass
    stuck = {r: seq[state.pc[r]] for r, seq in programs.items() if state.pc[r] < len(seq)}
    if not stuck:
        state.check_drained()
    return Outcome(finished=not stuck, stuck=stuck)


class _State:
    def __init__(self, programs: Mapping[int, Sequence[Step]]) -> None:
        self.programs = programs
        self.pc = {r: 0 for r in programs}
        self.posted: dict[int, list[tuple[str, Transfer, int]]] = {}
        """Rank -> its posted batch: (send/recv, message, position on its link)."""
        self.sends: dict[tuple[int, int], list[Transfer]] = {}
        self.recvs: dict[tuple[int, int], list[Transfer]] = {}
        """Messages posted on each link (sender, receiver), in order."""
        self.inbox: dict[int, set[tuple[str, int, int]]] = {r: set() for r in programs}
        self.outbox: dict[int, set[tuple[str, int, int]]] = {r: set() for r in programs}

    def advance_any(self) -> bool:
        moved = False
        for rank, seq in self.programs.items():
            while self.pc[rank] < len(seq) and self._advance(rank, seq[self.pc[rank]]):
                self.pc[rank] += 1
                moved = True
        return moved

    def _advance(self, rank: int, step: Step) -> bool:
        if isinstance(step, Op):
            if step.recv is not None:
                key = (step.kind, step.microbatch, step.recv)
                assert key in self.inbox[rank], f"rank {rank} runs {step} before receiving it"
                self.inbox[rank].remove(key)
            if step.send is not None:
                self.outbox[rank].add((step.kind, step.microbatch, step.send))
            return True
        if rank not in self.posted:
            self._post(rank, step)
        if not all(self._matched(way, m, k) for way, m, k in self.posted[rank]):
            return False
        for way, m, _ in self.posted.pop(rank):
            if way == "recv":
                self.inbox[rank].add((m.kind, m.microbatch, m.src))
        return True

    def _post(self, rank: int, ex: Exchange) -> None:
        batch = []
        for m in ex.sends:
            assert m.src == rank
            key = (m.kind, m.microbatch, m.dst)
            assert key in self.outbox[rank], f"rank {rank} sends {m} before computing it"
            self.outbox[rank].remove(key)
            link = self.sends.setdefault((m.src, m.dst), [])
            batch.append(("send", m, len(link)))
            link.append(m)
        for m in ex.recvs:
            assert m.dst == rank
            link = self.recvs.setdefault((m.src, m.dst), [])
            batch.append(("recv", m, len(link)))
            link.append(m)
        self.posted[rank] = batch

    def _matched(self, way: str, m: Transfer, k: int) -> bool:
        """Whether the counterpart of the k-th message of its link is posted (and carries
        the same microbatch)."""
        other = (self.recvs if way == "send" else self.sends).get((m.src, m.dst), [])
        if len(other) <= k:
            return False
        assert other[k] == m, f"link {m.src}->{m.dst}: {other[k]} matched with {m}"
        return True

    def check_drained(self) -> None:
        for link, sent in self.sends.items():
            assert sent == self.recvs.get(link, []), f"link {link}: {sent} vs {self.recvs[link]}"
        assert not any(self.inbox.values()), f"received, never used: {self.inbox}"
        assert not any(self.outbox.values()), f"computed, never sent: {self.outbox}"
