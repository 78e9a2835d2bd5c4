"""CUDA executor: streams, events, pinned pool (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch

from chameleon_megatron.swap.budget import BudgetSpec
from chameleon_megatron.swap.config import SwapConfig
from chameleon_megatron.swap.copier import CudaCopier, measure_bandwidth
from chameleon_megatron.swap.cost import ProfilerCost
from chameleon_megatron.swap.executor import SwapExecutor
from chameleon_megatron.swap.hostpool import HostPool
from chameleon_megatron.swap.manager import SwapManager
from chameleon_megatron.swap.stage import StageTracker

from toy import ToyGPT, batches, layer_hooks, run_step

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_cuda_swap_is_bitwise_within_budget_and_leak_free():
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = ToyGPT(hidden=256, layers=4).to(device)
    micro = [b.to(device) for b in batches(0, 3, 4, 128)]
    ref = [run_step(model, micro, None, seed=s) for s in range(4)]
    tracker = StageTracker()
    layer_hooks(model, tracker)
    ex = SwapExecutor(tracker, copier=CudaCopier(device),
                      pool=HostPool(pin=True, cache_bytes=1 << 30), min_bytes=1 << 16,
                      exclude=list(model.parameters()))
    cfg = SwapConfig(enabled=True, budget_fraction=0.5, min_tensor_bytes=1 << 16)
    mgr = SwapManager(cfg, ex, budget=BudgetSpec(fraction=0.5),
                      bandwidth_bps=measure_bandwidth(device, 64 << 20),
                      cost=ProfilerCost(light_s=0.0, full_s=0.0))
    for s in range(4):
        with mgr.step(s):
            out = run_step(model, micro, tracker, seed=s)
        assert out[0] == ref[s][0]
        assert all(torch.equal(a, b) for a, b in zip(out[1], ref[s][1]))
        m = mgr.last_metrics
        assert m["live_entries"] == 0 and m["host_buffers_live"] == 0
        if s:
            assert m["swapped_out_bytes"] > 0
            assert m["peak_resident_saved_bytes"] <= m["budget_bytes"]
            assert m["prefetches"] > 0
