"""Executor on plain torch models: bitwise results, budget, no leaks, views, OOM path."""

from __future__ import annotations

import contextlib

import pytest
import torch

from chameleon_megatron.swap.config import SwapConfig
from chameleon_megatron.swap.copier import SyncCopier
from chameleon_megatron.swap.executor import SwapExecutor
from chameleon_megatron.swap.hostpool import HostPool
from chameleon_megatron.swap.stage import StageTracker
from chameleon_megatron.swap.summary import summary_row, summary_table

from toy import ToyGPT, batches, make_manager, run_step

pytestmark = pytest.mark.timeout(60)


def _same(a, b) -> bool:
    return a[0] == b[0] and len(a[1]) == len(b[1]) and all(
        torch.equal(x, y) for x, y in zip(a[1], b[1]))


def _reference(model, micro, steps):
    return [run_step(model, micro, None, seed=s) for s in range(steps)]


def test_half_budget_is_met_bitwise_with_bytes_swapped():
    torch.manual_seed(0)
    model = ToyGPT(hidden=32, layers=2)
    micro = batches(0, 3, 2, 16)
    ref = _reference(model, micro, 4)
    mgr = make_manager(model, SwapConfig(enabled=True, budget_fraction=0.5, min_tensor_bytes=1024))
    for s in range(4):
        with mgr.step(s):
            out = run_step(model, micro, mgr.executor.tracker, seed=s)
        m = mgr.last_metrics
        assert _same(out, ref[s]), f"step {s} differs"
        if s == 0:  # profiling step: nothing planned yet
            assert m["mode"] == "full" and m["swapped_out_bytes"] == 0
            no_swap_peak = m["peak_resident_saved_bytes"]
        else:
            assert m["plan_version"] == 1 and m["mode"] == "light"
            assert m["budget_bytes"] == no_swap_peak // 2
            assert 0 < m["swapped_out_bytes"] == m["swapped_in_bytes"]
            assert m["peak_resident_saved_bytes"] <= m["budget_bytes"]
            assert m["peak_saved_bytes"] == no_swap_peak
            assert m["matched"] == m["planned_tensors"] > 0 and m["unmatched"] == 0
            assert m["blocking_swapins"] == 0 and m["forced_swaps"] == 0
        assert m["live_entries"] == 0 and m["host_buffers_live"] == 0
    row = summary_row(3, mgr.totals)
    assert summary_table([(3, mgr.totals)]).splitlines()[1].split() == list(row)
    mib = 1 << 20
    # rank, steps, full steps, plans, changes; peak with a plan, no-swap peak; matched %
    assert row[:5] == ("3", "4", "1", "1", "0")
    assert row[7:10] == (f"{m['peak_resident_saved_bytes'] / mib:.1f}",
                         f"{no_swap_peak / mib:.1f}", "100.0")


def test_host_buffers_are_reused_across_steps():
    torch.manual_seed(0)
    model = ToyGPT(hidden=32, layers=2)
    micro = batches(0, 2, 2, 16)
    mgr = make_manager(model, SwapConfig(enabled=True, budget_fraction=0.4, min_tensor_bytes=1024))
    allocated = []
    for s in range(4):
        with mgr.step(s):
            run_step(model, micro, mgr.executor.tracker, seed=s)
        allocated.append(mgr.executor.pool.allocated)
    # The plan made at the end of step 0 reserved its buffers then, not in step 1's forward.
    assert allocated[0] == len(mgr.plan.decisions) > 0 and allocated[3] == allocated[0]


def _executor(model, budget: int | None, min_bytes: int = 0) -> SwapExecutor:
    ex = SwapExecutor(StageTracker(), copier=SyncCopier(),
                      pool=HostPool(pin=False, cache_bytes=1 << 30), min_bytes=min_bytes,
                      exclude=list(model.parameters()))
    ex.budget = budget
    return ex


