"""What a blackout of one host's link does to a running job, by its length.

Two network-namespace hosts (root and ``ip netns`` needed), each running
``scripts/launch_multinode.sh`` with one gloo worker (DP2, ``--chameleon-ft``, the recovery
tests' job: group timeout 5 s, node window ``--window`` s). After step 4, host 1's link
drops every packet for D seconds (taken down, then up), then the job goes on. For each D the
row says what followed: nothing (TCP bridged the gap), a step abandoned by every rank and
redone with no one failed, or host 1 declared lost (the store's side trains on, host 1 stops
with status 75).

    python scripts/bench_link_blackout.py                       # 1 2 3 4 6 8 12 16 s
    python scripts/bench_link_blackout.py --blackouts 2 5 20 --window 10
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "resilience" / "launch"))
from multinode_support import iterations, start_node, wait_for  # noqa: E402
from netns_support import hosts  # noqa: E402
from e2e_support import records  # noqa: E402
from rt_support import stop  # noqa: E402

ITERS = 12


def one(blackout_s: float, window_s: float, port: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp, hosts(2) as (h0, h1):
        out = Path(tmp)
        flags = ["--chameleon-ft-node-timeout-s", str(window_s)]
        procs = [start_node(h, out, i, 2, h0, port, flags, ITERS) for i, h in enumerate((h0, h1))]
        try:
            wait_for(lambda: len(iterations(out)) >= 4, 200, procs)
            h1.cut()
            time.sleep(blackout_s)
            h1.restore()
            codes = [p.wait(timeout=300) for p in procs]
        finally:
            for p in procs:
                stop(p)
        recs = records(out / "metrics.jsonl")
        recoveries = [r for r in recs if r["event"] == "recovery"]
        seen = [r["iteration"] for r in recs if r["event"] == "iteration"]
        failed = sorted({rank for r in recoveries for rank in r.get("failed_ranks") or []})
        outcome = ("host 1 lost" if failed else
                   "step abandoned, redone" if recoveries or len(seen) != len(set(seen)) else "nothing")
        return {"blackout_s": blackout_s, "outcome": outcome, "exit_codes": codes,
                "recoveries": len(recoveries), "steps_redone": len(seen) - len(set(seen))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blackouts", type=float, nargs="+",
                        default=[1, 2, 3, 4, 6, 8, 12, 16])
    parser.add_argument("--window", type=float, default=10.0,
                        help="--chameleon-ft-node-timeout-s")
    args = parser.parse_args()
    print(f"| blackout (s) | outcome | recoveries | steps redone | exit codes (host 0, 1) |")
    print("|---|---|---|---|---|")
    for k, blackout in enumerate(args.blackouts):
        row = one(blackout, args.window, 29450 + k)
        print(f"| {row['blackout_s']:g} | {row['outcome']} | {row['recoveries']} | "
              f"{row['steps_redone']} | {row['exit_codes']} |", flush=True)


if __name__ == "__main__":
    main()
