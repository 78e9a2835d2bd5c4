"""Manager life cycle on plain torch: detection, re-planning, dynamic workloads, errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from chameleon_megatron.swap.budget import BudgetSpec
from chameleon_megatron.swap.config import SwapConfig
from chameleon_megatron.swap.copier import SyncCopier
from chameleon_megatron.swap.policy import BudgetError

from toy import ToyGPT, batches, make_manager, run_step

pytestmark = pytest.mark.timeout(90)


def _same(a, b) -> bool:
    return a[0] == b[0] and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))


def _drive(model, schedule, cfg, *, ref_model_state=None):
    """Run ``schedule`` (per step: list of microbatches) with and without swap."""
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ref = [run_step(model, micro, None, seed=s) for s, micro in enumerate(schedule)]
    model.load_state_dict(state)
    mgr = make_manager(model, cfg)
    metrics = []
    for s, micro in enumerate(schedule):
        with mgr.step(s):
            out = run_step(model, micro, mgr.executor.tracker, seed=s)
        assert _same(out, ref[s]), f"step {s}: results differ from the run without swap"
        metrics.append(dict(mgr.last_metrics))
    return mgr, metrics


def _check_adapts(metrics, change_step):
    """Detected in the step, a new plan within 3 steps, >= 99 % matched from then on."""
    assert [m["sequence_changed"] for m in metrics] == [
        s == change_step for s in range(len(metrics))]
    old = metrics[change_step]["plan_version"]
    new_at = next(s for s in range(change_step, len(metrics)) if metrics[s]["plan_version"] > old)
    assert new_at - change_step <= 3
    for m in metrics[new_at:]:
        assert m["matched"] >= 0.99 * m["planned_tensors"] > 0
        assert m["peak_resident_saved_bytes"] <= m["budget_bytes"]
        assert m["live_entries"] == 0 and m["host_buffers_live"] == 0


CFG = SwapConfig(enabled=True, budget_fraction=0.5, min_tensor_bytes=1024)


def test_sequence_length_change():
    torch.manual_seed(0)
    model = ToyGPT(hidden=32, layers=2)
    short, long = batches(0, 2, 2, 16), batches(1, 2, 2, 32)
    _, metrics = _drive(model, [short] * 3 + [long] * 4, CFG)
    _check_adapts(metrics, change_step=3)


def test_microbatch_count_change():
    torch.manual_seed(0)
    model = ToyGPT(hidden=32, layers=2)
    _, metrics = _drive(model, [batches(0, 2, 2, 16)] * 3 + [batches(0, 4, 2, 16)] * 4, CFG)
    _check_adapts(metrics, change_step=3)


class Swapped(nn.Module):
    """Two element-wise operators whose order flips: same count, same bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(32, 32)
        self.flip = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        h = h.sin().cos() if not self.flip else h.cos().sin()
        return (h * h).sum()


def test_equal_length_change_is_detected_in_its_step():
    torch.manual_seed(0)
    model = Swapped()
    x = torch.randn(64, 32)
    mgr = make_manager(model, SwapConfig(enabled=True, budget_fraction=0.5, min_tensor_bytes=0),
                       layers=False)
    seen = []
    for s in range(6):
        model.flip = s >= 2
        with mgr.step(s):
            with mgr.executor.tracker.forward(0):
                loss = model(x)
            with mgr.executor.tracker.backward(0):
                loss.backward()
        seen.append((mgr.last_metrics["sequence_changed"], mgr.last_metrics["mode"],
                     mgr.last_metrics["plan_version"]))
    assert seen == [(False, "full", 0), (False, "light", 1), (True, "light", 1),
                    (False, "full", 1), (False, "light", 2), (False, "light", 2)]


def test_evaluation_between_steps_changes_nothing():
    torch.manual_seed(0)
    model = ToyGPT(hidden=32, layers=2)
    micro = batches(0, 2, 2, 16)
    ref = [run_step(model, micro, None, seed=s) for s in range(4)]
    mgr = make_manager(model, CFG)
    for s in range(4):
        with mgr.step(s):
            out = run_step(model, micro, mgr.executor.tracker, seed=s)
        assert _same(out, ref[s])
        model.eval()
        with torch.no_grad(), mgr.executor.tracker.forward(0):  # evaluation: no step context
            model(micro[0][:, :-1])
        model.train()
        assert not mgr.last_metrics["sequence_changed"]
        assert mgr.last_metrics["mode"] == ("full" if s == 0 else "light")


def test_an_impossible_budget_is_an_error_only_when_strict():
    torch.manual_seed(0)
    model = ToyGPT(hidden=32, layers=2)
    strict = make_manager(model, SwapConfig(enabled=True, budget_bytes=1000,
                                            min_tensor_bytes=1 << 20, strict=True))
    with pytest.raises(BudgetError, match="budget 1000 bytes is below the least achievable"):
        with strict.step(0):
            run_step(model, batches(0, 1, 2, 16), strict.executor.tracker, seed=0)


