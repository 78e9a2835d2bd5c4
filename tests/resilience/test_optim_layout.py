"""Optimizer state by its layout (``optim_layout``), on torch's optimizers and the CPU
stand-ins of Transformer Engine's and apex's fused ones (``fused_standins``): the state read
from a stepped optimizer and written into a fresh one continues the same trajectory,
including megatron's ``--use-precision-aware-optimizer`` layouts (master weights, bf16 and
scaled fp16 moments, int16 remainders)."""

from __future__ import annotations

from typing import Callable

import pytest
import torch

from chameleon_megatron.resilience.optim_layout import (
    Slot, join_fp32, layout_of, set_steps, split_fp32,
)
from fused_standins import ApexFusedAdam, FusedSGD, TEFusedAdam
from fused_standins import join_fp32 as standin_join
from fused_standins import split_fp32 as standin_split

BF16, FP16 = torch.bfloat16, torch.float16
PRECISION_AWARE = {"master_weights": True, "use_decoupled_grad": True}

CASES: dict[str, tuple[Callable, torch.dtype, tuple[str, ...]]] = {
    "torch-adamw": (lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1), torch.float32,
                    ("exp_avg", "exp_avg_sq", "step")),
    "torch-sgd": (lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9), torch.float32,
                  ("momentum_buffer",)),
    "te-adam": (lambda p: TEFusedAdam(p, lr=1e-2, weight_decay=0.1), torch.float32,
                ("exp_avg", "exp_avg_sq", "step")),
    "apex-adam-l2": (lambda p: ApexFusedAdam(p, lr=1e-2, weight_decay=0.1, adam_w_mode=False),
                     torch.float32, ("exp_avg", "exp_avg_sq", "step")),
    "fused-sgd": (lambda p: FusedSGD(p, lr=1e-2, momentum=0.9, weight_decay=0.1),
                  torch.float32, ("momentum_buffer",)),
    "te-master-bf16-moments": (
        lambda p: TEFusedAdam(p, lr=1e-2, exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16,
                              **PRECISION_AWARE), BF16,
        ("exp_avg", "exp_avg_sq", "master_param", "step")),
    "te-remainders": (
        lambda p: TEFusedAdam(p, lr=1e-2, exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16,
                              store_param_remainders=True, **PRECISION_AWARE), BF16,
        ("exp_avg", "exp_avg_sq", "master_param", "step")),
    "te-fp16-moments": (
        lambda p: TEFusedAdam(p, lr=1e-2, exp_avg_dtype=FP16, exp_avg_sq_dtype=FP16,
                              **PRECISION_AWARE), BF16,
        ("exp_avg", "exp_avg_sq", "master_param", "step")),
}
EXACT = set(CASES) - {"te-fp16-moments"}
"""fp16 moments are rescaled from their absolute maximum when written: equal to within fp16
rounding, not bit for bit."""


def _params(dtype: torch.dtype) -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(6, 5).to(dtype)),
            torch.nn.Parameter(torch.randn(7).to(dtype))]


