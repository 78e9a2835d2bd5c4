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


def _sleeping_blocks(model, cycles: int = 2_000_000) -> list:
    """Forward hooks that keep the GPU busy after each block (the host runs ahead)."""
    return [b.register_forward_hook(lambda *_: torch.cuda._sleep(cycles)) for b in model.blocks]


def test_copies_in_flight_while_blocks_are_reused_stay_bitwise():
    """No synchronisation per microbatch and a GPU kept busy: copies are still in flight when
    the allocator hands their blocks out again (the races a CPU test cannot show)."""
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = ToyGPT(hidden=1024, layers=4, heads=8).to(device)
    micro = [b.to(device) for b in batches(0, 4, 4, 512)]
    ref = [run_step(model, micro, None, seed=s) for s in range(4)]
    hooks = _sleeping_blocks(model)
    tracker = StageTracker()
    layer_hooks(model, tracker)
    ex = SwapExecutor(tracker, copier=CudaCopier(device),
                      pool=HostPool(pin=True, cache_bytes=64 << 20), min_bytes=1 << 16,
                      exclude=list(model.parameters()))
    mgr = SwapManager(SwapConfig(enabled=True, budget_fraction=0.3, min_tensor_bytes=1 << 16),
                      ex, budget=BudgetSpec(fraction=0.3), bandwidth_bps=20e9,
                      cost=ProfilerCost(light_s=0.0, full_s=0.0))
    try:
        for s in range(4):
            with mgr.step(s):
                out = run_step(model, micro, tracker, seed=s)
            assert out[0] == ref[s][0]
            assert all(torch.equal(a, b) for a, b in zip(out[1], ref[s][1]))
            assert mgr.last_metrics["live_entries"] == 0
    finally:
        for h in hooks:
            h.remove()


def test_a_swap_cancelled_while_its_copy_is_in_flight_keeps_the_tensor():
    device = torch.device("cuda")
    ex = SwapExecutor(StageTracker(), copier=CudaCopier(device),
                      pool=HostPool(pin=True, cache_bytes=1 << 30), min_bytes=0)
    x = torch.randn(1 << 22, device=device, requires_grad=True)
    with ex.hooks():
        y = (x * 2).sin()
    entry = next(iter(ex._entries.values()))
    torch.cuda._sleep(5_000_000)  # the copy out queues behind this
    ex._swap_out(entry)
    ex._prefetch(entry)  # cancelled before the copy finished: the device copy is kept
    y.sum().backward()
    assert torch.equal(x.grad, 2 * (2 * x.detach()).cos())
    ex.end_step()
    assert ex.live_entries == 0 and ex.pool.live == 0


def test_out_of_memory_in_a_copy_back_evicts_and_the_step_stays_bitwise():
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = ToyGPT(hidden=512, layers=4).to(device)
    micro = [b.to(device) for b in batches(0, 2, 4, 256)]
    ex = SwapExecutor(StageTracker(), copier=CudaCopier(device),
                      pool=HostPool(pin=True, cache_bytes=1 << 30), min_bytes=1 << 16,
                      exclude=list(model.parameters()))
    real, calls = ex.copier.alloc, []

    def alloc(nbytes, dev):
        calls.append(nbytes)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("injected")
        return real(nbytes, dev)

    ex.copier.alloc = alloc
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    with ex.hooks():
        logits = model(micro[0][:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), micro[0][:, 1:].flatten())
        entries = [e for e in ex._entries.values() if e.eligible]
        for e in entries[:-1]:  # all but the newest go out; backward brings them back
            ex._swap_out(e)
        loss.backward()
    grads = [p.grad for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    logits = model(micro[0][:, :-1])
    want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), micro[0][:, 1:].flatten())
    want.backward()
    assert loss.item() == want.item() and calls
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, model.parameters()))
