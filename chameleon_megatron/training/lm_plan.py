"""Megatron-LM's loop while a recovery's plan runs: heterogeneous pipelines, or rerouting
around dead ranks, neither of which megatron's parallel state can express.

The steps go to the plan runtime (``resilience.execution``): each rank's stage is megatron-
core's ``GPTModel`` built from Megatron-LM's arguments (its layer spec: local or Transformer
Engine as ``--transformer-impl`` says), trained with megatron's DDP and optimizer and
Megatron-LM's LR schedule (``get_optimizer_param_scheduler``), fed from Megatron-LM's own
datasets (its ``dataset_provider``) in its sampler's order: global batch k holds samples
``[consumed, consumed + global batch)``, whatever pipeline runs them.

Evaluations and checkpoints due while a plan runs read megatron's parallel state, which a
plan has none of (and dist_checkpointing shards by it): the loop first changes to a megatron
layout (``LMLoop._leave_plan``, a "work" transition of the recovery controller), runs
Megatron-LM's own evaluation or save there, and the plan returns (a "back" transition) once
a step without such work follows.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Iterator

from chameleon_megatron.configurable import ConfigError

_BUILT_ON_RANK = "is_dataset_built_on_rank"


@dataclass(frozen=True)
class PlanData:
    """Megatron-LM's datasets as every rank of a plan holds them (any rank may be a first
    or a last stage, or run a dead rank's microbatches)."""

    train: Any
    valid: Any
    test: Any


@contextlib.contextmanager
def _built_on_every_rank(provider: Callable[..., Any]) -> Iterator[None]:
    """pretrain_gpt.py's provider builds a split only where its ``is_dataset_built_on_rank``
    says (first and last stages, first tensor-parallel rank, read from megatron's parallel
    state): here it says yes on every rank."""
    scope = getattr(provider, "__globals__", {})
    if _BUILT_ON_RANK not in scope:
        raise ConfigError(f"the dataset provider {getattr(provider, '__qualname__', provider)!r}"
                          f" has no {_BUILT_ON_RANK}() beside it (as pretrain_gpt.py's): a plan "
                          "needs its data on every rank")
    kept = scope[_BUILT_ON_RANK]
    scope[_BUILT_ON_RANK] = lambda *args, **kwargs: True
    try:
        yield
    finally:
        scope[_BUILT_ON_RANK] = kept


def plan_data(training: ModuleType, provider: Callable[..., Any]) -> PlanData:
    """Megatron-LM's train, validation and test datasets at its own sizes (the sample order
    depends on them), built on this rank; collective over the world (megatron's builder
    builds on rank 0 first)."""
    with _built_on_every_rank(provider):
        train, valid, test = training.build_train_valid_test_datasets(provider)
    if isinstance(valid, list):  # Megatron-LM's multiple validation sets: the first
        valid = valid[0] if valid else None
    return PlanData(train, valid, test)
