"""Megatron-LM's model and optimizer built again for the megatron layout a recovery chose,
through its own ``setup_model_and_optimizer``: with a copy of its global arguments that
states the layout, adopted only once the build succeeded (``LMLoop.rebuild``)."""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Callable, Iterator

from chameleon_megatron.configurable import ConfigError
from chameleon_megatron.training.lm_globals import reconfigure_microbatches


def layout_arguments(args: Any, *, tp: int, pp: int, rank: int,
                     world_size: int) -> dict[str, int]:
    """Megatron-LM's arguments that state the layout tp x pp over ``world_size`` ranks for
    ``rank``; ConfigError when it does not fit the model."""
    if tp * pp < 1 or world_size % (tp * pp) or args.num_layers % pp:
        raise ConfigError(f"layout tp={tp} x pp={pp} over {world_size} ranks does not fit "
                          f"{args.num_layers} layers")
    return {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
            "transformer_pipeline_model_parallel_size": pp, "world_size": world_size,
            "rank": rank, "data_parallel_size": world_size // (tp * pp)}


@contextlib.contextmanager
def arguments_for(standing: Any, set_args: Callable[[Any], None],
                  layout: dict[str, int]) -> Iterator[Any]:
    """Megatron-LM's global arguments, while the body builds, as a copy of ``standing``
    stating ``layout`` (setup_model_and_optimizer reads them, and so does the microbatch
    calculator). The standing arguments (pretrain() holds them) take the copy's values only
    once the body succeeded; a failure (say, out of memory) leaves them untouched and the
    microbatch calculator as they state it."""
    staged = copy.copy(standing)
    vars(staged).update(layout)
    set_args(staged)
    try:
        reconfigure_microbatches(staged)
        yield staged
    except BaseException:
        reconfigure_microbatches(standing)
        raise
    finally:
        set_args(standing)
    vars(standing).update(vars(staged))


def setup_without_load(setup: Callable[[Any, Any], Any], model_provider: Any, model_type: Any,
                       args: Any) -> tuple[Any, Any, Any]:
    """Megatron-LM's ``setup_model_and_optimizer`` (as ``setup(model_provider,
    model_type)``) with nothing loaded from a checkpoint (its iteration and FLOP counters
    kept: state is the caller's to move in)."""
    kept = (args.iteration, args.num_floating_point_operations_so_far, args.load,
            args.pretrained_checkpoint)
    args.load = args.pretrained_checkpoint = None
    try:
        return setup(model_provider, model_type)
    finally:
        (args.iteration, args.num_floating_point_operations_so_far, args.load,
         args.pretrained_checkpoint) = kept
