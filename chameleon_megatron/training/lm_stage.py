"""A plan's stages on Megatron-LM's pretrain_gpt.py, built and run as Megatron-LM builds
and runs its model (a ``StageBuilder``): the TransformerConfig from Megatron-LM's arguments
(``core_transformer_config_from_args``: every model flag of the job); the model from
Megatron-LM's own builder with the plan's process groups: the ``model_provider`` the script
passed to ``pretrain()`` (0.16, 0.17), or where it passes none (0.19: the model comes from a
config container) the GPT builder of the container ``pretrain()`` would make; the script's
``forward_step_func`` (its batch, its loss)."""

from __future__ import annotations

import contextlib
import inspect
from functools import partial
from typing import Any, Callable, Iterator

import torch
from megatron.core.transformer import TransformerConfig

from chameleon_megatron.training.stage_builder import ForwardStep, StageBuilder

_PROVIDER_TAKES = ("config", "pg_collection")


def megatron_lm_stages(get_args: Callable[[], Any], model_provider: Callable[..., Any] | None,
                       forward_step_func: ForwardStep) -> StageBuilder:
    """Megatron-LM's config, builder and forward step of the job whose arguments
    ``get_args`` returns."""
    def config() -> TransformerConfig:
        from megatron.training.arguments import core_transformer_config_from_args

        return core_transformer_config_from_args(get_args())

    def model(config: TransformerConfig, *, pre_process: bool, post_process: bool,
              layers: int, groups: Any) -> torch.nn.Module:
        if model_provider is None:
            gpt = _container_model(get_args(), config, pre_process, post_process, groups)
        else:
            gpt = model_provider(pre_process, post_process, config=config, pg_collection=groups)
        return gpt.to(torch.cuda.current_device() if torch.cuda.is_available() else "cpu")

    refusal = None if model_provider is None else provider_refusal(model_provider)
    return StageBuilder(config, model, forward_step_func, partial(stage_arguments, get_args),
                        refusal)


@contextlib.contextmanager
def stage_arguments(get_args: Callable[[], Any], depth: int) -> Iterator[None]:
    """Megatron-LM's arguments for a stage of a pipeline of ``depth``: the forward step
    chooses the fields of a batch a stage loads by ``args.pipeline_model_parallel_size``
    (not parallel state), and 0.19 gives a first stage of a pipeline no labels; a stage
    that is its pipeline's only one therefore sees a job without pipeline parallelism.
    (Deeper pipelines keep the job's value: a first or last stage is told by parallel
    state, and a middle one loads nothing; the value must split the layers evenly, as the
    forward step builds a TransformerConfig from the arguments.)"""
    args = get_args()
    if depth > 1:
        yield
        return
    kept, args.pipeline_model_parallel_size = args.pipeline_model_parallel_size, 1
    try:
        yield
    finally:
        args.pipeline_model_parallel_size = kept


def provider_refusal(provider: Callable[..., Any]) -> str | None:
    """A plan passes its config and process groups to the model provider, as Megatron-LM's
    own ``model_provider`` takes them: why ``provider`` cannot take them, or None."""
    try:
        params = inspect.signature(provider).parameters
    except (TypeError, ValueError):  # a builtin or C callable: nothing to read
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return None
    missing = [name for name in _PROVIDER_TAKES if name not in params]
    if not missing:
        return None
    name = getattr(provider, "__qualname__", None) or getattr(
        getattr(provider, "func", None), "__qualname__", repr(provider))
    return (f"the model provider {name} takes no {' or '.join(missing)} keyword: a plan "
            "builds its stages through it with the plan's config and process groups")


def _container_model(args: Any, config: TransformerConfig, pre_process: bool,
                     post_process: bool, groups: Any) -> torch.nn.Module:
    """0.19: the model config ``pretrain()`` makes from the arguments, with ``config`` as its
    transformer, built by its builder class for one stage."""
    from megatron.training.argument_utils import gpt_config_from_args

    model_config = gpt_config_from_args(args, config)
    builder = model_config.get_builder_cls()(model_config)
    return builder.build_model(groups, pre_process=pre_process, post_process=post_process)
