"""Decision-center timing: fresh plan searches, candidates, the plan cache and its lookups.

    .venv/bin/python scripts/bench_planner.py [--skip-8192]

Prints one line per figure. Each fresh search uses a new Planner (no memo shared).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path

from chameleon_megatron.resilience.decision.candidates import make_candidates
from chameleon_megatron.resilience.decision.layout import UniformLayout
from chameleon_megatron.resilience.decision.plan_cache import PlanCache
from chameleon_megatron.resilience.decision.planner import Planner, SearchOptions
from chameleon_megatron.resilience.decision.profile import load_profile

PROFILES = Path(__file__).resolve().parents[1] / "configs" / "profiles"


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def fresh_search(profile, units, options=None):
    result, secs = timed(lambda: Planner(profile, options).search(units))
    shape = sorted({(p.depth, p.microbatches) for p in result.pipelines or ()})
    print(f"  search {units:5d} TP groups: {secs:7.3f} s  t_step {result.t_step_s:.4f} s  "
          f"complete={result.complete}  multisets={result.evaluated}  (depth, m) {shape[:4]}")
    return secs


def scale(name, profile_file, tp, pp, dp, *, gbs=None, cache=True, pairs=False, limit=None):
    profile = load_profile(PROFILES / profile_file)
    if gbs:
        profile = dataclasses.replace(profile, global_batch_size=gbs)
    layout = UniformLayout(tp=tp, pp=pp, dp=dp)
    plan = layout.to_plan(profile.num_layers, profile.global_microbatches)
    units = layout.world_size // tp
    print(f"{name}: {layout.world_size} devices, tp{tp} pp{pp} dp{dp}, {profile.name}")
    options = SearchOptions(time_limit_s=limit)
    fresh_search(profile, units, options)
    fresh_search(profile, units - 1, options)
    cands, secs = timed(lambda: make_candidates(plan, [1], Planner(profile, options)))
    print(f"  both candidates for one failure (fresh planner, restorer included): {secs:.3f} s; "
          f"reroute {cands.reroute.t_step_s:.4f} s, replan {cands.replan.t_step_s:.4f} s")
    if not cache:
        return
    built, secs = timed(lambda: PlanCache.build(plan, Planner(profile, options), pairs=pairs))
    what = "single and pair" if pairs else "single"
    print(f"  precompute all {what} failures ({len(built.entries)} entries): {secs:.2f} s")
    lookups = []
    for rank in range(0, layout.world_size, max(1, layout.world_size // 200)):
        _, s = timed(lambda: built.lookup([rank]))
        lookups.append(s)
    print(f"  cached lookup: median {statistics.median(lookups) * 1e3:.3f} ms, "
          f"max {max(lookups) * 1e3:.3f} ms over {len(lookups)} lookups")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-8192", action="store_true")
    args = parser.parse_args()
    scale("paper scale", "gpt-7b-h100.json", 1, 2, 16, pairs=True)
    scale("1,024 GPUs", "gpt-175b-tp8-h100.json", 8, 8, 16)
    if not args.skip_8192:
        scale("8,192 GPUs", "gpt-175b-tp8-h100.json", 8, 8, 128, gbs=8192, cache=False,
              limit=60.0)


if __name__ == "__main__":
    main()
