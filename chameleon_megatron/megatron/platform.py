"""Run megatron-core on a CPU-only host (gloo), without editing any of its files.

megatron-core assumes CUDA in a few places that matter for training. When CUDA is absent,
``CpuPlatform.apply()`` patches exactly these call sites, and ``remove()`` restores them:

* ``torch.cuda.current_device`` -> ``"cpu"``: buffers are allocated with
  ``device=torch.cuda.current_device()`` (DDP's ``param_and_grad_buffer``, the distributed
  optimizer, ``parallel_state`` global memory buffer, pipeline p2p tensors).
* ``torch.cuda.synchronize`` -> no-op: called by schedules/timers and the optimizer.
* ``torch.cuda.Stream``, ``current_stream`` and ``stream`` -> ``NoStream`` and a null
  context: megatron-core 0.19's DDP orders its grad reduction on the current stream.
* ``megatron.core.tensor_parallel.random``: ``_get_cuda_rng_state``/``_set_cuda_rng_state``
  and ``CudaRNGStatesTracker.add``/``fork`` use the CPU generator, so the tensor-parallel
  RNG tracker (dropout inside TP regions, ``model_parallel_cuda_manual_seed``) works.
* A ``TorchFunctionMode`` that maps ``device="cuda"`` arguments to the CPU, makes
  ``Tensor.cuda()`` return the tensor itself, and answers ``Tensor.type()`` with the
  ``torch.cuda.*Tensor`` name that megatron's optimizer and ``clip_grads`` assert on.
* ``torch.compile`` -> identity, when applied before megatron-core is imported: its
  ``jit_fuser`` decorators (``megatron.core.jit``, used by ``megatron.core.fusions``) would
  otherwise load TorchInductor at import (about 40% of each process's start-up CPU time) to
  compile CUDA fusions that the trainer disables on CPU anyway.

Patches are applied once per ``CpuPlatform`` (idempotent) and only when CUDA is unavailable;
each call site is checked first against what its replacement takes (``check_cpu_seams``),
which is what differs between megatron-core releases (checked: 0.16.1, 0.19.2).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from importlib.metadata import version
from typing import Any, Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode

logger = logging.getLogger(__name__)


_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
    torch.float64: "torch.cuda.DoubleTensor",
    torch.int64: "torch.cuda.LongTensor",
    torch.int32: "torch.cuda.IntTensor",
    torch.uint8: "torch.cuda.ByteTensor",
    torch.bool: "torch.cuda.BoolTensor",
}


def _is_cuda_device(dev: Any) -> bool:
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    if isinstance(dev, str):
        return dev.startswith("cuda")
    return isinstance(dev, int) and not isinstance(dev, bool)


class _CudaToCpuMode(TorchFunctionMode):
    """Redirects CUDA placement requests in torch calls to the CPU."""

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: Any = None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            t = args[0]
            if t.device.type == "cpu" and t.dtype in _CUDA_TYPE_NAMES:
                return _CUDA_TYPE_NAMES[t.dtype]
        dev = kwargs.get("device")
        if dev is not None and _is_cuda_device(dev):
            kwargs = {**kwargs, "device": "cpu"}
        if func in (torch.Tensor.to,) and args and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


class NoStream:
    """A CUDA stream on a host without CUDA: work is synchronous, so waits are no-ops."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> None:
        return event

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


def _no_compile(fn: Callable | None = None, *args: Any, **kwargs: Any) -> Any:
    """torch.compile's signature, returning the function uncompiled (also as a decorator)."""
    return fn if fn is not None else (lambda f: f)


def _cpu_get_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False):
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False):
    torch.set_rng_state(new_state)


def _tracker_add(self: Any, name: str, seed: int) -> None:
    self._is_initialized = True
    if seed in self.seeds_:
        raise RuntimeError(f"rng seed {seed} already exists")
    if name in self.states_:
        raise RuntimeError(f"rng state {name} already exists")
    self.seeds_.add(seed)
    saved = torch.get_rng_state()
    torch.manual_seed(seed)
    self.states_[name] = torch.get_rng_state()
    torch.set_rng_state(saved)


