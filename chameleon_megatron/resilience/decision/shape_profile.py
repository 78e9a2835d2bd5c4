"""Build a profile from a model shape and hardware figures.

Bytes come from the shape. Times come from FLOPs at a given seconds-per-FLOP (each rank
does 1/tp of a layer's FLOPs; backward is twice forward; the embedding lookup is taken
as free); calibration (``calibration.calibrate``) then rescales them to measured steps.
"""

from __future__ import annotations

from dataclasses import dataclass

from chameleon_megatron.resilience.decision.model_shape import ModelShape
from chameleon_megatron.resilience.decision.profile import LayerCost, Profile


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """Per-device figures of a cluster (see docs/decision_center.md for the H100 defaults)."""

    device_memory_bytes: float
    p2p_bandwidth_Bps: float
    allreduce_bandwidth_Bps: float
    transfer_bandwidth_Bps: float
    link_latency_s: float = 0.0
    regroup_s: float = 0.0
    swap_bandwidth_Bps: float = 0.0
    """Host<->device copy bandwidth per device (0: activations are not swapped)."""


def profile_from_shape(shape: ModelShape, hardware: Hardware, *, seconds_per_flop: float,
                       name: str, source: str, step_overhead_s: float = 0.0) -> Profile:
    if seconds_per_flop <= 0:
        raise ValueError(f"seconds_per_flop={seconds_per_flop}: must be > 0")
    t = shape.tp
    m_p, m_o = shape.bytes_per_param()

    def cost(params: float, flops: float, act: float) -> LayerCost:
        fwd = flops / t * seconds_per_flop
        return LayerCost(forward_s=fwd, backward_s=2 * fwd, param_bytes=params / t * m_p,
                         optimizer_bytes=params / t * m_o, activation_bytes=act)

    layer = cost(shape.layer_params(), shape.layer_flops(), shape.layer_activation_bytes())
    return Profile(
        name=name, tp=t, micro_batch_size=shape.micro_batch_size,
        global_batch_size=shape.global_batch_size,
        layers=(layer,) * shape.num_layers,
        embedding=cost(shape.embedding_params(), 0.0, shape.embedding_activation_bytes()),
        output=cost(shape.output_params(), shape.output_flops(), shape.output_activation_bytes()),
        boundary_bytes=shape.boundary_bytes(),
        device_memory_bytes=hardware.device_memory_bytes,
        p2p_bandwidth_Bps=hardware.p2p_bandwidth_Bps,
        allreduce_bandwidth_Bps=hardware.allreduce_bandwidth_Bps,
        transfer_bandwidth_Bps=hardware.transfer_bandwidth_Bps,
        link_latency_s=hardware.link_latency_s, regroup_s=hardware.regroup_s,
        swap_bandwidth_Bps=hardware.swap_bandwidth_Bps,
        step_overhead_s=step_overhead_s, source=source,
    )


H100 = Hardware(
    device_memory_bytes=72 * 2**30,
    p2p_bandwidth_Bps=25e9,
    allreduce_bandwidth_Bps=40e9,
    transfer_bandwidth_Bps=25e9,
    link_latency_s=20e-6,
    regroup_s=30.0,
)
"""H100-class defaults: 80 GiB HBM less ~8 GiB for the framework and fragmentation;
inter-node stage-to-stage and migration traffic at ~half of a 400 Gb/s NIC per GPU;
ring all-reduce at ~80% of it; 20 us per message; regrouping (new communicators, model,
optimizer and the first slow step) 30 s, the order Oobleck-like systems report."""
