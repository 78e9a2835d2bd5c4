"""Step-time overhead and host memory of the distributed optimizer's shard copies.

One ``chameleon-run --chameleon-ft --use-distributed-optimizer`` job per interval (the
benchmark model of ``bench_recovery_e2e``, DP ``--nproc``, CPU gloo). The trainer's
metrics give each step's time and the time spent copying shards so far; the overhead is
(steps + the steps' waits for copies) / steps over the steps after the first two, a ratio
against the same run; since the exchange overlaps the steps (on a thread) and slows them
down, "vs none" also compares with a job copying only before its first step (interval
above the steps). Host memory: each rank's copies held (own and predecessor's, at the two
newest committed steps, and the copy in flight).

    python scripts/bench_shard_replica.py                       # intervals 1, 10, 100
    python scripts/bench_shard_replica.py --iters 60 --intervals 1 10
    PYTHONPATH=/path/to/older/checkout python scripts/bench_shard_replica.py   # its code
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_recovery_e2e import train  # noqa: E402


def one(tmp: Path, nproc: int, interval: int, iters: int, timeout_s: float) -> dict:
    recs = train(tmp, f"every{interval}", nproc,
                 ["--use-distributed-optimizer", "--chameleon-ft",
                  "--chameleon-ft-shard-replica-interval", str(interval)], iters, ft=True,
                 timeout_s=timeout_s)
    steps = [r for r in recs if r["event"] == "iteration"]
    warm, last = steps[1], steps[-1]  # copies made before step 3 ... up to the last record
    step_s = sum(r["step_time_s"] for r in steps[2:])
    copy_s = last["ft"]["shard_copy_s"] - warm["ft"]["shard_copy_s"]
    return {"interval": interval if interval <= iters else "none", "ranks": nproc,
            "steps": len(steps) - 2, "total_s": step_s + copy_s,
            "step_s": round(step_s / (len(steps) - 2), 4),
            "copy_s_per_step": round(copy_s / (len(steps) - 2), 5),
            "overhead": round((step_s + copy_s) / step_s, 4),
            "host_MiB_per_rank": round(last["ft"]["shard_copy_bytes"] / 2**20, 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--iters", type=int, default=102)
    parser.add_argument("--intervals", type=int, nargs="+", default=[1, 10, 100])
    parser.add_argument("--timeout", type=float, default=900.0, help="per job, seconds")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for interval in [args.iters + 1, *args.intervals]:  # the first: no copies after
            row = one(Path(tempfile.mkdtemp(dir=tmp)), args.nproc, interval, args.iters,
                      args.timeout)
            rows.append(row)
            print(json.dumps(row), flush=True)
    none = rows[0]["total_s"]
    print("\n| interval | ranks | step (s) | copies per step (s) | overhead | vs none | "
          "host MiB/rank |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['interval']} | {r['ranks']} | {r['step_s']:.3f} | "
              f"{r['copy_s_per_step']:.4f} | {r['overhead']:.3f} | {r['total_s'] / none:.3f} | "
              f"{r['host_MiB_per_rank']} |")
    print(f"\nload average before/after: {load_before:.1f} / {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
