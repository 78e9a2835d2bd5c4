"""Swap configuration: flags, YAML, validation, and how a rank's budget is resolved."""

from __future__ import annotations

import argparse
import dataclasses
import re

import pytest
import torch

from chameleon_megatron.config import add_chameleon_args, build_config
from chameleon_megatron.configurable import ConfigError
from chameleon_megatron.swap.budget import BudgetSpec, resolve_budget
from chameleon_megatron.swap.config import SwapConfig
from chameleon_megatron.swap.plugin import budget_spec
from chameleon_megatron.swap.profile import FREE, PACK, USE, DeviceMemory

from profiles import make_profile

pytestmark = pytest.mark.timeout(30)


def test_flags_and_yaml_reach_the_swap_config():
    parser = add_chameleon_args(argparse.ArgumentParser())
    ns = parser.parse_args(["--chameleon-swap", "--chameleon-swap-budget-bytes-per-stage", "300",
                            "--chameleon-swap-budget-bytes-per-stage", "200",
                            "--chameleon-swap-granularity", "microbatch"])
    cfg = build_config({"swap": {"min_tensor_bytes": "4096", "size_tolerance": 0.1}}, ns).swap
    assert cfg.enabled and cfg.budget_bytes_per_stage == (300, 200)
    assert cfg.granularity == "microbatch" and cfg.min_tensor_bytes == 4096
    assert cfg.size_tolerance == 0.1
    assert SwapConfig().granularity == "auto"
    with pytest.raises(ConfigError, match=r"swap\.granularity='token'.*must be one of "
                                          r"\['auto', 'layer', 'microbatch'\]"):
        build_config({"swap": {"granularity": "token"}}, parser.parse_args([]))


@pytest.mark.parametrize("field,value,limit", [
    ("budget_bytes", 0, "must be > 0"),
    ("budget_bytes_per_stage", (5, 0), "every budget must be > 0"),
    ("budget_fraction", 1.5, "must be in (0, 1]"),
    ("budget_device_fraction", 0.0, "must be in (0, 1]"),
    ("size_tolerance", 1.0, "must be in [0, 1)"),
    ("oom_backoff", 1.0, "must be in (0, 1)"),
    ("plan_time_limit_s", 0.0, "must be > 0"),
])
def test_bad_values_name_the_key_and_the_limit(field, value, limit):
    with pytest.raises(ConfigError, match=rf"swap\.{field}=.*{re.escape(limit)}"):
        SwapConfig(**{field: value})


def test_a_rank_gets_its_pipeline_stage_budget():
    cfg = SwapConfig(budget_bytes=7, budget_bytes_per_stage=(300, 200))
    cpu = torch.device("cpu")
    assert budget_spec(cfg, pp_rank=1, pp_size=2, device=cpu) == BudgetSpec(absolute_bytes=200)
    with pytest.raises(ConfigError, match=r"needs one budget per pipeline stage \(4\)"):
        budget_spec(cfg, pp_rank=0, pp_size=4, device=cpu)
    assert budget_spec(SwapConfig(budget_bytes=7), pp_rank=0, pp_size=1,
                       device=cpu).absolute_bytes == 7
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        budget_spec(SwapConfig(budget_device_fraction=0.5), pp_rank=0, pp_size=1, device=cpu)


def test_after_a_re_plan_to_another_depth_the_tightest_stage_budget_holds():
    cfg = SwapConfig(budget_bytes_per_stage=(300, 200))
    cpu = torch.device("cpu")
    rebuilt = {"device": cpu, "launch_pp_size": 2}
    assert budget_spec(cfg, pp_rank=0, pp_size=1, **rebuilt) == BudgetSpec(absolute_bytes=200)
    assert budget_spec(cfg, pp_rank=2, pp_size=3, **rebuilt) == BudgetSpec(absolute_bytes=200)
    # the same depth as at launch: each stage its own budget, as before the failure
    assert budget_spec(cfg, pp_rank=0, pp_size=2, **rebuilt) == BudgetSpec(absolute_bytes=300)


def test_budget_resolution():
    # A: 100 B packed at 0 (device in use 1000 then), B: 60 B packed at 1 (device 1200).
    p = make_profile([(100, True), (60, True)],
                     [(0, PACK), (1, PACK), (1, USE), (1, FREE), (0, USE), (0, FREE)])
    a, b = p.records
    p = dataclasses.replace(p, records=(dataclasses.replace(a, device_bytes=1000),
                                        dataclasses.replace(b, device_bytes=1200)))
    assert resolve_budget(BudgetSpec(fraction=0.5), p) == 80  # peak 160
    assert resolve_budget(BudgetSpec(absolute_bytes=90), p, oom_factor=0.5) == 45
    # Besides activations, training holds max(1000 - 100, 1200 - 160) = 1040 bytes.
    spec = BudgetSpec(device_fraction=0.5, device_total_bytes=2400)
    assert resolve_budget(spec, p) == 1200 - 1040
    with pytest.raises(ValueError, match="leave nothing for activations"):
        resolve_budget(BudgetSpec(device_fraction=0.4, device_total_bytes=2400), p)


def test_the_device_fraction_counts_backward_the_allocator_and_memory_outside_torch():
    """Forward's packs alone miss what backward adds (gradients, transients), the caching
    allocator's slack and what NCCL/cuBLAS/the context hold: all come off the budget."""
    p = make_profile([(100, True), (60, True)],
                     [(0, PACK), (1, PACK), (1, USE), (1, FREE), (0, USE), (0, FREE)])
    a, b = p.records
    # At B's first use (event 2) 160 B are resident and the device holds 1500: 1340 other.
    p = dataclasses.replace(p, records=(
        dataclasses.replace(a, device_bytes=1000, use_device_bytes=1100),
        dataclasses.replace(b, device_bytes=1200, use_device_bytes=1500)))
    spec = BudgetSpec(device_fraction=0.75, device_total_bytes=2400)
    assert resolve_budget(spec, p) == 1800 - 1340
    device = DeviceMemory(peak_allocated=1500, peak_reserved=1600, outside_torch=50)
    p = dataclasses.replace(p, device=device)
    assert resolve_budget(spec, p) == 1800 - 1340 - 100 - 50
