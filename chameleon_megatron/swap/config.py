"""Config of the swap subsystem (flags --chameleon-swap*, YAML section swap)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar, Literal

from chameleon_megatron.configurable import check


@dataclass(frozen=True, kw_only=True)
class SwapConfig:
    """Activation swapping (paper A): profiler, policy generator and executor."""

    SECTION: ClassVar[str] = "swap"

    enabled: bool = False
    """Swap saved activations to host memory and back, following a profiled plan."""
    budget_bytes: int | None = None
    """Device budget for resident saved activations, in bytes (overrides budget_fraction)."""
    budget_fraction: float = 0.5
    """Budget as a fraction of the no-swap peak of resident saved activations (0 < f <= 1)."""
    bandwidth_gbps: float | None = None
    """Host<->device copy bandwidth in GB/s (none: measured at start-up on GPU, 10 on CPU)."""
    min_tensor_bytes: int = 1 << 20
    """Saved tensors smaller than this are never swapped."""

    def __post_init__(self) -> None:
        if self.budget_bytes is not None:
            check(self.budget_bytes > 0, "swap.budget_bytes", self.budget_bytes, "must be > 0")
        check(0 < self.budget_fraction <= 1, "swap.budget_fraction", self.budget_fraction,
              "must be in (0, 1]")
        if self.bandwidth_gbps is not None:
            check(self.bandwidth_gbps > 0, "swap.bandwidth_gbps", self.bandwidth_gbps,
                  "must be > 0")
        check(self.min_tensor_bytes >= 0, "swap.min_tensor_bytes", self.min_tensor_bytes,
              "must be >= 0")
