"""Full-profile data: one record per saved storage of a step, and the step's event order.

Plain frozen data, built by the full-mode recorder and read by the policy generator and
the matcher. Events are numbered in the order they happened in the step: a storage's first
pack, its first unpack in backward (its first backward use) and its release.
"""

from __future__ import annotations

from dataclasses import dataclass

from chameleon_megatron.swap.signature import StageKey, StepSignature

PACK, USE, FREE = 0, 1, 2
"""Event kinds."""


@dataclass(frozen=True)
class TensorRecord:
    """One saved storage (all saved tensors that share it) in a profiled step."""

    uid: int
    """Index of the record in its profile."""
    stage: StageKey
    """Stage of the first pack."""
    ordinal: int
    """Saved tensors packed earlier in the same stage."""
    op: str
    """Producing autograd operator and dtype, e.g. 'MulBackward0:torch.float32'."""
    code: int
    """Run-local integer code of ``op`` (what matching compares)."""
    history: int
    """Codes of the two tensors saved before it in the stage, packed in one int."""
    occurrence: int
    """Earlier tensors of the stage with the same code and history."""
    nbytes: int
    """Bytes of the storage."""
    shape: tuple[int, ...]
    """Shape of the first saved tensor on the storage."""
    swappable: bool
    """An activation packed in forward (not a parameter, input or recompute tensor)."""
    pack_event: int
    use_event: int
    """Event of the first backward use; -1 if never unpacked (e.g. recompute orphans)."""
    free_event: int
    """Event of the release; -1 if still alive at the end of the step."""
    device_bytes: int
    """Device memory in use at the pack (CUDA allocator; resident saved bytes on CPU)."""
    use_device_bytes: int = -1
    """Device memory in use at the first backward use (-1: never used)."""


@dataclass(frozen=True)
class DeviceMemory:
    """What the CUDA allocator and the device said over a profiled step."""

    peak_allocated: int
    """Most bytes held by tensors at any time of the step."""
    peak_reserved: int
    """Most bytes the caching allocator held (tensors plus its cached, fragmented blocks)."""
    outside_torch: int
    """Device memory used beside torch's allocator at the end of the step (CUDA context,
    NCCL buffers, cuBLAS workspaces): total - free - reserved."""


@dataclass(frozen=True)
class StepProfile:
    """What full mode recorded over one step."""

    records: tuple[TensorRecord, ...]
    events: tuple[tuple[int, int], ...]
    """(record uid, kind) of each event, in order."""
    event_times: tuple[float, ...]
    """Estimated compute time (s from the step start) of each event: each schedule
    segment's measured time spread evenly over its events."""
    signature: StepSignature
    """The lightweight signature of the same step."""
    device: DeviceMemory | None = None
    """The device's view of the step (None without CUDA)."""

    @property
    def num_events(self) -> int:
        return len(self.events)
