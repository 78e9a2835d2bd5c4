"""Config of the swap subsystem (flags --chameleon-swap*, YAML section swap)."""

from __future__ import annotations

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
    """Device budget for resident saved activations per rank, in bytes (overrides the fractions)."""
    budget_bytes_per_stage: tuple[int, ...] = ()
    """One budget in bytes per pipeline stage, first stage first (overrides budget_bytes)."""
    budget_fraction: float = 0.5
    """Budget as a fraction of the profiled no-swap peak of resident saved activations
    (0 < f <= 1)."""
    budget_device_fraction: float | None = None
    """Budget as a fraction of total device memory, minus what the rest of training holds
    (CUDA only)."""
    bandwidth_gbps: float | None = None
    """Host<->device copy bandwidth in GB/s (none: measured at start-up on GPU, 10 on CPU)."""
    min_tensor_bytes: int | None = None
    """Saved tensors smaller than this are never swapped (none: chosen from the profile: the
    bytes a copy must move to outweigh its fixed cost at the measured bandwidth, lowered to
    the sizes present when the budget needs smaller ones)."""
    recompute: bool = True
    """Let the policy recompute leading transformer layers of this stage instead of swapping
    their activations, where that costs less than the swap's stall (megatron's block
    recompute; never when --recompute-granularity is set)."""
    strict: bool = False
    """Refuse a budget below the least any plan can meet (BudgetError); by default swap warns
    once with that least budget and swaps what it can."""
    granularity: Literal["auto", "layer", "microbatch"] = "auto"
    """Profiling stage: forward/backward x microbatch x chunk, and x transformer layer for
    'layer'; 'auto' starts per layer and switches at run time (docs/swap.md, Stage
    adjusting)."""
    size_tolerance: float = 0.05
    """Relative change of a stage's saved bytes (same operators) that counts as a changed
    sequence."""
    plan_time_limit_s: float = 5.0
    """Time limit of the exact solver on small planning problems; past it the sweep's plan is
    used."""
    host_cache_bytes: int = 8 << 30
    """Free host buffers kept for reuse across steps (pinned on GPU), in bytes."""
    oom_backoff: float = 0.8
    """After an out-of-memory error the next plan's budget is multiplied by this (0 < f < 1)."""

    def __post_init__(self) -> None:
        if self.budget_bytes is not None:
            check(self.budget_bytes > 0, "swap.budget_bytes", self.budget_bytes, "must be > 0")
        for b in self.budget_bytes_per_stage:
            check(b > 0, "swap.budget_bytes_per_stage", self.budget_bytes_per_stage,
                  "every budget must be > 0")
        check(0 < self.budget_fraction <= 1, "swap.budget_fraction", self.budget_fraction,
              "must be in (0, 1]")
        if self.budget_device_fraction is not None:
            check(0 < self.budget_device_fraction <= 1, "swap.budget_device_fraction",
                  self.budget_device_fraction, "must be in (0, 1]")
        if self.bandwidth_gbps is not None:
            check(self.bandwidth_gbps > 0, "swap.bandwidth_gbps", self.bandwidth_gbps,
                  "must be > 0")
        if self.min_tensor_bytes is not None:
            check(self.min_tensor_bytes >= 0, "swap.min_tensor_bytes", self.min_tensor_bytes,
                  "must be >= 0")
        check(0 <= self.size_tolerance < 1, "swap.size_tolerance", self.size_tolerance,
              "must be in [0, 1)")
        check(self.plan_time_limit_s > 0, "swap.plan_time_limit_s", self.plan_time_limit_s,
              "must be > 0")
        check(self.host_cache_bytes >= 0, "swap.host_cache_bytes", self.host_cache_bytes,
              "must be >= 0")
        check(0 < self.oom_backoff < 1, "swap.oom_backoff", self.oom_backoff,
              "must be in (0, 1)")


CPU_BANDWIDTH_BPS = 10e9
"""Assumed copy bandwidth without a GPU (the CPU executor copies synchronously)."""
GPU_BANDWIDTH_BPS = 50e9
"""What the decision center assumes of a GPU's host link (PCIe Gen5 x16 measures 50-55 GB/s)
until the swap subsystem measures it."""


def planned_bandwidth(config: SwapConfig) -> float:
    """The swap bandwidth a recovery may plan with: 0 when swap is off."""
    if not config.enabled:
        return 0.0
    if config.bandwidth_gbps is not None:
        return config.bandwidth_gbps * 1e9
    import torch

    return GPU_BANDWIDTH_BPS if torch.cuda.is_available() else CPU_BANDWIDTH_BPS
