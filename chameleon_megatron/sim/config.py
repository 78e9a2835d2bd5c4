"""Settings of a simulation run; YAML presets in configs/sim/ hold these keys."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import yaml

from chameleon_megatron.configurable import check, from_mapping
from chameleon_megatron.errors import reading

STRATEGIES = ("chameleon", "reroute", "replan", "checkpoint_restart", "redundant")
EXTRA_STRATEGIES = ("chameleon_swap",)
"""Not run unless asked for: Chameleon whose re-plans may swap activations to fit memory."""


@dataclass(frozen=True, kw_only=True)
class SimConfig:
    """A cluster, a model profile, a failure process and the strategies to compare."""

    SECTION: ClassVar[str] = "sim"

    profile: str
    """Profile JSON (a relative path is taken from the preset's folder, then the working one)."""
    tp: int = 1
    pp: int = 1
    dp: int = 1
    vpp: int = 1
    """Initial uniform layout; the cluster has tp x pp x dp devices."""
    global_batch_size: int | None = None
    """Override of the profile's global batch (samples)."""
    regroup_s: float | None = None
    """Override of the profile's regroup cost (s)."""
    device_memory_bytes: float | None = None
    """Override of the profile's device memory (bytes): memory-tight regimes."""
    swap_bandwidth_Bps: float = 50e9
    """Host<->device bandwidth of the ``chameleon_swap`` strategy, whose re-plans may swap
    activations to fit device memory (bytes/s; PCIe Gen5 x16 measures 50-55 GB/s). The other
    strategies plan without swapping."""
    horizon_s: float = 86400.0
    """Simulated wall-clock time."""
    mtbf_s: float = 7200.0
    """Mean time between failures of the whole job at full size (drawn traces)."""
    repair_s: float | None = 7200.0
    """Mean repair time of a failed device; none: never repaired."""
    seed: int = 0
    trace: str | None = None
    """Trace JSON to replay instead of drawing one."""
    mtbf_prior_s: float | None = None
    """Prior MTBF of Chameleon's D estimator; none: mtbf_s."""
    mtbf_prior_weight: float = 1.0
    """Failures the prior is worth."""
    detect_s: float = 10.0
    """Failure detection time, paid by every strategy."""
    restart_s: float = 300.0
    """Job restart from a checkpoint: relaunch, rendezvous, load."""
    checkpoint_write_s: float = 60.0
    """Checkpoint-restart's stall per checkpoint."""
    checkpoint_interval_s: float | None = None
    """Checkpoint interval; none: Young/Daly, sqrt(2 x write x MTBF)."""
    min_depth: int = 1
    max_depth: int | None = None
    search_time_limit_s: float | None = 60.0
    """Bound on each plan search."""
    strategies: tuple[str, ...] = STRATEGIES

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "vpp"):
            check(getattr(self, name) >= 1, f"sim.{name}", getattr(self, name), "must be >= 1")
        check(self.horizon_s > 0, "sim.horizon_s", self.horizon_s, "must be > 0")
        check(self.mtbf_s > 0, "sim.mtbf_s", self.mtbf_s, "must be > 0")
        check(self.repair_s is None or self.repair_s >= 0, "sim.repair_s", self.repair_s,
              "must be >= 0")
        for name in ("detect_s", "restart_s", "checkpoint_write_s"):
            check(getattr(self, name) >= 0, f"sim.{name}", getattr(self, name), "must be >= 0")
        check(self.checkpoint_interval_s is None or self.checkpoint_interval_s > 0,
              "sim.checkpoint_interval_s", self.checkpoint_interval_s, "must be > 0")
        known = STRATEGIES + EXTRA_STRATEGIES
        unknown = sorted(set(self.strategies) - set(known))
        check(not unknown, "sim.strategies", unknown, f"known strategies: {list(known)}")
        check(self.device_memory_bytes is None or self.device_memory_bytes > 0,
              "sim.device_memory_bytes", self.device_memory_bytes, "must be > 0")
        check(self.swap_bandwidth_Bps > 0, "sim.swap_bandwidth_Bps", self.swap_bandwidth_Bps,
              "must be > 0")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def checkpoint_interval(self) -> float:
        if self.checkpoint_interval_s is not None:
            return self.checkpoint_interval_s
        return math.sqrt(2 * max(self.checkpoint_write_s, 1e-9) * self.mtbf_s)


def load_preset(path: str | Path, **overrides: object) -> SimConfig:
    """A preset YAML file (a mapping of SimConfig keys), with overrides applied."""
    with reading(path):
        data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: the preset must be a mapping of sim keys")
    data.update({k: v for k, v in overrides.items() if v is not None})
    profile = Path(str(data.get("profile", "")))
    local = Path(path).parent / profile
    if data.get("profile") and not profile.is_absolute() and local.exists():
        data["profile"] = str(local)
    return from_mapping(SimConfig, data, where="sim")
