"""Megatron-LM's training package (``megatron.training``) on a CPU-only host, without editing
any of its files: what ``CpuPlatform`` does for megatron-core, for the code of
``pretrain_gpt.py``'s ``pretrain()``.

While ``pretrain()`` runs on a host without CUDA (``lm_cpu_platform``):

* ``CpuPlatform`` patches megatron-core (devices, RNG tracker, synchronize, tensor types);
* ``training.initialize_megatron`` is called with ``allow_no_cuda=True``: its
  "Megatron requires CUDA." assertion is the only thing that stops a gloo run;
* ``initialize._compile_dependencies`` keeps its first half only: the dataset index
  helpers (``helpers_cpp``) are loaded (the checkout's when built, else the installed
  megatron-core wheel's, else built with Megatron-LM's ``make``), while the fused CUDA
  kernels, which need nvcc, are not;
* the ``torch.cuda`` functions that ``megatron.training`` calls unconditionally on its way
  (``empty_cache``, ``set_device``, the CUDA generator state a checkpoint saves and loads:
  empty; streams are ``CpuPlatform``'s) become no-ops, and ``device_count`` says 1 (one
  "device" per process: megatron builds its parallel state only when it counts a device).
  ``torch.cuda.is_available()`` keeps saying False;
* ``validate_args``' question for the GPU generation (with TP > 1) is answered "none", and
  ``CUDA_DEVICE_MAX_CONNECTIONS=1``, which it then requires, is set where not given
  (``cpu_arguments``; also around ``validate_args`` itself, ``validating_on_cpu``, since
  0.19's ``pretrain_gpt.py`` validates before ``pretrain()``).

Before that, ``set_cpu_defaults`` turns the Megatron-LM flags that a CPU needs into parser
defaults (gloo, no fused CUDA kernels, no rerun state machine, local layers without
Transformer Engine), so that a GPU user's command line runs unchanged on a CPU host.

Each replaced name is checked before it is replaced (a Megatron-LM that lacks one is
refused with its name) and restored when ``pretrain()`` returns or raises.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import importlib.metadata
import importlib.util
import logging
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterator

import torch

from chameleon_megatron.megatron.platform import CpuPlatform
from chameleon_megatron.megatron.te_absent import TeAbsentPatch

logger = logging.getLogger(__name__)

HELPERS = "megatron.core.datasets.helpers_cpp"
NO_GPU_ARCH = 0
"""What Megatron-LM's ``get_device_arch_version`` says on a host without CUDA (its
``validate_args`` asks with TP > 1): no GPU generation."""
CPU_ENV = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
"""Environment Megatron-LM requires of a TP run on GPUs before Blackwell (which it takes a CPU
for); a CPU has no CUDA connections to limit. Set for ``pretrain()`` where not given."""
HELPERS_DIR = "megatron/core/datasets"
CUDA_STAND_INS: dict[str, Callable[..., Any]] = {
    # _initialize_distributed builds megatron's parallel state only when it sees a device
    "device_count": lambda: 1,
    "set_device": lambda *a, **k: None,
    "empty_cache": lambda: None,
    # checkpoints carry a CUDA generator state; a CPU host has none to save or restore
    "get_rng_state": lambda *a, **k: torch.empty(0, dtype=torch.uint8),
    "set_rng_state": lambda *a, **k: None,
}
"""torch.cuda functions Megatron-LM's training code calls without asking for CUDA first
(streams are ``CpuPlatform``'s)."""


CPU_DEFAULTS = {
    "distributed_backend": "gloo",
    # fused CUDA kernels (apex, TE, torch's CUDA-only fusions) that have no CPU path
    "gradient_accumulation_fusion": False,
    "no_persist_layer_norm": True,
    "masked_softmax_fusion": False,
    "bias_gelu_fusion": False,
    "bias_swiglu_fusion": False,
    "bias_dropout_fusion": False,
    "apply_rope_fusion": False,
    # the rerun state machine (re-running steps to catch silent data corruption on GPUs)
    # saves the CUDA RNG state before every step
    "rerun_mode": "disabled",
}
"""Megatron-LM parser defaults on a host without CUDA; flags on the command line still win."""


def set_cpu_defaults(parser: argparse.ArgumentParser) -> None:
    """Where CUDA is absent, make the Megatron-LM flags that CPU requires the defaults, so
    that the command line a GPU user runs works as it is: gloo, no fused CUDA kernels,
    and megatron-core's local layers when Transformer Engine is not installed."""
    if torch.cuda.is_available():
        return
    defaults = dict(CPU_DEFAULTS)
    if importlib.util.find_spec("transformer_engine") is None:
        defaults["transformer_impl"] = "local"
    known = {action.dest for action in parser._actions}
    parser.set_defaults(**{k: v for k, v in defaults.items() if k in known})


def _installed_helpers() -> Path | None:
    """The compiled dataset helpers of the installed megatron-core wheel, if any."""
    try:
        files = importlib.metadata.distribution("megatron-core").files or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in files:
        if file.name.startswith("helpers_cpp") and file.parent.as_posix() == HELPERS_DIR:
            return Path(file.locate())
    return None


def load_dataset_helpers() -> str:
    """Make ``megatron.core.datasets.helpers_cpp`` importable; say where it came from."""
    try:
        importlib.import_module(HELPERS)
        return "built"
    except ImportError:
        pass
    wheel = _installed_helpers()
    if wheel is None:
        from megatron.core.datasets.utils import compile_helpers

        compile_helpers()  # rank 0 only: Megatron-LM's own build (make, pybind11)
        return "make"
    spec = importlib.util.spec_from_file_location(HELPERS, wheel)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[HELPERS] = module
    setattr(importlib.import_module("megatron.core.datasets"), "helpers_cpp", module)
    return str(wheel)


def _compile_dependencies_cpu() -> None:
    """Every rank gets the dataset helpers: the checkout's if built, else the installed
    megatron-core wheel's (the same C++ code, compiled for this Python), else rank 0 builds
    them as Megatron-LM does. The fused kernels are CUDA-only and never built here."""
    if torch.distributed.get_rank() == 0:
        logger.info("megatron.core.datasets helpers: %s", load_dataset_helpers())
    torch.distributed.barrier()
    if torch.distributed.get_rank() != 0:
        load_dataset_helpers()


def _replace(module: ModuleType, name: str, make: Callable[[Any], Any], saved: list) -> None:
    """``module.name = make(original)``, once the original is known to exist."""
    if not hasattr(module, name):
        raise RuntimeError(f"{module.__name__}.{name} is missing: this Megatron-LM's training "
                           "code cannot run on CPU through chameleon_megatron")
    original = getattr(module, name)
    saved.append((module, name, original))
    setattr(module, name, make(original))


@contextlib.contextmanager
def cpu_arguments() -> Iterator[None]:
    """Megatron-LM's ``validate_args`` on a host without CUDA, for the block: its question
    for the GPU generation (with TP > 1) is answered "none", and the
    ``CUDA_DEVICE_MAX_CONNECTIONS=1`` it then requires is set where not given."""
    if torch.cuda.is_available():
        yield
        return
    saved: list[tuple[ModuleType, str, Any]] = []
    env = {k: v for k, v in CPU_ENV.items() if k not in os.environ}
    try:
        _replace(importlib.import_module("megatron.training.arguments"),
                 "get_device_arch_version", lambda _: lambda: NO_GPU_ARCH, saved)
        os.environ.update(env)
        yield
    finally:
        for name in env:
            os.environ.pop(name, None)
        for module, name, value in reversed(saved):
            setattr(module, name, value)


def validating_on_cpu(validate_args: Callable[..., Any]) -> Callable[..., Any]:
    """``validate_args`` run under ``cpu_arguments``: 0.19's pretrain_gpt.py validates its
    arguments in ``__main__``, before ``pretrain()`` (and ``lm_cpu_platform``) starts."""
    if getattr(validate_args, "_chameleon_cpu", False):
        return validate_args

    @functools.wraps(validate_args)
    def validate(*args: Any, **kwargs: Any) -> Any:
        with cpu_arguments():
            return validate_args(*args, **kwargs)

    validate._chameleon_cpu = True  # type: ignore[attr-defined]
    return validate


@contextlib.contextmanager
def lm_cpu_platform(training: ModuleType, initialize: ModuleType) -> Iterator[bool]:
    """Patch ``megatron.training`` for a CPU-only host for the block; yields whether it did
    (nothing is patched where CUDA is available)."""
    if torch.cuda.is_available():
        yield False
        return
    platform = CpuPlatform()
    te_absent = TeAbsentPatch()  # MoE routers read a name only TE defines
    saved: list[tuple[ModuleType, str, Any]] = []
    with cpu_arguments():
        try:
            platform.apply()
            te_absent.apply()
            _replace(training, "initialize_megatron",
                     lambda init: functools.partial(init, allow_no_cuda=True), saved)
            _replace(initialize, "_compile_dependencies", lambda _: _compile_dependencies_cpu,
                     saved)
            for name, stand_in in CUDA_STAND_INS.items():
                _replace(torch.cuda, name, lambda _, f=stand_in: f, saved)
            logger.info("no CUDA: Megatron-LM's training runs on the CPU (gloo)")
            yield True
        finally:
            for module, name, value in reversed(saved):
                setattr(module, name, value)
            te_absent.remove()
            platform.remove()
