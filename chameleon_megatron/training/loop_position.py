"""Where a training loop stands, written once for both entries' loops (chameleon's
``Trainer`` and Megatron-LM's ``LMLoop``): the step, the samples consumed, the work after a
step that a recovery agreed to redo, which of that work is due after a step, and what the
plugins make of a failed step.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from chameleon_megatron.training.plugin import AFTER_STEP, StepAction, TrainerPlugin

logger = logging.getLogger(__name__)


class StepNotRedone(RuntimeError):
    """A step failed on this rank alone, and nothing can make the others redo it."""


def work_due(args: argparse.Namespace, iteration: int, phase: str, *, final_save: bool) -> bool:
    """Whether ``phase`` ("eval" or "save", ``plugin.AFTER_STEP``) runs after step
    ``iteration``. ``final_save``: the loop itself saves after the last step (chameleon's
    does; Megatron-LM's ``pretrain()`` saves after its loop returns)."""
    if phase == "eval":
        return bool(args.eval_interval and args.eval_iters and iteration % args.eval_interval == 0
                    and getattr(args, "do_valid", True))
    return bool(args.save and ((final_save and iteration == args.train_iters)
                               or (args.save_interval and iteration % args.save_interval == 0)))


def work_follows(args: argparse.Namespace, iteration: int) -> bool:
    """Whether work after a step (or the end of the job) follows step ``iteration + 1``."""
    step = iteration + 1
    return step >= args.train_iters or any(
        work_due(args, step, phase, final_save=False) for phase in AFTER_STEP)


def end_of_job_due(args: argparse.Namespace, iteration: int, phase: str) -> bool:
    """Whether Megatron-LM's ``pretrain()`` runs ``phase`` (``plugin.END_OF_JOB``) after its
    loop returned at step ``iteration`` (its own conditions, in 0.16 and 0.17)."""
    if phase == "final-save":
        return bool(getattr(args, "save", None) and iteration and args.save_interval
                    and iteration % args.save_interval)
    if phase == "final-eval":  # do_valid and do_test: set where the data loaders are built
        return bool(getattr(args, "do_valid", False)
                    and not getattr(args, "perform_rl_step", False))
    return bool(getattr(args, "do_test", False))


_WORK_NAMES = {"eval": "evaluation", "save": "checkpoint", "final-save": "final checkpoint",
               "final-eval": "final validation", "final-test": "final test"}


class LoopPosition:
    """The position part of a loop (a base class of both loops): ``resume_at`` is how a
    recovery moves it, ``_take_redo_after`` how the loop reads what is left to redo, and
    ``_on_step_failed`` how a failure becomes the loop's next action."""

    plugins: list[TrainerPlugin]
    iteration: int
    consumed_samples: int
    scheduler: Any
    _redo_after: str
    """Set by a recovery: the work after step ``iteration`` to run, from this phase, before
    the next step."""

    @property
    def rank(self) -> int:
        raise NotImplementedError

    @property
    def world_size(self) -> int:
        raise NotImplementedError

    @property
    def valid_samples(self) -> int:
        """Our trainer evaluates the same validation batches every time: no position."""
        return 0

    def resume_at(self, *, iteration: int, consumed_samples: int,
                  scheduler_state: dict[str, Any], after_step: str = "",
                  valid_samples: int) -> None:
        self.iteration, self.consumed_samples = iteration, consumed_samples
        self.scheduler.load_state_dict(scheduler_state)  # a fresh schedule: adds its steps
        self._redo_after = after_step

    def _redo_alone(self, phase: str, iteration: int) -> None:
        """The work after step ``iteration`` failed in ``phase`` ("": in the step) and was
        answered: unless a recovery moved the loop (to another step, or to the phase the
        members agreed on), this rank redoes that phase before the next step."""
        if phase and self.iteration == iteration and not self._redo_after:
            self._redo_after = phase

    def _take_redo_after(self) -> str:
        phase, self._redo_after = self._redo_after, ""
        if self.rank == 0:
            logger.info("the work after step %d is redone from its %s in the new layout",
                        self.iteration, _WORK_NAMES[phase])
        return phase

    def _on_step_failed(self, exc: Exception) -> StepAction | None:
        """The first plugin's answer to a failed step (None: no plugin takes it, re-raise).
        "abandon" (this rank can redo the step, e.g. with a lowered swap budget) is a redo
        every rank must agree on: alone it is one; with peers the plugins make them abandon
        it too, or the step cannot be redone."""
        action = next((a for p in self.plugins if (a := p.on_step_failed(exc, self))), None)
        if action != "abandon":
            return action
        if self.world_size == 1:
            return "redo"
        together = next((a for p in self.plugins if (a := p.abandon_step(exc, self))), None)
        if together is None:
            raise StepNotRedone(
                f"rank {self.rank}: step {self.iteration + 1} failed ({type(exc).__name__}: "
                f"{exc}) and redoing it needs every rank of the job: run under chameleon-run "
                "with --chameleon-ft, or give the job more memory") from exc
        return together
