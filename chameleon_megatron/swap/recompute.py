"""Offload or recompute: how many layers of a stage to recompute instead of swapping (pure).

Recomputing a transformer layer costs its forward once more in backward and saves none of
its activations (only its input); swapping costs the stall its copies cannot hide. From one
per-layer profile, ``choose_recompute`` tries each number ``k`` of leading layers per model
chunk (megatron's "block" recompute: the first ``k`` layers of each chunk are recomputed)
and keeps the cheapest ``k``: the forward time of the recomputed layers plus the expected
stall of the swap plan that meets the budget with the remaining activations. A ``k`` whose
swap plan cannot meet the budget is out. Ties go to fewer recomputed layers.

Times come from the profile: a layer's forward is the compute time the profile spreads over
its forward saves (the step's time shared among its operators by count).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from chameleon_megatron.swap.policy import BudgetError, generate_policy
from chameleon_megatron.swap.profile import PACK, StepProfile, TensorRecord


@dataclass(frozen=True)
class RecomputeChoice:
    layers: int
    """Leading transformer layers of each model chunk to recompute (0: swap only)."""
    stall_s: float
    """Expected swap stall per step with that choice."""
    recompute_s: float
    """Forward time those layers add per step."""

    @property
    def cost_s(self) -> float:
        return self.stall_s + self.recompute_s


def layers_by_chunk(profile: StepProfile) -> dict[int, list[int]]:
    """Model chunk -> its transformer layer numbers, in order (per-layer profiles only)."""
    out: dict[int, set[int]] = {}
    for rec in profile.records:
        phase, _, chunk, layer = rec.stage
        if phase == "F" and layer >= 0:
            out.setdefault(chunk, set()).add(layer)
    return {chunk: sorted(layers) for chunk, layers in sorted(out.items())}


def layer_forward_s(profile: StepProfile) -> dict[int, float]:
    """Transformer layer -> its forward time over the step (every microbatch): the compute
    time the profile spreads over its forward saves (each event takes the time since the
    one before it)."""
    out: dict[int, float] = {}
    for e, (uid, kind) in enumerate(profile.events):
        stage = profile.records[uid].stage
        if kind == PACK and stage[0] == "F" and stage[3] >= 0:
            since = profile.event_times[e] - (profile.event_times[e - 1] if e else 0.0)
            out[stage[3]] = out.get(stage[3], 0.0) + since
    return out


def without_layers(profile: StepProfile, layers: set[int]) -> StepProfile:
    """The profile as it would be with ``layers`` recomputed: their forward saves gone."""
    def dropped(rec: TensorRecord) -> bool:
        return rec.stage[0] == "F" and rec.stage[3] in layers

    keep = [r for r in profile.records if not dropped(r)]
    uid = {r.uid: k for k, r in enumerate(keep)}
    events = [(e, (u, kind)) for e, (u, kind) in enumerate(profile.events) if u in uid]
    event = {old: new for new, (old, _) in enumerate(events)}

    def moved(e: int) -> int:
        return event[e] if e >= 0 else -1

    records = tuple(dataclasses.replace(r, uid=uid[r.uid], pack_event=moved(r.pack_event),
                                        use_event=moved(r.use_event),
                                        free_event=moved(r.free_event)) for r in keep)
    return StepProfile(records=records, events=tuple((uid[u], k) for _, (u, k) in events),
                       event_times=tuple(profile.event_times[old] for old, _ in events),
                       signature=profile.signature, device=profile.device)


def choose_recompute(profile: StepProfile, *, budget_bytes: int, bandwidth_bps: float,
                     min_bytes: int, time_limit_s: float = 0.1,
                     most_layers: int | None = None) -> RecomputeChoice | None:
    """The cheapest number of leading layers to recompute (see the module docstring), up
    to ``most_layers`` (None: all); None when no choice meets the budget."""
    chunks = layers_by_chunk(profile)
    if not chunks:
        return None
    forward = layer_forward_s(profile)
    best: RecomputeChoice | None = None
    most = min(len(v) for v in chunks.values())
    for k in range(min(most, most_layers if most_layers is not None else most) + 1):
        gone = {layer for layers in chunks.values() for layer in layers[:k]}
        try:
            policy = generate_policy(without_layers(profile, gone), budget_bytes=budget_bytes,
                                     bandwidth_bps=bandwidth_bps, min_bytes=min_bytes,
                                     time_limit_s=time_limit_s)
        except BudgetError:
            continue
        choice = RecomputeChoice(layers=k, stall_s=policy.expected_stall_s,
                                 recompute_s=sum(forward.get(layer, 0.0) for layer in gone))
        if best is None or choice.cost_s < best.cost_s:
            best = choice
    return best
