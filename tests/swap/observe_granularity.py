"""Print what stage adjusting observes on the test workloads, at each granularity.

    .venv/bin/python tests/swap/observe_granularity.py [--steps N] [--only TEXT] [--detail]

Each workload runs with the granularity pinned to ``layer``, pinned to ``microbatch``,
then ``auto``. The pinned runs are auto runs whose rule never switches, so the manager
observes them as it would under auto (layer hooks are installed in every run).

One line per run: a timeline (per step: L or M for the granularity in use, f for a
full-profile step, h when the step is a hidden re-profile: its per-layer signature moved
since the last per-layer profile and its microbatch signature did not), then totals: full
steps, hidden re-profiles, planning and profiler time, forced swaps and blocking swap-ins,
the least matched share of planned tensors, the largest peak over budget, the mean step
time. ``--only`` keeps the workloads whose name contains TEXT; ``--detail`` adds a line
per step.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

import torch

sys.path.insert(0, str(Path(__file__).parent))
from mcore_env import mcore_process  # noqa: E402

from chameleon_megatron.swap.config import SwapConfig  # noqa: E402
from chameleon_megatron.swap.manager import SwapManager  # noqa: E402
from chameleon_megatron.swap.signature import StepSignature  # noqa: E402
from chameleon_megatron.swap.stage_adjust import AdjustRule, observe as observe_step  # noqa: E402

MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.0, add_bias_linear=False)
CAPACITY = dict(MOE, moe_expert_capacity_factor=1.0)
"""MoE that drops tokens over an expert's capacity: each layer keeps a different number."""


Step = tuple[SwapManager, dict, float, StepSignature | None]
"""The manager after a step, the step's swap metrics and wall time, and the per-layer
reference the step was compared with."""

NEVER = AdjustRule(window=1 << 30, churn=1 << 30, calm=1 << 30)


def _pin(mgr: SwapManager, granularity: str) -> None:
    """Observe as auto does; switch never, unless ``granularity`` is auto."""
    if granularity != "auto":
        mgr.rule = NEVER
        mgr.executor.tracker.granularity = granularity


@dataclasses.dataclass
class Workload:
    name: str
    run: Callable[[str, int], Iterator[Step]]
    """(granularity, steps) -> one ``Step`` per step."""


def _toy(model: Callable[[], torch.nn.Module], prepare: Callable[[torch.nn.Module, int], list]
         ) -> Callable[[str, int], Iterator[Step]]:
    from toy import make_manager, run_step

    def run(granularity: str, steps: int) -> Iterator[Step]:
        torch.manual_seed(0)
        net = model()
        cfg = SwapConfig(enabled=True, budget_fraction=0.5, min_tensor_bytes=1024)
        mgr = make_manager(net, cfg)
        _pin(mgr, granularity)
        for s in range(steps):
            micro, reference = prepare(net, s), mgr.layer_reference
            start = time.perf_counter()
            with mgr.step(s):
                run_step(net, micro, mgr.executor.tracker, seed=s)
            yield mgr, mgr.last_metrics, time.perf_counter() - start, reference
    return run


def _mcore(config: dict, kwargs: Callable[[int], dict]) -> Callable[[str, int], Iterator[Step]]:
    def run(granularity: str, steps: int) -> Iterator[Step]:
        from mcore import McoreRun, build_gpt, transformer_config

        from chameleon_megatron.swap.plugin import SwapPlugin
        from chameleon_megatron.training.plugin import TrainContext

        model = build_gpt(transformer_config(num_layers=4, **config),
                          experts=config.get("num_moe_experts"))
        mrun = McoreRun(model)
        plugin = SwapPlugin(SwapConfig(enabled=True, budget_fraction=0.5, min_tensor_bytes=256,
                                       plan_time_limit_s=0.5))
        plugin.on_model_built(TrainContext(
            model=[model], config=model.config, args=None, device=torch.device("cpu"), rank=0,
            tp_rank=0, pp_rank=0, pp_size=1, dp_rank=0, vpp_size=1))
        mgr = plugin.manager
        _pin(mgr, granularity)
        try:
            for s in range(steps):
                start, reference = time.perf_counter(), mgr.layer_reference
                with plugin.step_context(s, training=True):
                    mrun.step(s, **kwargs(s))
                yield mgr, plugin.metrics()["swap"], time.perf_counter() - start, reference
        finally:
            plugin.on_train_end()
    return run