def test_an_impossible_budget_swaps_what_it_can_and_warns_once(caplog):
    torch.manual_seed(0)
    model = ToyGPT(hidden=32, layers=2)
    micro = batches(0, 2, 2, 16)
    ref = [run_step(model, micro, None, seed=s) for s in range(3)]
    mgr = make_manager(model, SwapConfig(enabled=True, budget_bytes=1000,
                                         min_tensor_bytes=4096))
    with caplog.at_level("WARNING", logger="chameleon_megatron.swap.manager"):
        for s in range(3):
            with mgr.step(s):
                out = run_step(model, micro, mgr.executor.tracker, seed=s)
            assert out[0] == ref[s][0] and all(torch.equal(a, b) for a, b in zip(out[1], ref[s][1]))
    warned = [r for r in caplog.records if "below the least achievable" in r.getMessage()]
    assert len(warned) == 1 and "--chameleon-swap-strict" in warned[0].getMessage()
    m = mgr.last_metrics
    assert m["budget_bytes"] == mgr.plan.min_budget_bytes > 1000  # the least achievable
    assert 0 < m["swapped_out_bytes"] and m["peak_resident_saved_bytes"] <= m["budget_bytes"]


def test_without_a_size_threshold_it_comes_from_the_bandwidth_and_the_sizes_present():
    """The default: tensors whose copy outweighs its fixed cost at the bandwidth (1 MB at
    50 GB/s: none in this small model), lowered to the sizes present so that the budget of
    half the peak is met, never lower than needed."""
    from chameleon_megatron.swap.policy import min_feasible_budget

    torch.manual_seed(0)
    model = ToyGPT(hidden=32, layers=2)
    micro = batches(0, 2, 2, 16)
    mgr = make_manager(model, SwapConfig(enabled=True, budget_fraction=0.5),
                       bandwidth_bps=50e9)
    assert mgr.executor.min_bytes == 1_000_000  # until the first plan
    for s in range(3):
        with mgr.step(s):
            run_step(model, micro, mgr.executor.tracker, seed=s)
    m, plan = mgr.last_metrics, mgr.plan
    chosen = m["min_tensor_bytes"]
    assert 0 < chosen < 1_000_000 and m["budget_bytes"] == plan.budget_bytes
    assert m["peak_resident_saved_bytes"] <= m["budget_bytes"] and m["swapped_out_bytes"] > 0
    profile = mgr.profile
    assert min_feasible_budget(profile, chosen) <= plan.budget_bytes
    bigger = min(r.nbytes for r in profile.records if r.swappable and r.nbytes > chosen)
    assert min_feasible_budget(profile, bigger) > plan.budget_bytes  # the largest that works


def test_out_of_memory_lowers_the_next_budget_and_reprofiles():
    torch.manual_seed(0)
    model = ToyGPT(hidden=32, layers=2)
    micro = batches(0, 2, 2, 16)
    mgr = make_manager(model, SwapConfig(enabled=True, budget_fraction=0.6, min_tensor_bytes=1024))
    for s in range(2):
        with mgr.step(s):
            run_step(model, micro, mgr.executor.tracker, seed=s)
    before = mgr.plan.budget_bytes
    with pytest.raises(torch.OutOfMemoryError):
        with mgr.step(2):
            with mgr.executor.tracker.forward(0):
                logits = model(micro[0][:, :-1])
                raise torch.OutOfMemoryError("injected")
    assert mgr.oom_retry  # the budget went down, so redoing the step can succeed
    assert mgr.executor.counters.evictions == 0  # nothing copied for a graph thrown away
    del logits  # the abandoned graph, and with it every saved tensor
    assert mgr.executor.live_entries == 0 and mgr.executor.pool.live == 0
    with mgr.step(3):
        run_step(model, micro, mgr.executor.tracker, seed=3)
    assert not mgr.oom_retry  # about the last OOM's step only
    m = mgr.last_metrics
    assert m["mode"] == "full" and m["budget_bytes"] == int(before * 0.8)
    assert m["peak_resident_saved_bytes"] <= m["budget_bytes"]
    assert mgr.plan.budget_bytes == int(before * 0.8) and mgr.plan_version == 2
    assert mgr.totals.ooms == 1


def test_out_of_memory_before_any_budget_is_not_retried():
    torch.manual_seed(0)
    model = ToyGPT(hidden=32, layers=2)
    mgr = make_manager(model, CFG)  # a fractional budget: unknown until profiled
    with pytest.raises(torch.OutOfMemoryError):
        with mgr.step(0):
            raise torch.OutOfMemoryError("injected")
    assert not mgr.oom_retry and mgr.reprofile == "oom"


class _DeviceWithState(SyncCopier):
    """Device memory in use: 60 kB of parameters and the like, plus resident activations."""

    executor = None

    def memory_in_use(self) -> int:
        return 60_000 + self.executor.resident


def test_a_device_fraction_bounds_the_profiling_step_too():
    torch.manual_seed(0)
    model = ToyGPT(hidden=32, layers=2)
    micro = batches(0, 2, 2, 16)
    spec = BudgetSpec(device_fraction=0.5, device_total_bytes=400_000)
    copier = _DeviceWithState()
    mgr = make_manager(model, SwapConfig(enabled=True, min_tensor_bytes=1024), copier=copier,
                       spec=spec)
    copier.executor = mgr.executor
    for s in range(3):
        with mgr.step(s):
            run_step(model, micro, mgr.executor.tracker, seed=s)
        m = mgr.last_metrics
        # Half the device, less what is held besides activations: from the memory in use
        # at the start of the first step, then from the profile.
        assert m["budget_bytes"] == 200_000 - 60_000
        assert 0 < m["peak_resident_saved_bytes"] <= m["budget_bytes"] < m["peak_saved_bytes"]