def _step(opt: torch.optim.Optimizer, params: list, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        grad = torch.randn(p.shape, generator=gen)
        if getattr(opt, "use_decoupled_grad", False):
            p.decoupled_grad = grad
        else:
            p.grad = grad.to(p.dtype)
    opt.step()


def _slots(opt: torch.optim.Optimizer) -> list[Slot]:
    layout = layout_of(opt)
    return [Slot(opt, p, g, layout) for g in opt.param_groups for p in g["params"]]


def _migrate(src: torch.optim.Optimizer, dst: torch.optim.Optimizer) -> None:
    """Parameters and every slot's state, as the restorer moves them (through fp32 copies,
    as the shard copies hold them)."""
    steps = []
    for s, d in zip(_slots(src), _slots(dst)):
        with torch.no_grad():
            d.main.copy_(s.main)
        values = {k: v.detach().float().clone() for k, v in s.read().items()}
        d.write(values)
        steps.append((d, values["step"])) if "step" in values else None
    set_steps(steps)


@pytest.mark.parametrize("case", list(CASES))
def test_moved_state_continues_the_same_trajectory(case: str) -> None:
    build, dtype, keys = CASES[case]
    a, b = _params(dtype), _params(dtype)
    with torch.no_grad():
        for p in b:
            p.mul_(3)  # another start: only the moved state can make it equal
    opt_a, opt_b = build(a), build(b)
    for seed in range(3):
        _step(opt_a, a, seed)
    assert sorted(_slots(opt_a)[0].read()) == sorted(keys)
    _migrate(opt_a, opt_b)
    for seed in range(3, 6):
        _step(opt_a, a, seed)
        _step(opt_b, b, seed)
    for sa, sb in zip(_slots(opt_a), _slots(opt_b)):
        ra, rb = sa.read(), sb.read()
        for key in keys:
            if case in EXACT:
                assert torch.equal(ra[key], rb[key]), key
            else:
                torch.testing.assert_close(rb[key], ra[key], rtol=2e-3, atol=1e-6)
        if "step" in keys:
            assert float(ra["step"]) == 6
    for pa, pb in zip(a, b):
        assert torch.equal(pa, pb) if case in EXACT else torch.allclose(pa.float(), pb.float(),
                                                                         rtol=1e-2)


def test_a_fused_adams_step_lives_in_its_param_group() -> None:
    params = _params(torch.float32)
    opt = TEFusedAdam(params, lr=1e-2)
    _step(opt, params, 0)
    _step(opt, params, 1)
    assert opt.param_groups[0]["step"] == 2 and all("step" not in s for s in opt.state.values())
    (slot, *_) = _slots(opt)
    assert layout_of(opt).step_in_group and slot.staged()["step"]
    assert float(slot.read()["step"]) == 2
    fresh = TEFusedAdam(_params(torch.float32), lr=1e-2)
    set_steps([(s, torch.tensor(5.0)) for s in _slots(fresh)])
    assert fresh.param_groups[0]["step"] == 5


def test_parameters_of_one_group_that_disagree_on_the_step_are_refused() -> None:
    opt = TEFusedAdam(_params(torch.float32), lr=1e-2)
    one, two = _slots(opt)
    with pytest.raises(ValueError, match=r"different step counts \[3, 4\]"):
        set_steps([(one, torch.tensor(3.0)), (two, torch.tensor(4.0))])


def test_remainders_rebuild_the_fp32_master_weights_exactly() -> None:
    values = torch.randn(10000) * torch.logspace(-20, 20, 10000)
    high, low = split_fp32(values)
    assert torch.equal(join_fp32(high, low), values)
    s_high, s_low = standin_split(values)
    assert torch.equal(high.view(torch.int16), s_high.view(torch.int16))
    assert torch.equal(low, s_low) and torch.equal(standin_join(high, low), values)
    assert (high.float() - values).abs().le((values.to(BF16).float() - values).abs()).all()


class _Offloading(torch.optim.AdamW):
    """The shape of megatron's HybridDeviceOptimizer: sub-optimizers on two devices."""

    sub_optimizers: list = []


@pytest.mark.parametrize("opt,message", [
    (_Offloading([torch.nn.Parameter(torch.zeros(2))]), r"--optimizer-cpu-offload"),
    (torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))], amsgrad=True), r"amsgrad"),
    (torch.optim.Adagrad([torch.nn.Parameter(torch.zeros(2))]), r"not Adagrad"),
])
def test_layouts_the_restorer_cannot_move_are_refused_in_one_line(opt, message) -> None:
    with pytest.raises(ValueError, match=message) as info:
        layout_of(opt)
    assert "\n" not in str(info.value)


def test_megatrons_offloading_optimizer_has_the_refused_shape() -> None:
    """(It needs CUDA to be built: its class, then, has the attribute ``refuse_offloaded``
    looks for.)"""
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

    assert isinstance(getattr(HybridDeviceOptimizer, "sub_optimizers", None), property)


def test_remainders_show_the_master_weights_a_whole_copy_holds() -> None:
    """Stored whole or as remainders, the fp32 master weights follow the same trajectory
    (the update reads them, not the bf16 parameters): ``read`` shows the same values."""
    shown = []
    for case in ("te-master-bf16-moments", "te-remainders"):
        build, dtype, _ = CASES[case]
        params = _params(dtype)
        opt = build(params)
        for seed in range(3):
            _step(opt, params, seed)
        assert opt.state[params[0]]["master_param"].dtype == (
            torch.int16 if case == "te-remainders" else torch.float32)
        shown.append([s.read()["master_param"] for s in _slots(opt)])
    for whole, rebuilt in zip(*shown):
        assert torch.equal(whole, rebuilt)
