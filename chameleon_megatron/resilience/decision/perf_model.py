"""The performance model of paper B (Eq. 9-14) over a profile, with communication terms.

* A pipeline's step is the longest path through its 1F1B graph (``schedule``; Eq. 9/11),
  each stage's time being the sum of its layers' times, the embedding on the first and
  the output layer on the last stage, and each hop between stages costing
  latency + boundary_bytes / p2p bandwidth.
* A plan's step is its slowest pipeline (Eq. 10) plus the gradient synchronisation plus
  a constant per-step overhead. Gradients of a layer are all-reduced (ring) among the P
  pipelines that hold it, after the last backward; a rank's all-reduces share its link, so
  the synchronisation takes 2 (P-1)/P x (largest per-rank gradient bytes) / bandwidth.
* Rerouting (Eq. 12/13) keeps the plan and adds, to each pipeline, the extra microbatches
  its stages run for failed peers times that stage's (t_f + t_b).
* Memory of a stage (Eq. 14): L_i (2 m_p + m_o) + (in-flight microbatches) L_i m_a, with
  the embedding/output layers on the end stages. A stage over device memory fits by
  swapping activations when the profile gives a swap bandwidth, at the stall the copies add
  to its times (``swap_model``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

from chameleon_megatron.resilience.decision.layout import (
    EMBEDDING,
    OUTPUT,
    Pipeline,
    Plan,
    StateUnit,
)
from chameleon_megatron.resilience.decision.profile import LayerCost, Profile
from chameleon_megatron.resilience.decision.schedule import pipeline_time
from chameleon_megatron.resilience.decision.swap_model import StageSwap, stage_swap


def unit_cost(profile: Profile, unit: StateUnit) -> LayerCost:
    if unit == EMBEDDING:
        return profile.embedding
    if unit == OUTPUT:
        return profile.output
    return profile.layers[unit]  # type: ignore[index]


def hop_s(profile: Profile) -> float:
    """Time of one activation (or its gradient) between two consecutive stages."""
    return profile.link_latency_s + profile.boundary_bytes / profile.p2p_bandwidth_Bps


def sync_s(profile: Profile, num_pipelines: int, grad_bytes: float) -> float:
    """Ring all-reduce of ``grad_bytes`` per rank over ``num_pipelines`` holders."""
    if num_pipelines <= 1:
        return 0.0
    steps = 2 * (num_pipelines - 1)
    return steps / num_pipelines * grad_bytes / profile.allreduce_bandwidth_Bps \
        + steps * profile.link_latency_s


@dataclass(frozen=True)
class StageCost:
    forward_s: float
    backward_s: float
    static_bytes: float
    """Parameters + gradients + optimizer state (Eq. 14's L_i (2 m_p + m_o))."""
    activation_bytes: float
    """Activations of one microbatch (Eq. 14's L_i m_a)."""
    grad_bytes: float

    @property
    def state_bytes(self) -> float:
        """Parameters + optimizer state: what a migration moves."""
        return self.static_bytes - self.grad_bytes


def stage_cost(profile: Profile, units: Sequence[StateUnit]) -> StageCost:
    costs = [unit_cost(profile, u) for u in units]
    return StageCost(
        forward_s=sum(c.forward_s for c in costs),
        backward_s=sum(c.backward_s for c in costs),
        static_bytes=sum(2 * c.param_bytes + c.optimizer_bytes for c in costs),
        activation_bytes=sum(c.activation_bytes for c in costs),
        grad_bytes=sum(c.param_bytes for c in costs),
    )


def in_flight(depth: int, s: int, m: int, vpp: int = 1) -> float:
    """Microbatches whose activations stage ``s`` holds at its peak (in whole-stage units).

    1F1B: min(depth - s, m). Interleaved: megatron's warmup chunks + 1, each 1/vpp of a stage.
    """
    if vpp == 1:
        return min(depth - s, m)
    return min(2 * (depth - s - 1) + (vpp - 1) * depth + 1, m * vpp) / vpp


def stage_memory(cost: StageCost, depth: int, s: int, m: int, vpp: int = 1) -> float:
    """Eq. 14: peak bytes of stage ``s`` of a pipeline of ``depth`` running ``m`` microbatches."""
    return cost.static_bytes + in_flight(depth, s, m, vpp) * cost.activation_bytes


def _virtual_times(profile: Profile, pipe: Pipeline, vpp: int) -> tuple[list[float], list[float]]:
    """Forward/backward time of each virtual stage (chunk c of stage s is c * depth + s)."""
    nv = pipe.depth * vpp
    fwd, bwd = [0.0] * nv, [0.0] * nv
    for s, stage in enumerate(pipe.stages):
        per_chunk = len(stage.layers) // vpp
        for c in range(vpp):
            v = c * pipe.depth + s
            units: list[StateUnit] = list(stage.layers[c * per_chunk:(c + 1) * per_chunk])
            if v == 0:
                units.append(EMBEDDING)
            if v == nv - 1:
                units.append(OUTPUT)
            cost = stage_cost(profile, units)
            fwd[v], bwd[v] = cost.forward_s, cost.backward_s
    return fwd, bwd


@dataclass(frozen=True)
class StepEstimate:
    """Estimated step time of a plan, with its parts."""

    t_step_s: float
    pipeline_s: tuple[float, ...]
    """Per pipeline: longest path (+ rerouted extra work)."""
    sync_s: float
    peak_memory_bytes: float
    """Largest Eq. 14 figure over all stages (before any swapping)."""
    fits_memory: bool
    """Every stage fits device memory, swapping where the profile allows it."""
    swaps: Mapping[tuple[int, int], StageSwap] = field(default_factory=dict)
    """(pipeline, stage) -> the swap that makes that stage fit (``swap_model``)."""


def plan_step(plan: Plan, profile: Profile,
              extra_microbatches: dict[tuple[int, int], int] | None = None) -> StepEstimate:
    """Step estimate of a plan; ``extra_microbatches[(pipeline, stage)]`` is rerouted work.
    A stage over device memory fits by swapping when the profile has a swap bandwidth
    (``swap_model``): its times then include the copies."""
    if plan.tp != profile.tp:
        raise ValueError(f"plan tp={plan.tp} differs from the profile's tp={profile.tp}")
    if plan.num_layers != profile.num_layers:
        raise ValueError(
            f"plan has {plan.num_layers} layers, the profile {profile.num_layers}"
        )
    extra = extra_microbatches or {}
    hop = hop_s(profile)
    times, peak, grad, fits = [], 0.0, 0.0, True
    swaps: dict[tuple[int, int], StageSwap] = {}
    timed: dict[tuple, float] = {}  # equal pipelines are timed once
    for j, pipe in enumerate(plan.pipelines):
        fwd, bwd = _virtual_times(profile, pipe, plan.vpp)
        costs = [stage_cost(profile, pipe.stage_units(s)) for s in range(pipe.depth)]
        for s, cost in enumerate(costs):
            m = pipe.microbatches + extra.get((j, s), 0)
            peak = max(peak, stage_memory(cost, pipe.depth, s, m, plan.vpp))
            grad = max(grad, cost.grad_bytes)
            try:
                sw = _stage_swap(profile, cost, pipe.depth, s, m, plan.vpp)
            except ValueError:
                fits = False
                continue
            if sw is not None:
                swaps[(j, s)] = sw
                fwd[s], bwd[s] = sw.forward_s, sw.backward_s
        key = (tuple(fwd), tuple(bwd), pipe.microbatches)
        if key not in timed:
            timed[key] = pipeline_time(fwd, bwd, pipe.microbatches, hop, plan.vpp)
        t = timed[key]
        for s in range(pipe.depth):
            t += extra.get((j, s), 0) * (fwd[s] + bwd[s] if plan.vpp == 1 else
                                         costs[s].forward_s + costs[s].backward_s)
        times.append(t)
    sync = sync_s(profile, len(plan.pipelines), grad)
    return StepEstimate(
        t_step_s=max(times) + sync + profile.step_overhead_s,
        pipeline_s=tuple(times),
        sync_s=sync,
        peak_memory_bytes=peak,
        fits_memory=fits,
        swaps=swaps,
    )


def _stage_swap(profile: Profile, cost: StageCost, depth: int, s: int, m: int,
                vpp: int) -> StageSwap | None:
    """The swap stage ``s`` needs (None: none); ValueError: it does not fit either way.
    Interleaved pipelines are not swap-planned (they must fit as they are)."""
    bandwidth = profile.swap_bandwidth_Bps if vpp == 1 else 0.0
    return stage_swap(static=cost.static_bytes, act=cost.activation_bytes,
                      in_flight=in_flight(depth, s, m, vpp), forward_s=cost.forward_s,
                      backward_s=cost.backward_s, microbatches=m,
                      cap=profile.device_memory_bytes, bandwidth_Bps=bandwidth)
