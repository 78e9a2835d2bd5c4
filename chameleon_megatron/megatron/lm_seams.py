"""Which Megatron-LM releases the hook runs on, checked when ``pretrain_gpt.py`` starts.

patches/apply.py refuses to patch an unknown release, but a checkout updated after it was
patched keeps the hook: ``check_release`` refuses it at run time, from the version of the
``megatron`` package actually imported and from the signature of every function the hook
wraps or calls by position, compared with the leading parameters this project expects of
that release (read from core_v0.16.1, core_v0.17.1 and core_v0.19.0).
"""

from __future__ import annotations

import inspect
import re
from types import ModuleType
from typing import Any, Callable

SUPPORTED = ((0, 16), (0, 17), (0, 19))
"""Megatron-LM (major, minor) releases whose seams were checked (patches/apply.py's too)."""

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
EXPECTED: dict[tuple[int, int], dict[str, tuple[str, ...]]] = {
    (0, 16): _COMMON | {
        "pretrain": ("train_valid_test_dataset_provider", "model_provider", "model_type",
                     "forward_step_func"),
        "setup_model_and_optimizer": ("model_provider_func", "model_type",
                                      "checkpointing_context"),
    },
    (0, 19): _COMMON | {
        # the model comes from the config container (model_provider is None in pretrain_gpt)
        "pretrain": ("cfg_container", "train_valid_test_dataset_provider", "model_type",
                     "forward_step_func", "model_provider"),
        "setup_model_and_optimizer": ("model_type", "model_provider_func",
                                      "checkpointing_context"),
    },
}
EXPECTED[(0, 17)] = EXPECTED[(0, 16)]
"""Per release: function of ``megatron.training.training`` -> its expected leading
parameters (by name and position)."""


class UnsupportedMegatron(RuntimeError):
    """The imported Megatron-LM is not one whose seams were checked; one line says why."""


def release(version: str) -> tuple[int, int]:
    """(major, minor) of a version string such as '0.19.1' or '0.16.1rc0'."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise UnsupportedMegatron(f"Megatron-LM version {version!r} is not MAJOR.MINOR...")
    return int(match.group(1)), int(match.group(2))


def params(fn: Callable[..., Any]) -> tuple[str, ...]:
    return tuple(inspect.signature(fn).parameters)


def check_release(version: str, training: ModuleType,
                  pretrain: Callable[..., Any]) -> tuple[int, int]:
    """The release of ``version`` when it is supported and every seam of ``training`` (and
    ``pretrain``, the function the script calls) has the parameters expected of it; else
    ``UnsupportedMegatron`` naming the first difference."""
    key = release(version)
    if key not in EXPECTED:
        known = ", ".join(f"{a}.{b}.x" for a, b in SUPPORTED)
        raise UnsupportedMegatron(f"Megatron-LM {version} is not supported (supported: {known})")
    for name, want in EXPECTED[key].items():
        fn = pretrain if name == "pretrain" else getattr(training, name, None)
        if fn is None:
            raise UnsupportedMegatron(f"Megatron-LM {version} has no training.{name}")
        have = params(fn)
        if have[:len(want)] != want:
            raise UnsupportedMegatron(
                f"Megatron-LM {version}: {name}({', '.join(have)}) does not start with "
                f"({', '.join(want)}), the parameters the hook expects of {key[0]}.{key[1]}.x")
    return key


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
