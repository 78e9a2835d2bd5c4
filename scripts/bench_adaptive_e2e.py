"""Throughput after a failure under each recovery strategy, executed in the live job, against
failure-free and against the decision center's estimate.

Jobs of the same model and global batch on this machine (8 ranks, PP2 x DP4 by default):

1. failure-free (plain torchrun): the baseline step time;
2. one rank killed at an iteration, with the strategy forced to ``reroute`` (the layout is
   kept, the dead rank's microbatches run on its same-stage peers), forced to ``replan`` (the
   planner's best layout for the survivors, heterogeneous if that is best), and ``adaptive``
   (Eq. 8 picks; product defaults, prior MTBF 6 h).

The faulty jobs run with product defaults: a profile derived from the model and calibrated
to the measured step time. Step times are medians over each layout's steps after the first
two (warm-up). The estimate is the chosen candidate's ``t_step_s`` from the recovery record
(the performance model the simulator uses).

    python scripts/bench_adaptive_e2e.py                 # 8 ranks, PP2 x DP4
    python scripts/bench_adaptive_e2e.py --nproc 4       # PP2 x DP2
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_recovery_e2e import layout_flags, median_step, train  # noqa: E402


def faulty(tmp: Path, args: argparse.Namespace, strategy: str) -> dict:
    fault = f"rank={args.victim},iteration={args.fail_at},phase=forward,kind=exit"
    recs = train(tmp, strategy, args.nproc,
                 [*layout_flags(1, args.pp), "--chameleon-ft", "--chameleon-ft-strategy",
                  strategy, "--chameleon-inject-fault", fault],
                 args.iters, ft=True, timeout_s=args.timeout)
    rec = next(r for r in recs if r["event"] == "recovery")
    decision = rec["decision"]
    chosen = next(c for c in decision["candidates"] if c["name"] == decision["executed"])
    after = median_step(recs, first=rec["redo_iteration"])
    return {
        "choice": decision["choice"], "executed": rec["layout_after"]["mode"],
        "layout_after": rec["layout_after"]["plan"],
        "recovery_s": rec["phases_s"]["total"], "migrated_MiB": rec["migrated_bytes"] / 2**20,
        "step_s": after, "estimated_step_s": chosen["t_step_s"],
        "estimate_error": (chosen["t_step_s"] - after) / after,
        "losses_after": [r["loss"] for r in recs if r["event"] == "iteration"][-3:],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=8)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--victim", type=int, default=5, help="launch rank that fails")
    parser.add_argument("--fail-at", type=int, default=6, help="iteration of the failure")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=900.0, help="per job, seconds")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        base = train(Path(tmp), "failure_free", args.nproc, layout_flags(1, args.pp),
                     args.iters, ft=False, timeout_s=args.timeout)
        baseline = median_step(base)
        result: dict = {"layout": f"PP{args.pp} x DP{args.nproc // args.pp}",
                        "failure_free_step_s": baseline}
        for strategy in ("reroute", "replan", "adaptive"):
            run = faulty(Path(tmp), args, strategy)
            run["throughput_vs_failure_free"] = baseline / run["step_s"]
            result[strategy] = run
    result["load_average"] = [load_before, os.getloadavg()[0]]
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
