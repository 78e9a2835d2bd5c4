"""The budget of resident saved bytes a plan must meet on this rank (pure)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from chameleon_megatron.swap.profile import StepProfile
from chameleon_megatron.swap.windows import resident_curve


@dataclass(frozen=True)
class BudgetSpec:
    """How the user gave the budget; exactly one way applies, in this order."""

    absolute_bytes: int | None = None
    """Bytes for this rank (from budget_bytes or its pipeline stage's budget)."""
    device_fraction: float | None = None
    """Fraction of ``device_total_bytes`` for the whole of training on this rank."""
    device_total_bytes: int | None = None
    fraction: float = 0.5
    """Fraction of the profiled no-swap peak of resident saved bytes."""


def resolve_budget(spec: BudgetSpec, profile: StepProfile, *, oom_factor: float = 1.0) -> int:
    """The budget in bytes for plans built from ``profile``, lowered by ``oom_factor``.

    With a device fraction, what training holds besides saved activations comes off the
    top (``other_bytes``).
    """
    resident = resident_curve(profile)
    if spec.absolute_bytes is not None:
        base = spec.absolute_bytes
    elif spec.device_fraction is not None:
        if spec.device_total_bytes is None:
            raise ValueError("swap.budget_device_fraction needs the device's total memory (CUDA)")
        other = other_bytes(profile, resident)
        base = int(spec.device_fraction * spec.device_total_bytes) - other
        if base <= 0:
            raise ValueError(
                f"swap.budget_device_fraction={spec.device_fraction}: "
                f"{int(spec.device_fraction * spec.device_total_bytes)} bytes of device memory "
                f"leave nothing for activations beside the {other} bytes the rest of "
                "training holds")
    else:
        base = int(spec.fraction * int(resident.max(initial=0)))
    return max(int(base * oom_factor), 1)


def other_bytes(profile: StepProfile, resident: np.ndarray) -> int:
    """Device memory that is not saved activations, at its worst over the step: tensors
    beside the saved ones at each pack (forward) and at each first use (backward: gradients
    and transients), the caching allocator's slack at the step's peak, and memory outside
    torch (CUDA context, NCCL, cuBLAS)."""
    seen = [r.device_bytes - int(resident[r.pack_event]) for r in profile.records]
    seen += [r.use_device_bytes - int(resident[r.use_event]) for r in profile.records
             if r.use_event >= 0 and r.use_device_bytes >= 0]
    other = max(seen, default=0)
    if profile.device is not None:
        d = profile.device
        other += max(d.peak_reserved - d.peak_allocated, 0) + d.outside_torch
    return other
