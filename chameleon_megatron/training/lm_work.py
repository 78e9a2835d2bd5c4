"""Megatron-LM's own calls of the work beside its steps that the loop runs itself, inside its
recovery scope: the evaluation and the checkpoint after a step (when a recovery redoes
them), and what ``pretrain()`` does after ``train()`` (its final checkpoint, its
evaluations on the validation and test sets). Each is given the objects trained now."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable


@dataclass
class Entry:
    """The arguments of ``train()`` the work beside the steps needs again."""

    forward_step_func: Callable[..., Any]
    process_non_loss_data_func: Any
    checkpointing_context: Any
    non_loss_data_func: Any


@dataclass(frozen=True)
class Trained:
    """What the loop trains now, after step ``iteration``."""

    model: list[Any]
    optimizer: Any
    scheduler: Any
    config: Any
    iteration: int
    flops: float
    iterators: tuple[Any, Any, Any]
    """(train, valid, test): the ones that replace pretrain()'s now."""


def evaluate(training: ModuleType, entry: Entry, now: Trained, which: str = "") -> None:
    """Megatron-LM's evaluation after a step (``which`` ""), or at the end of the job on the
    "validation" or "test" set."""
    iterator = now.iterators[2] if which == "test" else now.iterators[1]
    label = f"iteration {now.iteration}" + (f" on {which} set" if which else "")
    training.evaluate_and_print_results(
        label, entry.forward_step_func, iterator, now.model, now.iteration,
        entry.process_non_loss_data_func, now.config, verbose=bool(which),
        write_to_tensorboard=not which or not training.get_args().skip_train,
        non_loss_data_func=entry.non_loss_data_func)


def save(training: ModuleType, entry: Entry, now: Trained, *, final: bool) -> None:
    """Megatron-LM's checkpoint after a step (timed, as its loop saves), or its final one."""
    objects = (now.iteration, now.model, now.optimizer, now.scheduler, now.flops,
               entry.checkpointing_context)
    if final:
        training.save_checkpoint(
            *objects, train_data_iterator=now.iterators[0],
            preprocess_common_state_dict_fn=training.preprocess_common_state_dict)
    else:
        # it stops and restarts train()'s interval timer, which runs only inside train():
        # a redo is outside it, and the timer refuses a stop unstarted and a second start
        interval = training.get_timers()("interval-time", log_level=0)
        outside = not interval._started
        if outside:
            interval.start()
        training.save_checkpoint_and_time(*objects, train_data_iterator=now.iterators[0])
        if outside:
            interval.reset()
