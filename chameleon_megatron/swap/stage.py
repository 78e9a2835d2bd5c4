"""Stage attribution: where in the step a saved tensor is packed.

A stage is forward/backward x microbatch x model chunk x transformer layer. The schedule
seams enter ``forward``/``backward`` around each microbatch; layer hooks call
``enter_layer``/``exit_layer``. The tracker owns this step's per-stage signature
accumulators and the wall time of each schedule segment (one forward or backward call),
which the full profiler spreads over the segment's events.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterable, Iterator

import torch

from chameleon_megatron.swap.signature import StageKey, StageStats, StepSignature


class StageTracker:
    """The current stage of this rank, updated by the seams, read by the pack hook."""

    def __init__(self, *, layers: bool = True) -> None:
        self.layers = layers
        """Whether stages are split per transformer layer (else per microbatch and chunk)."""
        self.sync: Callable[[], None] | None = None
        """Called at segment edges while timing must be exact (CUDA full profile)."""
        self.reset()

    def reset(self) -> None:
        """Start a new step: forget stage statistics, segments and pending outputs."""
        self.stats: dict[StageKey, StageStats] = {}
        self.segments: list[tuple[float, float]] = []
        self.segment = -1
        self._where: tuple[str, int, int] = ("F", 0, 0)
        self._layer_stack: list[int] = []
        self._outputs: dict[int, tuple[int, int]] = {}
        self.current = self._stats_for(-1)

    def signature(self) -> StepSignature:
        return StepSignature.of(self.stats)

    def _stats_for(self, layer: int) -> StageStats:
        phase, mb, chunk = self._where
        key = (phase, mb, chunk, layer if self.layers else -1)
        stats = self.stats.get(key)
        if stats is None:
            stats = self.stats[key] = StageStats(key)
        return stats

    @contextlib.contextmanager
    def _segment(self, phase: str, microbatch: int, chunk: int) -> Iterator[None]:
        outer, outer_layers = self._where, self._layer_stack
        self._where, self._layer_stack = (phase, microbatch, chunk), []
        self.current = self._stats_for(-1)
        if self.sync is not None:
            self.sync()
        self.segments.append((time.perf_counter(), 0.0))
        self.segment = len(self.segments) - 1
        try:
            yield
        finally:
            if self.sync is not None:
                self.sync()
            start, _ = self.segments[self.segment]
            self.segments[self.segment] = (start, time.perf_counter())
            self.segment = -1
            self._where, self._layer_stack = outer, outer_layers
            self.current = self._stats_for(outer_layers[-1] if outer_layers else -1)

    def forward(self, microbatch: int, chunk: int = 0) -> contextlib.AbstractContextManager:
        """Context of one microbatch's forward through one model chunk."""
        return self._segment("F", microbatch, chunk)

    def backward(self, microbatch: int, chunk: int = 0) -> contextlib.AbstractContextManager:
        """Context of one microbatch's backward through one model chunk."""
        return self._segment("B", microbatch, chunk)

    def remember_output(self, output: object, microbatch: int, chunk: int) -> None:
        """Note which microbatch produced ``output`` so its backward can be attributed."""
        self._outputs[id(output)] = (microbatch, chunk)

    def output_stage(self, output: object) -> tuple[int, int]:
        """(microbatch, chunk) of a remembered forward output; (-1, 0) if unknown."""
        return self._outputs.pop(id(output), (-1, 0))

    def enter_layer(self, number: int) -> None:
        self._layer_stack.append(number)
        self.current = self._stats_for(number)

    def exit_layer(self) -> None:
        if self._layer_stack:
            self._layer_stack.pop()
        self.current = self._stats_for(self._layer_stack[-1] if self._layer_stack else -1)


class LayerHooks:
    """Forward pre/post hooks that tell a tracker which layer runs; ``remove()`` undoes them."""

    def __init__(self, tracker: StageTracker,
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
