"""Stage attribution: where in the step a saved tensor is packed.

A stage is forward/backward x microbatch x model chunk, and x transformer layer at layer
granularity. The schedule seams enter ``forward``/``backward`` around each microbatch;
layer hooks call ``enter_layer``/``exit_layer``. The tracker owns this step's per-stage
signature accumulators and the wall time of each schedule segment (one forward or backward
call), which the full profiler spreads over the segment's events.

At microbatch granularity the tracker still notes where each layer starts and ends in its
stage's sequence (a mark per layer entry, nothing per saved tensor), so the step's
per-layer signature is known at either granularity: stage adjusting compares the two.
"""

from __future__ import annotations

import contextlib
import time
from types import MappingProxyType
from typing import Callable, Iterator, Literal

from chameleon_megatron.swap.signature import (
    StageKey,
    StageSignature,
    StageStats,
    StepSignature,
)

Granularity = Literal["layer", "microbatch"]
"""What a stage is: forward/backward x microbatch x chunk, and x transformer layer for
"layer"."""


class StageTracker:
    """The current stage of this rank, updated by the seams, read by the pack hook."""

    def __init__(self, *, granularity: Granularity = "layer") -> None:
        self.granularity = granularity
        """Stages of the steps from the next ``reset`` on: per transformer layer, or per
        microbatch and chunk. Layer hooks must be installed for either to see layers."""
        self.sync: Callable[[], None] | None = None
        """Called at segment edges while timing must be exact (CUDA full profile)."""
        self.reset()

    def reset(self) -> None:
        """Start a new step: forget stage statistics, segments and pending outputs."""
        self._per_layer = self.granularity == "layer"
        """This step's granularity (read on the hot path)."""
        self.stats: dict[StageKey, StageStats] = {}
        self._marks: dict[StageKey, list[tuple[int, int, int]]] = {}
        """Microbatch granularity: (layer, codes so far, bytes so far) at each entry."""
        self.segments: list[tuple[float, float]] = []
        self.segment = -1
        self._where: tuple[str, int, int] = ("F", 0, 0)
        self._layer_stack: list[int] = []
        self._outputs: dict[int, tuple[int, int]] = {}
        self.current = self._stats_for(-1)

    @property
    def step_granularity(self) -> Granularity:
        """This step's granularity (``granularity`` may change for the next one)."""
        return "layer" if self._per_layer else "microbatch"

    def signature(self) -> StepSignature:
        """This step's signature at its granularity."""
        if self._per_layer:
            return StepSignature.of(self.stats)
        return coarsen(self.layer_signature())

    def layer_signature(self) -> StepSignature:
        """This step's signature per transformer layer, at either granularity."""
        if self._per_layer:
            return StepSignature.of(self.stats)
        fine: dict[StageKey, StageStats] = {}
        for key, stats in self.stats.items():
            marks = self._marks[key]
            ends = [(pos, nbytes) for _, pos, nbytes in marks[1:]]
            ends.append((len(stats.codes), stats.nbytes))
            for (layer, start, before), (end, after) in zip(marks, ends):
                piece_key = (*key[:3], layer)
                piece = fine.get(piece_key)
                if piece is None:
                    piece = fine[piece_key] = StageStats(piece_key)
                piece.codes.extend(stats.codes[start:end])
                piece.nbytes += after - before
        return StepSignature.of(fine)

    def _stats_for(self, layer: int) -> StageStats:
        phase, mb, chunk = self._where
        key = (phase, mb, chunk, layer if self._per_layer else -1)
        stats = self.stats.get(key)
        if stats is None:
            stats = self.stats[key] = StageStats(key)
        if not self._per_layer:
            self._marks.setdefault(key, []).append((layer, len(stats.codes), stats.nbytes))
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


def coarsen(layers: StepSignature) -> StepSignature:
    """The microbatch-granularity view of a per-layer signature: per (phase, microbatch,
    chunk), the summed counts and bytes and a digest over the layers' digests in order."""
    groups: dict[StageKey, list[tuple[int, StageSignature]]] = {}
    for (phase, mb, chunk, layer), sig in layers.stages.items():
        groups.setdefault((phase, mb, chunk, -1), []).append((layer, sig))
    return StepSignature(MappingProxyType({
        key: StageSignature(count=sum(s.count for _, s in group),
                            nbytes=sum(s.nbytes for _, s in group),
                            digest=hash(tuple(sorted((layer, s.digest) for layer, s in group))))
        for key, group in groups.items()}))
