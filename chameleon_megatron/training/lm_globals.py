"""Megatron-LM's process-wide state that a re-entry of ``train()`` or a rebuild puts back:
its timers, its rerun state machine, its global arguments and its microbatch calculator."""

from __future__ import annotations

from typing import Any


def timers_of(timers: Any) -> dict[str, Any]:
    """Megatron's timers by name: ``Timers`` keeps them in ``_timers``, each saying whether it
    runs in ``_started`` (0.16 to 0.19). A release that changes that is refused by name when
    ``train()`` is first entered, not at a recovery."""
    found = getattr(timers, "_timers", None)
    if not isinstance(found, dict) or not all(
            isinstance(getattr(t, "_started", None), bool) for t in found.values()):
        raise RuntimeError(
            f"megatron's {type(timers).__name__} keeps no _timers of Timer objects with "
            "_started: the timers a failure left running cannot be stopped in this release")
    return found


def reset_timers(timers: Any) -> None:
    """Stop the timers a failure left running: train() starts its interval timer again, and
    megatron's timers refuse a second start."""
    for timer in timers_of(timers).values():
        if timer._started:
            timer.reset()


def reset_rerun_state() -> None:
    """A failed step leaves megatron's rerun state machine inside its run of the step: the
    redo must start one afresh (the machine refuses to run it again otherwise)."""
    from megatron.core.rerun_state_machine import RerunState, get_rerun_state_machine

    get_rerun_state_machine().state = RerunState.NOT_RUNNING_YET


def set_megatron_args(args: Any) -> None:
    from megatron.training.global_vars import set_args

    set_args(args)


def reconfigure_microbatches(args: Any) -> None:
    """Megatron's microbatch calculator for the data-parallel size ``args`` states."""
    from megatron.core.num_microbatches_calculator import (
        reconfigure_num_microbatches_calculator,
    )

    reconfigure_num_microbatches_calculator(
        args.rank, args.rampup_batch_size, args.global_batch_size, args.micro_batch_size,
        args.data_parallel_size, args.decrease_batch_size_if_needed)