def workloads() -> list[Workload]:
    from toy import SplitGPT, ToyGPT, batches

    fixed, long_ = batches(0, 2, 2, 32), batches(1, 2, 2, 48)

    def toy() -> ToyGPT:
        return ToyGPT(hidden=64, layers=4)

    def split(net: SplitGPT, step: int) -> list:
        net.shares = (0.25, 0.75) if step % 2 == 0 else (0.75, 0.25)
        return fixed

    return [
        Workload("toy plain", _toy(toy, lambda net, s: fixed)),
        Workload("toy seq 32 -> 48 at step 4",
                 _toy(toy, lambda net, s: fixed if s < 4 else long_)),
        Workload("toy seq 24/32/40 cycling",
                 _toy(toy, lambda net, s: batches(s, 2, 2, 24 + 8 * (s % 3)))),
        Workload("toy layers share tokens, shares alternate",
                 _toy(lambda: SplitGPT(hidden=32), split)),
        Workload("mcore plain", _mcore({}, lambda s: {})),
        Workload("mcore seq 16 -> 32 at step 4", _mcore({}, lambda s: {"seq": 16 if s < 4 else 32})),
        Workload("mcore MoE dropless", _mcore(MOE, lambda s: {})),
        Workload("mcore MoE capacity 1.0", _mcore(CAPACITY, lambda s: {})),
    ]


def observe(workload: Workload, granularity: str, steps: int, detail: bool) -> list[str]:
    lines, timeline = [], []
    hidden = full = forced = blocking = 0
    plan_s = profiler_s = wall = 0.0
    matched, over = 1.0, 0.0
    for s, (mgr, m, step_s, reference) in enumerate(workload.run(granularity, steps)):
        layers = mgr.executor.tracker.layer_signature()
        seen = observe_step(reference, layers, mgr.config.size_tolerance)  # as the manager did
        timeline.append(m["granularity"][0].upper() + ("f" if m["mode"] == "full" else "")
                        + ("h" if seen.hidden else ""))
        hidden += seen.hidden
        full += m["mode"] == "full"
        forced += m["forced_swaps"]
        blocking += m["blocking_swapins"]
        plan_s += m["plan_s"]
        profiler_s += m["profiler_s"]
        wall += step_s
        if m["planned_tensors"]:
            matched = min(matched, m["matched"] / m["planned_tensors"])
        if m["budget_bytes"]:
            over = max(over, m["peak_resident_saved_bytes"] / m["budget_bytes"] - 1)
        if detail:
            lines.append(
                f"    {s:2d} v{m['plan_version']} layer {seen.layer_changed:2d}/"
                f"{len(layers.stages):<2d} mb {seen.microbatch_changed}/"
                f"{len({k[:3] for k in layers.stages})}  match {m['matched']}/"
                f"{m['planned_tensors']} unmatched {m['unmatched']}  peak "
                f"{m['peak_resident_saved_bytes']} budget {m['budget_bytes']}  block "
                f"{m['blocking_swapins']} forced {m['forced_swaps']}  step {1e3 * step_s:.0f} ms")
    lines.insert(0, f"  {granularity:10s} {' '.join(timeline)}")
    lines.insert(1, f"  {'':10s} full {full}, hidden {hidden}, plan {plan_s:.2f} s, profiler "
                    f"{1e3 * profiler_s / steps:.2f} ms/step, forced {forced}, blocking "
                    f"{blocking}, matched >= {100 * matched:.1f} %, over budget <= "
                    f"{100 * over:.2f} %, step {1e3 * wall / steps:.0f} ms")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--only", default="")
    parser.add_argument("--detail", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with mcore_process():
        for w in workloads():
            if args.only not in w.name:
                continue
            print(w.name)
            for granularity in ("layer", "microbatch", "auto"):
                print("\n".join(observe(w, granularity, args.steps, args.detail)), flush=True)


if __name__ == "__main__":
    main()