def test_the_budget_holds_when_a_tensor_too_small_to_swap_tips_it_over():
    x = torch.randn(1024, requires_grad=True)  # 4 KiB: swappable
    w = torch.randn(256, requires_grad=True)  # 1 KiB: below the size threshold
    ex = _executor(torch.nn.Linear(1, 1), budget=5000, min_bytes=2048)
    with ex.hooks():
        a, b = x * 2, w * 2  # activations (a scalar product saves nothing)
        loss = a.sin().sum() + b.sin().sum()  # b's pack takes 5 KiB resident past 5000 B
        assert ex.resident == 1024 and ex.counters.evictions == 1
    assert ex.counters.peak_resident_saved_bytes <= 5000
    loss.backward()
    assert torch.equal(x.grad, 2 * (2 * x.detach()).cos())
    assert torch.equal(w.grad, 2 * (2 * w.detach()).cos())
    assert ex.live_entries == 0 and ex.pool.live == 0


def test_tensors_packed_but_never_unpacked_are_released():
    # Megatron's recompute runs bias-dropout-add under enable_grad inside a no-grad
    # forward: a graph that is built, packed, and dropped without a backward.
    w = torch.nn.Parameter(torch.randn(64, 64))
    ex = _executor(torch.nn.Linear(1, 1), budget=1)  # swap everything eligible
    x = torch.randn(8, 64)
    with ex.hooks(), torch.no_grad():
        with torch.enable_grad():
            orphan = (x @ w).sin() * 2
        assert ex.live_entries > 0 and ex.pool.live > 0
        del orphan
    assert ex.live_entries == 0 and ex.pool.live == 0 and ex.resident == ex.saved == 0
    assert ex.counters.swap_outs > 0


