"""The model profile the decision center plans with: per-layer costs, memory, links.

Every figure is per rank of a tensor-parallel group at the profile's ``tp`` and per
microbatch of ``micro_batch_size`` samples. JSON schema (``format: chameleon-profile/1``)
is documented in docs/decision_center.md.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from chameleon_megatron.errors import reading

FORMAT = "chameleon-profile/1"


@dataclass(frozen=True)
class LayerCost:
    """Cost of one layer (transformer layer, embedding or output) on one rank."""

    forward_s: float
    """Forward time of one microbatch."""
    backward_s: float
    """Backward time of one microbatch."""
    param_bytes: float
    """Parameter bytes (gradients are assumed the same size, Eq. 14's 2 m_p)."""
    optimizer_bytes: float
    """Optimizer state bytes (e.g. fp32 master weights and Adam moments)."""
    activation_bytes: float
    """Activation bytes kept from forward to backward for one microbatch."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"{f.name}={v!r}: must be a finite number >= 0")

    @property
    def state_bytes(self) -> float:
        """Parameters plus optimizer state: what a restorer moves for this layer."""
        return self.param_bytes + self.optimizer_bytes

    def scaled(self, factor: float) -> "LayerCost":
        """The same layer with compute times multiplied by ``factor``."""
        return dataclasses.replace(self, forward_s=self.forward_s * factor,
                                   backward_s=self.backward_s * factor)


@dataclass(frozen=True, kw_only=True)
class Profile:
    """What the performance model needs to know about a model on a cluster."""

    name: str
    tp: int
    """TP degree the times and bytes were measured/derived at."""
    micro_batch_size: int
    global_batch_size: int
    """B of Eq. 8, in samples; fixed across failures."""
    layers: tuple[LayerCost, ...]
    """One entry per transformer layer, in model order."""
    embedding: LayerCost
    output: LayerCost
    boundary_bytes: float
    """Bytes of the activation sent between consecutive stages per microbatch."""
    device_memory_bytes: float
    """Memory usable for parameters, gradients, optimizer state and activations."""
    p2p_bandwidth_Bps: float
    """Stage-to-stage link bandwidth (bytes/s)."""
    allreduce_bandwidth_Bps: float
    """Per-rank bandwidth of gradient all-reduce (bytes/s, ring algorithm)."""
    transfer_bandwidth_Bps: float
    """Per-rank bandwidth of state migration during recovery (bytes/s)."""
    swap_bandwidth_Bps: float = 0.0
    """Host<->device copy bandwidth of one rank for swapping activations (bytes/s, each
    direction); 0: the job does not swap, so every stage must fit device memory as it is."""
    link_latency_s: float = 0.0
    """Latency of one message (p2p hop or all-reduce step)."""
    regroup_s: float = 0.0
    """Measured cost of rebuilding communicators and model/optimizer for a new plan."""
    step_overhead_s: float = 0.0
    """Per-step time outside forward/backward/communication (optimizer step, data)."""
    source: str = ""
    """How the figures were obtained (free text)."""

    def __post_init__(self) -> None:
        for name in ("tp", "micro_batch_size", "global_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError(
                f"global_batch_size={self.global_batch_size} is not a multiple of "
                f"micro_batch_size={self.micro_batch_size}"
            )
        if not self.layers:
            raise ValueError("a profile needs at least one transformer layer")
        for name in ("p2p_bandwidth_Bps", "allreduce_bandwidth_Bps", "transfer_bandwidth_Bps",
                     "device_memory_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be > 0")
        for name in ("boundary_bytes", "link_latency_s", "regroup_s", "step_overhead_s",
                     "swap_bandwidth_Bps"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 0")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def global_microbatches(self) -> int:
        return self.global_batch_size // self.micro_batch_size

    def with_times_scaled(self, factor: float) -> "Profile":
        """Every compute time multiplied by ``factor`` (calibration)."""
        return dataclasses.replace(
            self,
            layers=tuple(c.scaled(factor) for c in self.layers),
            embedding=self.embedding.scaled(factor),
            output=self.output.scaled(factor),
        )


_COST_KEYS = tuple(f.name for f in dataclasses.fields(LayerCost))


def _cost(data: Mapping[str, Any], where: str) -> LayerCost:
    unknown = sorted(set(data) - set(_COST_KEYS) - {"repeat"})
    missing = [k for k in _COST_KEYS if k not in data]
    if unknown or missing:
        raise ValueError(f"{where}: unknown keys {unknown}, missing keys {missing}")
    try:
        return LayerCost(**{k: float(data[k]) for k in _COST_KEYS})
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from None


def profile_from_dict(data: Mapping[str, Any]) -> Profile:
    """Build and validate a profile from its JSON form."""
    if data.get("format") != FORMAT:
        raise ValueError(f"format={data.get('format')!r}: expected {FORMAT!r}")
    layers: list[LayerCost] = []
    for k, entry in enumerate(data.get("layers", [])):
        repeat = int(entry.get("repeat", 1))
        if repeat < 1:
            raise ValueError(f"layers[{k}].repeat={repeat}: must be >= 1")
        layers.extend([_cost(entry, f"layers[{k}]")] * repeat)
    fields = {f.name for f in dataclasses.fields(Profile)} - {"layers", "embedding", "output"}
    unknown = sorted(set(data) - fields - {"format", "layers", "embedding", "output", "model"})
    if unknown:
        raise ValueError(f"unknown profile key {unknown[0]!r}")
    required = [f.name for f in dataclasses.fields(Profile)
                if f.default is dataclasses.MISSING and f.name != "layers"]
    missing = [k for k in required if k not in data]
    if missing:
        raise ValueError(f"profile is missing key {missing[0]!r}")
    scalars = {k: data[k] for k in fields if k in data}
    try:
        return Profile(layers=tuple(layers), embedding=_cost(data["embedding"], "embedding"),
                       output=_cost(data["output"], "output"), **scalars)
    except TypeError as exc:
        raise ValueError(f"profile: {exc}") from None


def profile_to_dict(profile: Profile, model: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """JSON form; runs of identical layers are written once with ``repeat``."""
    runs: list[dict[str, Any]] = []
    for cost in profile.layers:
        entry = dataclasses.asdict(cost)
        if runs and {k: v for k, v in runs[-1].items() if k != "repeat"} == entry:
            runs[-1]["repeat"] += 1
        else:
            runs.append({"repeat": 1, **entry})
    out: dict[str, Any] = {"format": FORMAT}
    for f in dataclasses.fields(profile):
        value = getattr(profile, f.name)
        out[f.name] = dataclasses.asdict(value) if isinstance(value, LayerCost) else value
    out["layers"] = runs
    if model is not None:
        out["model"] = dict(model)
    return out


def load_profile(path: str | Path) -> Profile:
    with reading(path):
        data = json.loads(Path(path).read_text())
    try:
        return profile_from_dict(data)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def save_profile(profile: Profile, path: str | Path,
                 model: Mapping[str, Any] | None = None) -> None:
    Path(path).write_text(json.dumps(profile_to_dict(profile, model), indent=2) + "\n")
