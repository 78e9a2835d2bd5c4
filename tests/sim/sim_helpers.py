"""A small cluster and profile for fast simulator tests."""

from __future__ import annotations

from chameleon_megatron.resilience.decision.profile import LayerCost, Profile

GB = 1e9


def small_profile(regroup_s: float = 20.0, memory: float = 40 * GB) -> Profile:
    """8 identical layers; 16 devices train TP1 x PP2 x DP8 with 64 microbatches."""
    layer = LayerCost(forward_s=0.01, backward_s=0.02, param_bytes=0.5 * GB,
                      optimizer_bytes=3 * GB, activation_bytes=0.2 * GB)
    edge = LayerCost(forward_s=0.005, backward_s=0.01, param_bytes=0.4 * GB,
                     optimizer_bytes=2.4 * GB, activation_bytes=0.1 * GB)
    return Profile(name="small", tp=1, micro_batch_size=1, global_batch_size=64,
                   layers=(layer,) * 8, embedding=edge, output=edge, boundary_bytes=0.01 * GB,
                   device_memory_bytes=memory, p2p_bandwidth_Bps=25 * GB,
                   allreduce_bandwidth_Bps=40 * GB, transfer_bandwidth_Bps=25 * GB,
                   link_latency_s=2e-5, regroup_s=regroup_s)
