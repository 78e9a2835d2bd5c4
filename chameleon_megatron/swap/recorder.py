"""Full-mode profiler: records every saved storage of a step and the order of events.

The executor calls ``on_pack`` for each new saved storage, ``on_use`` for its first
unpack and ``on_free`` for its release; ``finish`` turns the step into a ``StepProfile``.
Events carry the schedule segment they fall in; each segment's measured time is spread
evenly over its events (eager mode has no reliable per-operator times, and the host
clock runs ahead of the device on GPU).
"""

from __future__ import annotations

from typing import Sequence

from chameleon_megatron.swap.profile import (
    FREE,
    PACK,
    USE,
    DeviceMemory,
    StepProfile,
    TensorRecord,
)
from chameleon_megatron.swap.signature import StageKey, StepSignature


class FullRecorder:
    """Per-step recording; a fresh one per profiled step."""

    def __init__(self) -> None:
        self._rows: list[tuple] = []
        self._use: list[int] = []
        self._use_bytes: list[int] = []
        self._free: list[int] = []
        self._events: list[tuple[int, int]] = []
        self._event_segment: list[int] = []

    def on_pack(self, stage: StageKey, ordinal: int, code: int, history: int, occurrence: int,
                nbytes: int, shape: tuple[int, ...], swappable: bool, segment: int,
                device_bytes: int) -> int:
        uid = len(self._rows)
        self._rows.append((stage, ordinal, code, history, occurrence, nbytes, shape, swappable,
                           len(self._events), device_bytes))
        self._use.append(-1)
        self._use_bytes.append(-1)
        self._free.append(-1)
        self._event(uid, PACK, segment)
        return uid

    def on_use(self, uid: int, segment: int, device_bytes: int = -1) -> None:
        self._use[uid] = len(self._events)
        self._use_bytes[uid] = device_bytes
        self._event(uid, USE, segment)

    def on_free(self, uid: int, segment: int) -> None:
        self._free[uid] = len(self._events)
        self._event(uid, FREE, segment)

    def _event(self, uid: int, kind: int, segment: int) -> None:
        self._events.append((uid, kind))
        self._event_segment.append(segment)

    def finish(self, segments: Sequence[tuple[float, float]], op_names: Sequence[str],
               signature: StepSignature, device: DeviceMemory | None = None) -> StepProfile:
        """The step's profile; ``segments`` are (start, end) wall times of each segment."""
        records = tuple(
            TensorRecord(uid=uid, stage=stage, ordinal=ordinal, op=op_names[code], code=code,
                         history=history, occurrence=occurrence, nbytes=nbytes, shape=shape,
                         swappable=swappable, pack_event=pack, use_event=self._use[uid],
                         free_event=self._free[uid], device_bytes=device_bytes,
                         use_device_bytes=self._use_bytes[uid])
            for uid, (stage, ordinal, code, history, occurrence, nbytes, shape, swappable, pack,
                      device_bytes) in enumerate(self._rows)
        )
        return StepProfile(records=records, events=tuple(self._events),
                           event_times=spread_times(self._event_segment, segments),
                           signature=signature, device=device)


def spread_times(event_segment: Sequence[int],
                 segments: Sequence[tuple[float, float]]) -> tuple[float, ...]:
    """Time of each event: its segment's duration shared evenly among the segment's events.

    Times are compute time since the step's first segment, so gaps between segments
    (communication, data loading) do not count as time a copy can overlap with. An event
    outside every segment (-1) takes the time of the event before it.
    """
    per_segment: dict[int, int] = {}
    for s in event_segment:
        per_segment[s] = per_segment.get(s, 0) + 1
    offsets, elapsed = {}, 0.0
    for s, (start, end) in enumerate(segments):
        offsets[s] = elapsed
        elapsed += max(end - start, 0.0)
    seen: dict[int, int] = {}
    times, last = [], 0.0
    for s in event_segment:
        if s >= 0 and s in offsets:
            seen[s] = seen.get(s, 0) + 1
            start, end = segments[s]
            last = offsets[s] + max(end - start, 0.0) * seen[s] / per_segment[s]
        times.append(last)
    return tuple(times)
