"""Offload or recompute, against costs worked out by hand on a two-layer step."""

from __future__ import annotations

from types import MappingProxyType

import pytest

from chameleon_megatron.swap.profile import FREE, PACK, USE, StepProfile, TensorRecord
from chameleon_megatron.swap.recompute import choose_recompute, layer_forward_s, without_layers
from chameleon_megatron.swap.signature import StepSignature

# Layer 1 saves A1, A2 and layer 2 saves B1, B2 (100 B each), one per second; backward uses
# them in reverse. Peak: 400 B resident after B2's pack.
NAMES = ("A1", "A2", "B1", "B2")
ORDER = [("A1", PACK), ("A2", PACK), ("B1", PACK), ("B2", PACK), ("B2", USE), ("B1", USE),
         ("B2", FREE), ("B1", FREE), ("A2", USE), ("A1", USE), ("A2", FREE), ("A1", FREE)]


def step() -> StepProfile:
    events = [(NAMES.index(n), kind) for n, kind in ORDER]
    first = {}
    for e, ev in enumerate(events):
        first.setdefault(ev, e)
    records = tuple(
        TensorRecord(uid=u, stage=("F", 0, 0, 1 if n[0] == "A" else 2), ordinal=u % 2, op="X",
                     code=0, history=0, occurrence=u, nbytes=100, shape=(100,), swappable=True,
                     pack_event=first[(u, PACK)], use_event=first[(u, USE)],
                     free_event=first[(u, FREE)], device_bytes=0)
        for u, n in enumerate(NAMES))
    return StepProfile(records=records, events=tuple(events),
                       event_times=tuple(float(e + 1) for e in range(len(events))),
                       signature=StepSignature(MappingProxyType({})))


def test_each_layer_takes_the_time_of_its_forward_saves():
    assert layer_forward_s(step()) == {1: 2.0, 2: 2.0}


def test_without_a_layer_its_saves_are_gone_and_the_order_kept():
    p = without_layers(step(), {1})
    assert [r.stage[3] for r in p.records] == [2, 2]
    assert [p.records[u].uid for u, _ in p.events] == [0, 1, 1, 0, 1, 0]
    assert p.event_times == (3.0, 4.0, 5.0, 6.0, 7.0, 8.0)


def test_fast_copies_hide_behind_compute_so_nothing_is_recomputed():
    # 300 B: one tensor off the device at the peak; a copy takes 0.1 ms, hidden.
    choice = choose_recompute(step(), budget_bytes=300, bandwidth_bps=1e6, min_bytes=1)
    assert (choice.layers, choice.stall_s, choice.recompute_s) == (0, 0.0, 0.0)


def test_slow_copies_make_recomputing_the_first_layer_cheaper():
    # At 10 B/s a 100 B copy takes 10 s, far more than the forward around it: swapping
    # stalls. With layer 1 recomputed the peak is 200 B: no swap, 2 s of recompute.
    swap_only = choose_recompute(step(), budget_bytes=300, bandwidth_bps=10.0, min_bytes=1,
                                 most_layers=0)
    assert swap_only.layers == 0 and swap_only.stall_s > 2.0
    choice = choose_recompute(step(), budget_bytes=300, bandwidth_bps=10.0, min_bytes=1)
    assert (choice.layers, choice.stall_s, choice.recompute_s) == (1, 0.0, 2.0)


def test_a_budget_swapping_cannot_meet_is_met_by_recomputing():
    # nothing is big enough to swap (min_bytes): only recomputing lowers the peak
    assert choose_recompute(step(), budget_bytes=300, bandwidth_bps=1e6, min_bytes=1000,
                            most_layers=0) is None
    assert choose_recompute(step(), budget_bytes=300, bandwidth_bps=1e6,
                            min_bytes=1000).layers == 1  # 200 B
    assert choose_recompute(step(), budget_bytes=150, bandwidth_bps=1e6,
                            min_bytes=1000).layers == 2  # nothing saved at all


@pytest.mark.usefixtures("mcore")
@pytest.mark.timeout(180)
def test_a_stage_whose_swap_would_stall_recomputes_and_computes_the_same():
    """With a link too slow to hide any copy, the policy recomputes layers of this stage
    with megatron's own machinery instead; every loss and gradient bitwise as without."""
    import torch

    from chameleon_megatron.swap.config import SwapConfig
    from chameleon_megatron.swap.plugin import SwapPlugin
    from chameleon_megatron.training.plugin import TrainContext
    from mcore import McoreRun, build_gpt, transformer_config

    run = McoreRun(build_gpt(transformer_config(num_layers=2)))
    ref = [run.step(s) for s in range(5)]
    plugin = SwapPlugin(SwapConfig(enabled=True, budget_fraction=0.5, min_tensor_bytes=256,
                                   bandwidth_gbps=1e-6, granularity="layer"))
    plugin.on_model_built(TrainContext(
        model=[run.model], config=run.model.config, args=None, device=torch.device("cpu"),
        rank=0, tp_rank=0, pp_rank=0, pp_size=1, dp_rank=0, vpp_size=1))
    try:
        seen = []
        for s in range(5):
            with plugin.step_context(s, training=True):
                got = run.step(s)
            assert got[0] == ref[s][0], s
            assert all(torch.equal(a, b) for a, b in zip(got[1], ref[s][1])), s
            seen.append(plugin.metrics()["swap"]["recompute_layers"])
            if s == 0:  # the first plan's budget: half the profiled peak without recompute
                budget = plugin.manager.plan.budget_bytes
        assert seen[0] >= 1 and run.model.config.recompute_granularity == "full"
        assert run.model.config.recompute_num_layers == seen[-1] == seen[0]
        m = plugin.metrics()["swap"]  # the budget stays the one recomputing was chosen for
        assert m["budget_bytes"] == budget and m["peak_resident_saved_bytes"] <= budget
    finally:
        plugin.on_train_end()
        run.model.config.recompute_granularity = None
        run.model.config.recompute_method = run.model.config.recompute_num_layers = None
