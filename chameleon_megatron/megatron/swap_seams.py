"""Stage attribution seams in megatron-core for the swap subsystem.

What is patched, and why:

* ``megatron.core.pipeline_parallel.schedules.forward_step`` and ``backward_step`` (module
  globals, looked up by every schedule at call time: no pipelining, 1F1B, interleaved).
  The forward wrapper enters ``tracker.forward(current_microbatch, vp_stage)`` and notes
  which microbatch produced the output; ``backward_step`` receives no microbatch id, so
  its wrapper looks the output object up to enter ``tracker.backward(...)``.
* Forward pre/post hooks on each ``TransformerLayer`` of the model chunks, for the layer
  (they fire again when activation recompute re-runs a layer in backward).

``install()`` is idempotent, ``remove()`` restores the originals; the schedule functions'
parameters are checked first (checked on megatron-core 0.16.1 and 0.19.2).
"""

from __future__ import annotations

import functools
import inspect
from importlib.metadata import version
from typing import Any, Callable, ContextManager, Iterable, Protocol

import torch

_MARK = "_chameleon_swap_seams"


def check_schedules(schedules: Any) -> str:
    """The megatron-core version, or RuntimeError if the schedule functions do not take
    what the seams need (their parameters are checked, not a version list)."""
    v = version("megatron-core")
    fwd = inspect.signature(schedules.forward_step).parameters
    bwd = inspect.signature(schedules.backward_step).parameters
    if not {"current_microbatch", "vp_stage"} <= set(fwd) or "output_tensor" not in bwd:
        raise RuntimeError(f"megatron-core {v}: forward_step/backward_step have unexpected "
                           "parameters; the swap seams need current_microbatch, vp_stage "
                           "and output_tensor")
    return v


class StageSink(Protocol):
    """What the seams tell (the swap subsystem's ``StageTracker``): where in the step it is."""

    granularity: str
    """"layer": the sink wants to know which transformer layer runs (layer hooks)."""

    def forward(self, microbatch: int, chunk: int) -> ContextManager[None]: ...
    def backward(self, microbatch: int, chunk: int) -> ContextManager[None]: ...
    def remember_output(self, output: Any, microbatch: int, chunk: int) -> None: ...
    def output_stage(self, output: Any) -> tuple[int, int]: ...
    def enter_layer(self, number: int) -> None: ...
    def exit_layer(self) -> None: ...


class SwapSeams:
    """The schedule wrappers and layer hooks that feed one ``StageSink``."""

    def __init__(self, tracker: StageSink, model_chunks: Iterable[torch.nn.Module]) -> None:
        self.tracker = tracker
        self.model_chunks = list(model_chunks)
        self._originals: dict[str, Callable] = {}
        self._layer_hooks: LayerHooks | None = None

    @property
    def installed(self) -> bool:
        return bool(self._originals)

    def install(self) -> None:
        from megatron.core.pipeline_parallel import schedules

        if self.installed:
            return
        check_schedules(schedules)
        for name in ("forward_step", "backward_step"):
            current = getattr(schedules, name)
            if hasattr(current, _MARK):
                raise RuntimeError(f"schedules.{name} is already wrapped by other swap seams; "
                                   "remove those first")
        self._originals = {"forward_step": schedules.forward_step,
                           "backward_step": schedules.backward_step}
        schedules.forward_step = self._wrap_forward(schedules.forward_step)
        schedules.backward_step = self._wrap_backward(schedules.backward_step)
        if self.tracker.granularity == "layer":
            self._layer_hooks = LayerHooks(self.tracker, transformer_layers(self.model_chunks))

    def remove(self) -> None:
        from megatron.core.pipeline_parallel import schedules

        for name, original in self._originals.items():
            if getattr(getattr(schedules, name), _MARK, None) is self:
                setattr(schedules, name, original)
        self._originals = {}
        if self._layer_hooks is not None:
            self._layer_hooks.remove()
            self._layer_hooks = None

    def _wrap_forward(self, original: Callable) -> Callable:
        tracker = self.tracker

        @functools.wraps(original)
        def forward_step(*args: Any, **kwargs: Any) -> Any:
            microbatch = kwargs.get("current_microbatch")
            microbatch = -1 if microbatch is None else microbatch
            chunk = kwargs.get("vp_stage") or 0
            with tracker.forward(microbatch, chunk):
                result = original(*args, **kwargs)
            if torch.is_grad_enabled():
                tracker.remember_output(result[0], microbatch, chunk)
            return result

        setattr(forward_step, _MARK, self)
        return forward_step

    def _wrap_backward(self, original: Callable) -> Callable:
        tracker = self.tracker
        position = list(inspect.signature(original).parameters).index("output_tensor")

        @functools.wraps(original)
        def backward_step(*args: Any, **kwargs: Any) -> Any:
            output = kwargs["output_tensor"] if "output_tensor" in kwargs else args[position]
            with tracker.backward(*tracker.output_stage(output)):
                return original(*args, **kwargs)

        setattr(backward_step, _MARK, self)
        return backward_step


def transformer_layers(
        model_chunks: Iterable[torch.nn.Module]) -> list[tuple[torch.nn.Module, int]]:
    """(layer, global layer number) of every megatron ``TransformerLayer`` in the chunks."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    return [(m, int(m.layer_number)) for chunk in model_chunks for m in chunk.modules()
            if isinstance(m, TransformerLayer)]


class LayerHooks:
    """Forward pre/post hooks that tell a tracker which layer runs; ``remove()`` undoes them."""

    def __init__(self, tracker: StageSink,
                 layers: Iterable[tuple[torch.nn.Module, int]]) -> None:
        self._handles = []
        for module, number in layers:
            self._handles.append(module.register_forward_pre_hook(
                lambda _m, _a, n=number: tracker.enter_layer(n)))
            self._handles.append(module.register_forward_hook(
                lambda _m, _a, _o: tracker.exit_layer()))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
