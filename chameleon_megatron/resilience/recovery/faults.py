"""Deterministic fault injection: which rank fails, at which iteration and phase, and how.

A fault is written
``rank=R,iteration=I,phase=forward|...|copy|final-save|final-eval|final-test,kind=...``
(``kind=exit|hang|exception|oom``)
or ``...,kind=slow,seconds=S`` (the ``--chameleon-inject-fault`` syntax, repeatable) or built
with ``FaultInjector.fail_at``.

* ``rank`` is the rank the launcher gave the process at start: it names a process, so it
  stays meaningful after a recovery has renumbered the survivors.
* ``iteration`` is the 1-based number of the training step (the number the trainer logs).
* ``phase``: forward, backward, grads, optimizer fire inside that step (``fault_hooks``;
  grads: after the gradient all-reduce, before the optimizer's norm, so peers outside this
  rank's model-parallel group apply the step while those in it cannot); recovery
  fires inside the recovery that will redo step I, after the survivors' new groups are built
  and before any state moves (a failure during recovery; the recovery controller calls it);
  eval and save fire as the evaluation or the checkpoint after step I starts (its peers are
  then inside that collective work); copy fires in the exchange of the distributed
  optimizer's shard copy of step I, on its thread, once this rank's copy is sent and its
  predecessor's received, before the commit (a failure while a copy is in flight).
  final-save, final-eval, final-test fire as the work Megatron-LM's ``pretrain()`` does
  after its loop returns starts: its final checkpoint, its evaluation on the validation
  set, on the test set (Megatron-LM's pretrain_gpt.py only; I must be the last step,
  ``--train-iters``, which ``check_end_of_job_faults`` enforces).
* ``kind``: ``exit`` ends the process at once with ``INJECTED_EXIT_CODE`` (no clean-up, like a
  crash); ``hang`` blocks the calling thread forever (only a heartbeat timeout finds it);
  ``exception`` raises ``InjectedFault`` from the training code; ``oom`` raises torch's
  ``OutOfMemoryError`` there (the process lives: with swap on, every rank redoes the step);
  ``slow`` sleeps ``seconds`` there and goes on (a slow machine, not a failure).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass
from typing import Iterable, Literal, get_args

logger = logging.getLogger(__name__)

Phase = Literal["forward", "backward", "grads", "optimizer", "recovery", "eval", "save",
                "copy", "final-save", "final-eval", "final-test"]
FaultKind = Literal["exit", "hang", "exception", "oom", "slow"]
PHASES: tuple[str, ...] = get_args(Phase)
KINDS: tuple[str, ...] = get_args(FaultKind)
INJECTED_EXIT_CODE = 43
"""Exit status of a process ended by an injected ``exit`` fault."""

END_OF_JOB_PHASES = ("final-save", "final-eval", "final-test")
"""Phases of Megatron-LM's end-of-job work (``training.plugin.END_OF_JOB``)."""
_SYNTAX = ("rank=R,iteration=I,phase=forward|backward|grads|optimizer|recovery|eval|save|copy|"
           "final-save|final-eval|final-test,kind=exit|hang|exception|oom|slow[,seconds=S]")


class InjectedFault(RuntimeError):
    """Raised by an injected ``exception`` fault."""


@dataclass(frozen=True)
class FaultSpec:
    """One planned failure."""

    rank: int
    iteration: int
    phase: Phase
    kind: FaultKind
    seconds: float = 0.0
    """How long a ``slow`` fault sleeps."""

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise ValueError(f"fault rank={self.rank}: must be >= 0")
        if self.iteration < 1:
            raise ValueError(f"fault iteration={self.iteration}: must be >= 1 (1-based)")
        if self.phase not in PHASES:
            raise ValueError(f"fault phase={self.phase!r}: must be one of {list(PHASES)}")
        if self.kind not in KINDS:
            raise ValueError(f"fault kind={self.kind!r}: must be one of {list(KINDS)}")
        if (self.kind == "slow") != (self.seconds > 0):
            raise ValueError(f"fault seconds={self.seconds}: kind=slow needs seconds > 0, "
                             "and only kind=slow takes seconds")

    def __str__(self) -> str:
        text = f"rank={self.rank},iteration={self.iteration},phase={self.phase},kind={self.kind}"
        return text + (f",seconds={self.seconds:g}" if self.kind == "slow" else "")


