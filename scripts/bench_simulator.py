"""Simulated recovery at the paper's scale and beyond.

    .venv/bin/python scripts/bench_simulator.py [--seeds 3] [--skip-large]

1. 32 devices, every possible single failure: step time after recovery of each candidate
   and of Chameleon's choice, against failure-free.
2. 32 devices, average throughput over MTBF settings and regroup costs, every strategy on
   the same traces; ratios of Chameleon to the Oobleck-like (always re-plan) and
   Recycle-like (always reroute) baselines.
3. The 1,024- and 8,192-device presets, one trace each, with wall time.
4. Memory-tight: GPT 7B on 32 devices whose memory the failure-free layout just fits (2 %
   to spare): micro batch 2 on PP8 x DP4 (33 GiB: 40 GB-class devices) and micro batch 4 on
   PP4 x DP8 (63 GiB); Chameleon with swap-aware re-plans (``chameleon_swap``) against
   Chameleon without, on the same traces.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path

from chameleon_megatron.resilience.decision.candidates import make_candidates
from chameleon_megatron.resilience.decision.layout import UniformLayout
from chameleon_megatron.resilience.decision.mtbf import MtbfEstimator
from chameleon_megatron.resilience.decision.perf_model import plan_step
from chameleon_megatron.resilience.decision.planner import Planner
from chameleon_megatron.resilience.decision.profile import LayerCost, Profile, load_profile
from chameleon_megatron.resilience.decision.selector import select
from chameleon_megatron.sim.config import load_preset
from chameleon_megatron.sim.simulator import setup, simulate

PRESETS = Path(__file__).resolve().parents[1] / "configs" / "sim"


def single_failures() -> None:
    config = load_preset(PRESETS / "32.yaml")
    s = setup(config, events=[])
    ff = plan_step(s.plan, s.profile).t_step_s
    planner = Planner(s.profile)
    d_s = MtbfEstimator(prior_s=config.mtbf_s).expected_s([], 0.0)
    gaps: dict[str, list[float]] = {"reroute": [], "replan": [], "choice": []}
    for rank in range(len(s.plan.ranks())):
        cands = make_candidates(s.plan, [rank], planner)
        choice = select(cands, d_s=d_s, batch=s.profile.global_batch_size).chosen
        for name, cand in (("reroute", cands.reroute), ("replan", cands.replan), ("choice", choice)):
            gaps[name].append(1 - ff / cand.t_step_s)
    print(f"1. {s.profile.name}, 32 devices tp{config.tp} pp{config.pp} dp{config.dp}: "
          f"failure-free step {ff:.3f} s; throughput after one failure vs failure-free "
          f"(all 32 single failures, D = MTBF = {d_s / 3600:g} h):")
    for name, values in gaps.items():
        print(f"   {name:8s} loss median {statistics.median(values):6.2%}  worst {max(values):6.2%}")


def mtbf_sweep(seeds: int) -> None:
    print(f"2. 32 devices, 24 h, repair 4 h, mean of {seeds} traces; samples/s per strategy and "
          "Chameleon's ratios")
    names = ("chameleon", "reroute", "replan", "checkpoint_restart", "redundant")
    print(f"   {'layout':>8} {'regroup s':>9} {'MTBF h':>6} {'fails':>5}  "
          + "  ".join(f"{n[:10]:>10}" for n in names) + f"  {'vs replan':>9} {'vs reroute':>10}")
    for pp, dp in ((2, 16), (4, 8), (8, 4)):
        for regroup in (30.0, 120.0, 600.0):
            for mtbf_h in (0.25, 0.5, 1.0, 2.0, 4.0):
                avg = dict.fromkeys(names, 0.0)
                fails = 0
                for seed in range(seeds):
                    config = load_preset(PRESETS / "32.yaml", pp=pp, dp=dp, mtbf_s=mtbf_h * 3600,
                                         seed=seed, regroup_s=regroup)
                    report, _ = simulate(config)
                    fails += report["failures"]
                    for name in names:
                        avg[name] += report["strategies"][name]["avg_throughput"] / seeds
                cells = "  ".join(f"{avg[n]:10.2f}" for n in names)
                print(f"   {f'pp{pp}dp{dp}':>8} {regroup:9g} {mtbf_h:6g} {fails / seeds:5.1f}  "
                      f"{cells}  {avg['chameleon'] / avg['replan']:9.3f} "
                      f"{avg['chameleon'] / avg['reroute']:10.3f}", flush=True)


def large(name: str) -> None:
    config = load_preset(PRESETS / f"{name}.yaml")
    start = time.perf_counter()
    report, _ = simulate(config)
    secs = time.perf_counter() - start
    rows = ", ".join(f"{k} {v['avg_throughput']:.1f} ({v['gap_to_failure_free']:.1%} gap)"
                     for k, v in report["strategies"].items())
    print(f"3. preset {name}: {report['devices']} devices, {report['failures']} failures, "
          f"{report['repairs']} repairs in {config.horizon_s / 3600:g} h; failure-free "
          f"{report['failure_free']['throughput']:.1f} samples/s; {rows}; "
          f"simulated in {secs:.0f} s")


def bigger_microbatch(profile: Profile, k: int) -> Profile:
    """The same model with ``k`` times the micro batch (same global batch): per-microbatch
    times and activations k times larger, k times fewer microbatches."""
    def scaled(c: LayerCost) -> LayerCost:
        return dataclasses.replace(c, forward_s=k * c.forward_s, backward_s=k * c.backward_s,
                                   activation_bytes=k * c.activation_bytes)

    return dataclasses.replace(
        profile, micro_batch_size=k * profile.micro_batch_size,
        layers=tuple(scaled(c) for c in profile.layers), embedding=scaled(profile.embedding),
        output=scaled(profile.output), boundary_bytes=k * profile.boundary_bytes)


def memory_tight(seeds: int) -> None:
    names = ("chameleon", "chameleon_swap", "replan", "reroute")
    base = load_profile(PRESETS.parent / "profiles" / "gpt-7b-h100.json")
    print(f"4. memory-tight: GPT 7B on 32 devices whose memory the failure-free layout just "
          f"fits (2 % to spare); swap at 50 GB/s; mean of {seeds} traces, samples/s")
    print(f"   {'case':>22} {'MTBF h':>6} {'fails':>5}  "
          + "  ".join(f"{n[:14]:>14}" for n in names) + f"  {'swap/no swap':>12}")
    for k, pp, dp in ((2, 8, 4), (4, 4, 8)):
        profile = bigger_microbatch(base, k)
        plan = UniformLayout(tp=1, pp=pp, dp=dp).to_plan(profile.num_layers,
                                                          profile.global_microbatches)
        memory = 1.02 * plan_step(plan, profile).peak_memory_bytes
        case = f"mbs{k} pp{pp}dp{dp} {memory / 2**30:.0f}GiB"
        for mtbf_h in (0.5, 1.0, 2.0, 4.0):
            avg = dict.fromkeys(names, 0.0)
            fails = 0
            for seed in range(seeds):
                config = load_preset(PRESETS / "32.yaml", pp=pp, dp=dp, mtbf_s=mtbf_h * 3600,
                                     seed=seed, device_memory_bytes=memory, strategies=names)
                report, _ = simulate(config, profile=profile)
                fails += report["failures"]
                for name in names:
                    avg[name] += report["strategies"][name]["avg_throughput"] / seeds
            cells = "  ".join(f"{avg[n]:14.2f}" for n in names)
            print(f"   {case:>22} {mtbf_h:6g} {fails / seeds:5.1f}  {cells}  "
                  f"{avg['chameleon_swap'] / avg['chameleon']:12.3f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--skip-large", action="store_true")
    parser.add_argument("--only", default="1,2,3,4", help="sections to run, e.g. 4")
    args = parser.parse_args()
    only = set(args.only.split(","))
    if "1" in only:
        single_failures()
    if "2" in only:
        mtbf_sweep(args.seeds)
    if "3" in only and not args.skip_large:
        large("1024")
        large("8192")
    if "4" in only:
        memory_tight(args.seeds)


if __name__ == "__main__":
    main()
