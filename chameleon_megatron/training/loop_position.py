"""Where a training loop stands, written once for both entries' loops (chameleon's
``Trainer`` and Megatron-LM's ``LMLoop``): the step, the samples consumed, the work after a
step that a recovery agreed to redo, and which of that work is due after a step.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

logger = logging.getLogger(__name__)


def work_due(args: argparse.Namespace, iteration: int, phase: str, *, final_save: bool) -> bool:
    """Whether ``phase`` ("eval" or "save", ``plugin.AFTER_STEP``) runs after step
    ``iteration``. ``final_save``: the loop itself saves after the last step (chameleon's
    does; Megatron-LM's ``pretrain()`` saves after its loop returns)."""
    if phase == "eval":
        return bool(args.eval_interval and args.eval_iters and iteration % args.eval_interval == 0
                    and getattr(args, "do_valid", True))
    return bool(args.save and ((final_save and iteration == args.train_iters)
                               or (args.save_interval and iteration % args.save_interval == 0)))


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
    recovery moves it, ``_take_redo_after`` how the loop reads what is left to redo."""

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
    def valid_samples(self) -> int:
        """Our trainer evaluates the same validation batches every time: no position."""
        return 0

    def resume_at(self, *, iteration: int, consumed_samples: int,
                  scheduler_state: dict[str, Any], after_step: str = "",
                  valid_samples: int) -> None:
        self.iteration, self.consumed_samples = iteration, consumed_samples
        self.scheduler.load_state_dict(scheduler_state)  # a fresh schedule: adds its steps
        self._redo_after = after_step

    def _take_redo_after(self) -> str:
        phase, self._redo_after = self._redo_after, ""
        if self.rank == 0:
            logger.info("the work after step %d is redone from its %s in the new layout",
                        self.iteration, _WORK_NAMES[phase])
        return phase
