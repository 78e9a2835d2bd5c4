"""Which Megatron-LM checkouts the hook runs on: those whose seams have a known layout.

The hook wraps or calls functions of ``megatron.training.training`` by position. A layout
is the leading parameters each of them takes in a release this project read (core_v0.16.1
and core_v0.17.1: "0.16"; core_v0.19.0: "0.19"). A checkout is supported when every seam
matches one layout, whatever its version says (0.18.x runs where its seams are 0.19's).
``patches/apply.py`` checks the checkout's source with these tables before it patches (it
loads this file alone: standard library only); ``check_release`` checks the imported
functions when ``pretrain_gpt.py`` starts, so that a checkout updated after it was patched
is refused in one line naming the seam.
"""

from __future__ import annotations

import inspect
from types import ModuleType
from typing import Any, Callable, Mapping, Optional

_COMMON: dict[str, tuple[str, ...]] = {
    "build_train_valid_test_data_iterators": ("build_train_valid_test_datasets_provider",),
    "train": ("forward_step_func", "model", "optimizer", "opt_param_scheduler",
              "train_data_iterator", "valid_data_iterator", "process_non_loss_data_func",
              "config", "checkpointing_context", "non_loss_data_func"),
    "train_step": ("forward_step_func", "data_iterator", "model", "optimizer",
                   "opt_param_scheduler", "config", "forward_backward_func", "iteration"),
    "evaluate_and_print_results": ("prefix", "forward_step_func", "data_iterator", "model",
                                   "iteration", "process_non_loss_data_func", "config"),
    "save_checkpoint": ("iteration", "model", "optimizer", "opt_param_scheduler",
                        "num_floating_point_operations_so_far", "checkpointing_context"),
    "get_forward_backward_func": ("pp_size", "vp_size"),
}
LAYOUTS: dict[str, dict[str, tuple[str, ...]]] = {
    "0.16": _COMMON | {
        "pretrain": ("train_valid_test_dataset_provider", "model_provider", "model_type",
                     "forward_step_func"),
        "setup_model_and_optimizer": ("model_provider_func", "model_type",
                                      "checkpointing_context"),
    },
    "0.19": _COMMON | {
        # the model comes from the config container (model_provider is None in pretrain_gpt)
        "pretrain": ("cfg_container", "train_valid_test_dataset_provider", "model_type",
                     "forward_step_func", "model_provider"),
        "setup_model_and_optimizer": ("model_type", "model_provider_func",
                                      "checkpointing_context"),
    },
}
"""Layout name (the first release read with it) -> function of ``megatron.training.training``
-> its expected leading parameters, by name and position."""
SEAMS = tuple(LAYOUTS["0.16"])
"""The functions every layout names."""


class UnsupportedMegatron(RuntimeError):
    """The Megatron-LM checkout's seams match no known layout; one line says why."""


def params(fn: Callable[..., Any]) -> tuple[str, ...]:
    return tuple(inspect.signature(fn).parameters)


def _difference(name: str, have: Optional[tuple[str, ...]], want: tuple[str, ...]) -> str:
    if have is None:
        return f"it has no training.{name}"
    if have[:len(want)] != want:
        return f"{name}({', '.join(have)}) does not start with ({', '.join(want)})"
    return ""


def match_layout(version: str, have: Mapping[str, Optional[tuple[str, ...]]]) -> str:
    """The layout every seam of ``have`` (function -> its parameters, None when missing)
    matches; else ``UnsupportedMegatron`` naming the first difference from the nearest one."""
    differences = {layout: [d for d in (_difference(n, have.get(n), want)
                                        for n, want in seams.items()) if d]
                   for layout, seams in LAYOUTS.items()}
    nearest = min(differences, key=lambda layout: len(differences[layout]))
    if not differences[nearest]:
        return nearest
    raise UnsupportedMegatron(
        f"Megatron-LM {version}: {differences[nearest][0]}, the parameters the hook expects "
        f"of the {nearest} layout (known layouts: {', '.join(LAYOUTS)}; see patches/README.md)")


def check_release(version: str, training: ModuleType, pretrain: Callable[..., Any]) -> str:
    """The layout of the imported ``training`` module's seams (``pretrain``: the function
    the script calls), or ``UnsupportedMegatron`` naming the first difference."""
    bound = {name: getattr(training, name, None) for name in SEAMS} | {"pretrain": pretrain}
    return match_layout(version, {name: None if fn is None else params(fn)
                                  for name, fn in bound.items()})


def setup_for_rebuild(setup: Callable[..., Any]) -> Callable[[Any, Any], Any]:
    """Megatron-LM's ``setup_model_and_optimizer`` as ``setup(model_provider, model_type)``,
    the call a recovery makes after it built the new layout's parallel state.

    0.16/0.17 take the provider first. 0.19 takes the model type first and builds the model
    from a config container (pretrain_gpt.py passes no provider): it is made again from the
    arguments the recovery updated, as pretrain_gpt.py made it, with the new process groups.
    """
    if params(setup)[:1] != ("model_type",):
        return setup

    def setup_019(model_provider: Any, model_type: Any) -> Any:
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.training import get_args
        from megatron.training.argument_utils import (
            gpt_config_from_args,
            pretrain_cfg_container_from_args,
        )

        args = get_args()
        container = pretrain_cfg_container_from_args(args, gpt_config_from_args(args))
        return setup(model_type, model_provider, cfg_container=container,
                     pg_collection=ProcessGroupCollection.use_mpu_process_groups())

    return setup_019
