"""Stage adjusting (pure): choose the stage granularity, per layer or per microbatch.

The profile, the matcher and the change detector are keyed on stages. Per-layer stages
give the matcher a sharper feature and catch a change confined to one layer, so auto
starts with them. Their cost shows when a layer's signature keeps drifting while the
microbatch's does not (MoE with expert capacity drops different tokens in each layer each
step, moving bytes between layers): each drift past the size tolerance re-profiles fully and
re-plans, which microbatch stages, summing over the layers, would not have done.

The rule counts such *hidden* re-profiles: steps where the per-layer signature moved since
the last per-layer profile (actual, or would-be while running per microbatch) and the
microbatch signature over the same span did not.

* Layer -> microbatch: at least ``churn`` hidden re-profiles in the last ``window`` steps.
  A recurring drift that the coarser stages absorb is profiling and planning spent for
  nothing; one-off changes, and changes both granularities see, never count.
* Microbatch -> layer: no hidden re-profile in the last ``calm`` steps. The per-layer
  sequence is steady again, so the sharper stages cost no extra re-profiles.

Hysteresis: only steps since the last switch count, so switches are at least ``churn``
steps apart one way and ``calm`` steps the other (2 and 32 by default; docs/swap.md,
Stage adjusting, gives the measurements behind them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from chameleon_megatron.swap.signature import StepSignature, changed_stages
from chameleon_megatron.swap.stage import Granularity, coarsen


@dataclass(frozen=True)
class StageObservation:
    """One step as both granularities see it."""

    layer_changed: int
    """Layer stages whose signature moved since the last per-layer profile (0: none, or no
    reference to compare with in this step)."""
    microbatch_changed: int
    """Microbatch stages whose signature moved over the same span."""

    @property
    def hidden(self) -> bool:
        """A re-profile at layer granularity that microbatch granularity would not do."""
        return self.layer_changed > 0 and self.microbatch_changed == 0


def observe(reference: StepSignature | None, layers: StepSignature,
            size_tolerance: float) -> StageObservation:
    """Compare a step's per-layer signature with the one of the last per-layer profile."""
    if reference is None:
        return StageObservation(0, 0)
    return StageObservation(
        layer_changed=len(changed_stages(reference, layers, size_tolerance)),
        microbatch_changed=len(changed_stages(coarsen(reference), coarsen(layers),
                                              size_tolerance)))


@dataclass(frozen=True)
class AdjustRule:
    """Thresholds of the rule."""

    window: int = 8
    """Steps looked back at for hidden re-profiles at layer granularity."""
    churn: int = 2
    """Hidden re-profiles in ``window`` steps that switch to microbatch stages."""
    calm: int = 32
    """Steps without a hidden re-profile that switch back to layer stages."""

    def __post_init__(self) -> None:
        if not 1 <= self.churn <= self.window:
            raise ValueError(f"churn={self.churn} must be in [1, window={self.window}]")
        if self.calm < 1:
            raise ValueError(f"calm={self.calm} must be >= 1")


@dataclass(frozen=True)
class GranularityDecision:
    granularity: Granularity
    """The granularity to use from the next step."""
    switch: bool
    """Whether it differs from the one in use."""
    reason: str
    """'per-layer churn', 'layers steady' (a switch) or 'hold'."""
    hidden: int
    """Hidden re-profiles among the steps considered."""
    steps: int
    """Steps considered (since the last switch, at most the rule's span)."""


def choose_granularity(current: Granularity, since_switch: Sequence[StageObservation],
                       rule: AdjustRule = AdjustRule()) -> GranularityDecision:
    """The granularity for the next step, from the steps observed since the last switch
    (oldest first)."""
    if current == "layer":
        recent = since_switch[-rule.window:]
        hidden = sum(o.hidden for o in recent)
        if hidden >= rule.churn:
            return GranularityDecision("microbatch", True, "per-layer churn", hidden, len(recent))
        return GranularityDecision("layer", False, "hold", hidden, len(recent))
    if current != "microbatch":
        raise ValueError(f"granularity {current!r} must be 'layer' or 'microbatch'")
    recent = since_switch[-rule.calm:]
    hidden = sum(o.hidden for o in recent)
    if len(recent) >= rule.calm and hidden == 0:
        return GranularityDecision("layer", True, "layers steady", 0, len(recent))
    return GranularityDecision("microbatch", False, "hold", hidden, len(recent))
