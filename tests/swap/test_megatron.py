"""Swap inside megatron-core in one process: seams, bitwise results, dynamic workloads."""

from __future__ import annotations

import contextlib
from collections import Counter

import pytest
import torch

from chameleon_megatron.swap.config import SwapConfig

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("mcore")]

RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.0, add_bias_linear=False)


def _run(**config):
    from mcore import McoreRun, build_gpt, transformer_config

    return McoreRun(build_gpt(transformer_config(**config),
                              experts=config.get("num_moe_experts")))


@contextlib.contextmanager
def _plugin(run, cfg: SwapConfig):
    from chameleon_megatron.swap.plugin import SwapPlugin
    from chameleon_megatron.training.plugin import TrainContext

    plugin = SwapPlugin(cfg)
    plugin.on_model_built(TrainContext(
        model=[run.model], config=run.model.config, args=None, device=torch.device("cpu"),
        rank=0, tp_rank=0, pp_rank=0, pp_size=1, dp_rank=0, vpp_size=1))
    try:
        yield plugin
    finally:
        plugin.on_train_end()


def _same(a, b) -> bool:
    return a[0] == b[0] and len(a[1]) == len(b[1]) and all(
        torch.equal(x, y) for x, y in zip(a[1], b[1]))


def _compare(run, cfg, schedule, *, evaluate=False):
    """Steps with kwargs ``schedule[i]`` without swap, then with (no optimizer: the weights
    stay put); returns the per-step swap metrics."""
    ref = [run.step(s, **kw) for s, kw in enumerate(schedule)]
    metrics = []
    with _plugin(run, cfg) as plugin:
        for s, kw in enumerate(schedule):
            with plugin.step_context(s, training=True):
                out = run.step(s, **kw)
            assert _same(out, ref[s]), f"step {s}: results differ from the run without swap"
            metrics.append(plugin.metrics()["swap"])
            if evaluate:
                with plugin.step_context(s, training=False), torch.no_grad():
                    run.model.eval()
                    run.step(50 + s, forward_only=True, **kw)
                    run.model.train()
    return metrics


def _check_plan_holds(metrics):
    for m in metrics:
        assert m["live_entries"] == 0 and m["host_buffers_live"] == 0
        if m["plan_version"]:
            assert m["peak_resident_saved_bytes"] <= m["budget_bytes"]
            assert m["matched"] >= 0.99 * m["planned_tensors"] > 0
            assert m["swapped_out_bytes"] > 0


def _check_adapts(metrics, change_step):
    assert [m["sequence_changed"] for m in metrics] == [
        s == change_step for s in range(len(metrics))]
    old = metrics[change_step]["plan_version"]
    new_at = next(s for s in range(change_step, len(metrics)) if metrics[s]["plan_version"] > old)
    assert new_at - change_step <= 3


HALF = SwapConfig(enabled=True, budget_fraction=0.5, min_tensor_bytes=256)


def test_seams_install_idempotently_and_remove_cleanly():
    from megatron.core.pipeline_parallel import schedules

    from chameleon_megatron.megatron.swap_seams import SwapSeams
    from chameleon_megatron.swap.stage import StageTracker

    run = _run()
    originals = (schedules.forward_step, schedules.backward_step)
    seams = SwapSeams(StageTracker(), [run.model])
    seams.install()
    wrapped = (schedules.forward_step, schedules.backward_step)
    seams.install()
    assert (schedules.forward_step, schedules.backward_step) == wrapped != originals
    with pytest.raises(RuntimeError, match="already wrapped"):
        SwapSeams(StageTracker(), [run.model]).install()
    run.step(0, num_microbatches=3)
    keys = seams.tracker.stats
    assert {key[3] for key in keys} == {-1, 1, 2}
    # Every backward was attributed to its microbatch through the forward's output.
    assert {(key[0], key[1]) for key in keys} == {(p, m) for p in "FB" for m in range(3)}
    seams.remove()
    assert (schedules.forward_step, schedules.backward_step) == originals
    assert all(not m._forward_pre_hooks for m in run.model.modules())


def test_half_budget_bitwise():
    metrics = _compare(_run(), HALF, [{"num_microbatches": 3}] * 4)
    _check_plan_holds(metrics)
    assert metrics[-1]["peak_saved_bytes"] >= 2 * metrics[-1]["budget_bytes"]


def test_full_recompute_bitwise():
    cfg = SwapConfig(enabled=True, budget_fraction=0.97, min_tensor_bytes=256)
    metrics = _compare(_run(**RECOMPUTE), cfg, [{}] * 4)
    _check_plan_holds(metrics)


def test_sequence_length_change():
    metrics = _compare(_run(), HALF, [{"seq": 16}] * 3 + [{"seq": 32}] * 4)
    _check_adapts(metrics, 3)
    _check_plan_holds(metrics)


def test_microbatch_count_change():
    metrics = _compare(_run(), HALF, [{"num_microbatches": 2}] * 3 + [{"num_microbatches": 4}] * 4)
    _check_adapts(metrics, 3)
    _check_plan_holds(metrics)


def test_evaluation_interleaved():
    metrics = _compare(_run(), HALF, [{}] * 4, evaluate=True)
    assert not any(m["sequence_changed"] for m in metrics)
    assert [m["mode"] for m in metrics] == ["full", "light", "light", "light"]
    _check_plan_holds(metrics)


def _saved_shapes(run, step: int) -> Counter:
    shapes: Counter = Counter()

    def pack(t):
        shapes[tuple(t.shape)] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run.step(step)
    return shapes


def test_moe_routing_changes_sizes_yet_the_plan_holds():
    run = _run(**MOE)
    assert _saved_shapes(run, 0) != _saved_shapes(run, 1)  # routing moved tokens
    metrics = _compare(run, HALF, [{}] * 5)
    assert not any(m["sequence_changed"] for m in metrics)
    _check_plan_holds(metrics)


def test_moe_sequence_length_change():
    metrics = _compare(_run(**MOE), HALF, [{"seq": 16}] * 2 + [{"seq": 32}] * 4)
    _check_adapts(metrics, 2)
    _check_plan_holds(metrics)


def test_a_step_that_runs_out_of_memory_is_redone_bitwise():
    run = _run()
    ref = [run.step(s) for s in range(4)]
    with _plugin(run, HALF) as plugin:
        for s in range(2):
            with plugin.step_context(s, training=True):
                run.step(s)
        with pytest.raises(torch.OutOfMemoryError) as failed:
            with plugin.step_context(2, training=True):
                run.step(2, num_microbatches=1)  # a partial step, then the device is full
                raise torch.OutOfMemoryError("injected")
        # redone by every rank together; in a world of one, here alone
        assert plugin.on_step_failed(failed.value, None) == "abandon"
        assert plugin.on_step_failed(RuntimeError("other"), None) is None
        for s in (2, 3):  # the redo, then the next step
            with plugin.step_context(s, training=True):
                assert _same(run.step(s), ref[s])
            m = plugin.metrics()["swap"]
            assert m["peak_resident_saved_bytes"] <= m["budget_bytes"]
            assert m["live_entries"] == 0 and m["host_buffers_live"] == 0
