"""Config of the resilience runtime (flags --chameleon-ft*, YAML section ft)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar, Literal

from chameleon_megatron.configurable import check


@dataclass(frozen=True, kw_only=True)
class ResilienceConfig:
    """Fault tolerance (paper B): detection, decision center, recovery."""

    SECTION: ClassVar[str] = "ft"

    enabled: bool = False
    """Keep training in-process when a rank fails (needs the chameleon-run launcher)."""
    mtbf_prior_s: float = 6 * 3600.0
    """Prior estimate of the mean time between failures of the job, in seconds."""
    strategy: Literal["adaptive", "reroute", "replan"] = "adaptive"
    """Recovery strategy: pick by score (adaptive) or force one."""
    inject_fault: tuple[str, ...] = dataclasses.field(
        default=(), metadata={"flag": "--chameleon-inject-fault"}
    )
    """Deterministic fault, repeatable: 'rank=R,iteration=I,phase=forward|backward|optimizer,kind=exit|hang|exception'."""

    def __post_init__(self) -> None:
        check(self.mtbf_prior_s > 0, "ft.mtbf_prior_s", self.mtbf_prior_s, "must be > 0")