@contextlib.contextmanager
def _tracker_fork(self: Any, name: str = "model-parallel-rng") -> Iterator[None]:
    # The CPU generator *is* the tracked generator here, so megatron's check that the CPU
    # state did not change inside the fork would fire on every dropout; swap states instead.
    if name not in self.states_:
        raise RuntimeError(f"rng state {name} is not added")
    outer = torch.get_rng_state()
    torch.set_rng_state(self.states_[name])
    try:
        yield
    finally:
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(outer)


class CpuPlatform:
    """The set of CPU patches; ``apply()`` is idempotent and ``remove()`` undoes it."""

    def __init__(self) -> None:
        self._saved: list[tuple[Any, str, Any]] = []
        self._mode: _CudaToCpuMode | None = None

    @property
    def applied(self) -> bool:
        return self._mode is not None

    def apply(self) -> bool:
        """Patch if CUDA is unavailable; returns whether patches are in effect."""
        if self.applied:
            return True
        if torch.cuda.is_available():
            return False
        self._set(torch, "compile", _no_compile)
        from megatron.core.tensor_parallel import random as mrandom

        check_cpu_seams(mrandom)
        self._set(torch.cuda, "current_device", lambda: "cpu")
        self._set(torch.cuda, "synchronize", lambda *a, **k: None)
        self._set(torch.cuda, "Stream", NoStream)
        self._set(torch.cuda, "current_stream", lambda *a, **k: NoStream())
        self._set(torch.cuda, "stream", lambda *a, **k: contextlib.nullcontext())
        self._set(mrandom, "_get_cuda_rng_state", _cpu_get_rng_state)
        self._set(mrandom, "_set_cuda_rng_state", _cpu_set_rng_state)
        self._set(mrandom.CudaRNGStatesTracker, "add", _tracker_add)
        self._set(mrandom.CudaRNGStatesTracker, "fork", _tracker_fork)
        self._mode = _CudaToCpuMode()
        self._mode.__enter__()
        logger.debug("megatron-core CPU platform patches applied")
        return True

    def remove(self) -> None:
        """Restore every patched attribute and leave the torch function mode."""
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
        for obj, name, old in reversed(self._saved):
            setattr(obj, name, old)
        self._saved.clear()

    def _set(self, obj: Any, name: str, value: Any) -> None:
        self._saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)


def _params(fn: Callable) -> list[str]:
    return [p for p in inspect.signature(fn).parameters if p != "self"]


REPLACED = {
    "_get_cuda_rng_state": {"device", "clone", "graph_safe"},
    "_set_cuda_rng_state": {"new_state", "device", "graph_safe"},
    "CudaRNGStatesTracker.add": {"name", "seed"},
    "CudaRNGStatesTracker.fork": {"name"},
}
"""The call sites of megatron.core.tensor_parallel.random that the CPU patches replace, with
the parameters their replacements take."""


def check_cpu_seams(mrandom: Any) -> None:
    """Each replaced call site, checked against what its replacement takes (not against a
    version list): RuntimeError naming the first that does not fit."""
    where = f"megatron-core {version('megatron-core')}: tensor_parallel.random"
    for name, accepted in REPLACED.items():
        fn: Any = mrandom
        for part in name.split("."):
            fn = getattr(fn, part, None)
        if fn is None:
            raise RuntimeError(f"{where}.{name} is missing; the CPU platform cannot replace it")
        extra = [p for p in _params(fn) if p not in accepted]
        if extra:
            raise RuntimeError(f"{where}.{name} takes {extra}, which its CPU replacement does "
                               f"not (it takes {sorted(accepted)})")
    tracker = mrandom.CudaRNGStatesTracker()
    if not (hasattr(tracker, "states_") and hasattr(tracker, "seeds_")):
        raise RuntimeError(f"{where}.CudaRNGStatesTracker keeps no states_/seeds_, which the "
                           "CPU add/fork use")


@contextlib.contextmanager
def cpu_platform() -> Iterator[bool]:
    """Context manager form: yields whether the CPU patches are in effect."""
    platform = CpuPlatform()
    try:
        yield platform.apply()
    finally:
        platform.remove()
