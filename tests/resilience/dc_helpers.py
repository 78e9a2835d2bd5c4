"""Small synthetic profiles for the decision-center tests."""

from __future__ import annotations

from typing import Sequence

from chameleon_megatron.resilience.decision.profile import LayerCost, Profile


def cost(f: float = 1.0, b: float = 2.0, param: float = 1.0, opt: float = 2.0,
         act: float = 1.0) -> LayerCost:
    return LayerCost(forward_s=f, backward_s=b, param_bytes=param, optimizer_bytes=opt,
                     activation_bytes=act)


def make_profile(num_layers: int = 4, *, layers: Sequence[LayerCost] | None = None,
                 embedding: LayerCost | None = None, output: LayerCost | None = None,
                 tp: int = 1, gbs: int = 8, memory: float = 1e12, boundary: float = 0.0,
                 p2p_bw: float = 1.0, ar_bw: float = 1e12, transfer_bw: float = 1.0,
                 latency: float = 0.0, regroup: float = 0.0, overhead: float = 0.0,
                 swap_bw: float = 0.0) -> Profile:
    zero = cost(0.0, 0.0, 0.0, 0.0, 0.0)
    return Profile(
        name="synthetic", tp=tp, micro_batch_size=1, global_batch_size=gbs,
        layers=tuple(layers) if layers is not None else (cost(),) * num_layers,
        embedding=embedding or zero, output=output or zero, boundary_bytes=boundary,
        device_memory_bytes=memory, p2p_bandwidth_Bps=p2p_bw, allreduce_bandwidth_Bps=ar_bw,
        transfer_bandwidth_Bps=transfer_bw, link_latency_s=latency, regroup_s=regroup,
        step_overhead_s=overhead, swap_bandwidth_Bps=swap_bw,
    )