def test_views_of_one_storage_share_one_entry_and_keep_their_layout():
    w = torch.nn.Parameter(torch.randn(3, 8))
    lin = torch.nn.Linear(8, 24)
    x = torch.randn(5, 8)

    def graph():
        h = lin(x)  # one storage, split into three strided views below
        p, q, r = h.split(8, dim=-1)
        return (p * w[0]).sum() + (q.t() * w[1].unsqueeze(1)).sum() + (r * w[2]).sum()

    expected = torch.autograd.grad(graph(), [w, *lin.parameters()])
    ex = _executor(lin, budget=1)
    with ex.hooks():
        loss = graph()
    views = [e for e in ex._entries.values() if e.views and len(e.views) == 3]
    assert len(views) == 1 and views[0].nbytes == 5 * 24 * 4  # h, copied once
    got = torch.autograd.grad(loss, [w, *lin.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert ex.counters.blocking_swapins > 0  # no plan: every swap-in is on demand


def test_parameters_and_their_views_are_never_swapped():
    lin = torch.nn.Linear(16, 16)
    ex = _executor(lin, budget=1)
    x = torch.randn(4, 16, requires_grad=True)  # a leaf input held by the caller
    with ex.hooks():
        y = torch.nn.functional.linear(x, lin.weight) @ lin.weight.t()  # weight and weight.t()
    held = {t.untyped_storage().data_ptr() for t in (x, lin.weight, lin.bias)}
    assert ex._entries and all(e.key not in held for e in ex._entries.values())
    y.sum().backward()


def test_out_of_memory_on_swap_in_evicts_and_completes_the_step():
    torch.manual_seed(0)
    model = ToyGPT(hidden=32, layers=2)
    micro = batches(0, 1, 2, 16)
    ref = run_step(model, micro, None, seed=0)
    ex = _executor(model, budget=None, min_bytes=1024)
    real_start_in = ex.copier.start_in
    calls = []

    def failing_once(host, device, after):
        calls.append(host.numel())
        if len(calls) == 1:
            raise torch.OutOfMemoryError("injected")
        return real_start_in(host, device, after)

    ex.copier.start_in = failing_once
    with ex.hooks():
        model.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        logits = model(micro[0][:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), micro[0][:, 1:].flatten())
        entries = list(ex._entries.values())
        ex._swap_out(next(e for e in reversed(entries) if e.eligible))  # needed first in backward
        loss.backward()
    got = (loss.item(), [p.grad.clone() for p in model.parameters()])
    assert _same(got, ref)
    # The failed copy back is retried after evicting; the evicted storages come back later.
    assert ex.counters.evictions > 0 and calls[0] == calls[1]
    assert len(calls) == 2 + ex.counters.evictions
    assert ex.live_entries == 0 and ex.pool.live == 0


def test_an_output_whose_data_is_reassigned_after_saving_backpropagates_as_without_hooks():
    """Autograd keeps the storage an op's own saved output had when it was saved (megatron
    frees a pipeline output's data after sending it); the hooks hold the same storage."""
    def grads(hooked: bool) -> torch.Tensor:
        x = torch.linspace(-1, 1, 12).view(3, 4).requires_grad_()
        ex = _executor(torch.nn.Linear(1, 1), budget=None)
        with ex.hooks() if hooked else contextlib.nullcontext():
            y = (x * 2).sigmoid()  # sigmoid saves its own output
        z = y.sum()
        y.data = torch.zeros(1)
        z.backward()
        return x.grad

    assert torch.equal(grads(hooked=True), grads(hooked=False))


def test_an_abandoned_step_releases_every_entry_and_host_buffer():
    """Outputs their own op saves (softmax, sigmoid) must not keep their graph alive through
    the handle: a step abandoned before backward (an OOM redo, a recovery) frees everything."""
    import gc

    torch.manual_seed(0)
    model = ToyGPT(hidden=32, layers=2)
    micro = batches(0, 2, 2, 16)
    mgr = make_manager(model, SwapConfig(enabled=True, budget_fraction=0.5, min_tensor_bytes=256))
    for s in range(2):  # a plan exists from step 1 on: entries are swapped out to host
        with mgr.step(s):
            run_step(model, micro, mgr.executor.tracker, seed=s)
    ex = mgr.executor
    with pytest.raises(RuntimeError, match="abandoned"):
        with mgr.step(2):
            with ex.tracker.forward(0):
                logits = model(micro[0][:, :-1])
                extra = torch.sigmoid(logits)  # sigmoid saves its own output
            assert ex.live_entries > 0 and ex.pool.live > 0
            raise RuntimeError("step abandoned before backward")
    del logits, extra
    gc.collect()
    assert ex.live_entries == 0 and ex.pool.live == 0 and ex.resident == ex.saved == 0


def test_eviction_for_memory_skips_storages_other_tensors_still_share():
    """Copying out a storage the forward still holds frees no device memory: an eviction
    for an out-of-memory error leaves it and counts only what it really frees."""
    x = torch.randn(1024, requires_grad=True)
    ex = _executor(torch.nn.Linear(1, 1), budget=None, min_bytes=0)
    with ex.hooks():
        live = x * 2  # still held here, like an activation the next layer reads
        gone = (x * 3).sin()  # (x * 3) is held by autograd alone
        out = live.sin().sum() + gone.sum()
    by_ptr = {e.key: e for e in ex._entries.values()}
    shared = by_ptr[live.untyped_storage().data_ptr()]
    assert ex.evict(1 << 30, memory=True) == 4096  # only (x * 3)'s storage
    assert shared.state == 0 and ex.counters.evictions == 1  # RESIDENT
    assert ex.evict(1 << 30, memory=False) == 4096  # the budget counts it
    out.backward()
    assert torch.equal(x.grad, 2 * (2 * x.detach()).cos() + 3 * (3 * x.detach()).cos())
    assert ex.live_entries == 0 and ex.pool.live == 0


class _InFlightCopier(SyncCopier):
    """Copies back that stay "in flight" until waited for, like the CUDA streams'."""

    def __init__(self) -> None:
        self.waited: list[object] = []
        self.finished: list[object] = []

    def start_in(self, host, device, after):
        dst, _ = super().start_in(host, device, after)
        return dst, object()

    def done(self, token) -> bool:
        return token is None or token in self.finished

    def sync(self, token) -> None:
        self.finished.append(token)

    def wait_in(self, token) -> None:
        self.waited.append(token)


def test_a_copy_back_dropped_unused_is_waited_for_before_its_block_is_freed():
    """A prefetched storage whose step is abandoned before its unpack: the compute stream
    must pass the copy before the block can be reused (no record_stream holds it)."""
    x = torch.randn(1024, requires_grad=True)
    ex = SwapExecutor(StageTracker(), copier=_InFlightCopier(),
                      pool=HostPool(pin=False, cache_bytes=1 << 20), min_bytes=0)
    with ex.hooks():
        y = (x * 2).sin()
    entry = next(iter(ex._entries.values()))
    ex._swap_out(entry)
    ex._prefetch(entry)
    token = entry.token
    assert token is not None and ex.copier.waited == []
    del y  # the step is abandoned: the handle dies unused
    assert ex.copier.waited == [token]
    ex.end_step()  # the host buffer returns once its copy has finished
    assert ex.live_entries == 0 and ex.pool.live == 0