def _int_field(text: str, key: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"fault {text!r}: {key}={value!r} is not an integer") from None


def parse_fault(text: str) -> FaultSpec:
    """Parse ``rank=R,iteration=I,phase=P,kind=K`` (all four keys, any order)."""
    fields: dict[str, str] = {}
    for part in text.split(","):
        key, sep, value = part.strip().partition("=")
        if not sep or not key or not value:
            raise ValueError(f"fault {text!r}: {part.strip()!r} is not key=value; expected {_SYNTAX}")
        if key in fields:
            raise ValueError(f"fault {text!r}: {key} given twice")
        fields[key] = value.strip()
    keys = {"rank", "iteration", "phase", "kind"}
    unknown = sorted(set(fields) - keys - {"seconds"})
    if unknown:
        raise ValueError(f"fault {text!r}: unknown key {unknown[0]!r}; expected {_SYNTAX}")
    missing = sorted(keys - set(fields))
    if missing:
        raise ValueError(f"fault {text!r}: missing {', '.join(missing)}; expected {_SYNTAX}")
    return FaultSpec(
        rank=_int_field(text, "rank", fields["rank"]),
        iteration=_int_field(text, "iteration", fields["iteration"]),
        phase=fields["phase"],  # type: ignore[arg-type]
        kind=fields["kind"],  # type: ignore[arg-type]
        seconds=_seconds(text, fields.get("seconds", "0")),
    )


def _seconds(text: str, value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"fault {text!r}: seconds={value!r} is not a number") from None


def check_end_of_job_faults(texts: Iterable[str], train_iters: int | None, *,
                            megatron_lm: bool) -> None:
    """Refuse (ValueError, one line) an end-of-job fault that would never fire: it needs
    Megatron-LM's ``pretrain()`` (``megatron_lm``) and the last step, ``train_iters``, as
    its iteration."""
    for spec in map(parse_fault, texts):
        if spec.phase not in END_OF_JOB_PHASES:
            continue
        if not megatron_lm:
            raise ValueError(f"fault {spec}: phase={spec.phase} fires in the work Megatron-LM's "
                             "pretrain() does after its loop; this trainer has none (use "
                             "phase=eval or phase=save at the last iteration)")
        if spec.iteration != train_iters:
            raise ValueError(f"fault {spec}: phase={spec.phase} needs iteration={train_iters} "
                             "(--train-iters, the last step)" if train_iters is not None else
                             f"fault {spec}: phase={spec.phase} needs --train-iters (its "
                             "iteration must be the last step)")


class FaultInjector:
    """The faults planned for one process; ``check`` fires the one due at (iteration, phase)."""

    def __init__(self, rank: int, specs: Iterable[FaultSpec] = ()) -> None:
        self.rank = rank
        self._due = {(s.iteration, s.phase): s for s in specs if s.rank == rank}

    @classmethod
    def from_strings(cls, rank: int, texts: Iterable[str]) -> FaultInjector:
        return cls(rank, [parse_fault(t) for t in texts])

    def fail_at(self, rank: int, iteration: int, phase: Phase = "forward",
                kind: FaultKind = "exit") -> FaultInjector:
        """Plan one more fault (ignored unless ``rank`` is this process); returns self."""
        spec = FaultSpec(rank=rank, iteration=iteration, phase=phase, kind=kind)
        if rank == self.rank:
            self._due[(iteration, phase)] = spec
        return self

    @property
    def planned(self) -> tuple[FaultSpec, ...]:
        return tuple(self._due.values())

    def check(self, iteration: int, phase: Phase) -> None:
        """Fire the fault planned for this iteration and phase, if any (at most once)."""
        spec = self._due.pop((iteration, phase), None)
        if spec is not None:
            _fire(spec)


def _fire(spec: FaultSpec) -> None:
    logger.warning("injecting fault %s", spec)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    if spec.kind == "exit":
        os._exit(INJECTED_EXIT_CODE)
    if spec.kind == "exception":
        raise InjectedFault(f"injected fault {spec}")
    if spec.kind == "oom":
        import torch

        raise torch.OutOfMemoryError(f"injected fault {spec}")
    if spec.kind == "slow":
        time.sleep(spec.seconds)
        return
    while True:  # hang: only the agent's heartbeat check ends this process
        time.sleep(3600)

