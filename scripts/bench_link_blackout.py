"""What a blackout, a delay or packet loss on one host's link does to a running job.

Two network-namespace hosts (root and ``ip netns`` needed), each running
``scripts/launch_multinode.sh`` with one gloo worker (DP2, ``--chameleon-ft``, the recovery
tests' job: group timeout 5 s, node window ``--window`` s). After step 4, host 1's link
drops every packet for D seconds (taken down, then up), then the job goes on. For each D the
row says what followed: nothing (TCP bridged the gap), a step abandoned by every rank and
redone with no one failed, or host 1 declared lost (the store's side trains on, host 1 stops
with status 75).

``--delays-ms`` and ``--losses`` impair the link from step 4 to the end instead: packets to
host 1 arrive later (a round trip takes that much longer), or each packet is lost with that
probability both ways (iptables and a netfilter-queue delayer, ``tests/link_impair.py``:
these kernels have no netem). Those rows also give the median step time after step 4
against before it.

    python scripts/bench_link_blackout.py                       # 1 2 3 4 6 8 12 16 s
    python scripts/bench_link_blackout.py --blackouts 2 5 20 --window 10
    python scripts/bench_link_blackout.py --delays-ms 50 200 1000 --losses 0.01 0.1
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "resilience" / "launch"))
from multinode_support import running, wait_for_step  # noqa: E402
from link_impair import impaired  # noqa: E402
from netns_support import hosts  # noqa: E402
from e2e_support import records  # noqa: E402

ITERS = 12


def one(window_s: float, port: int, *, blackout_s: float = 0.0, delay_ms: float = 0.0,
        loss: float = 0.0, keep: Path | None = None) -> dict:
    """One job: host 1's link blacked out for ``blackout_s`` after step 4, or from then on
    slower by ``delay_ms`` and losing ``loss`` of its packets. ``keep``: the job's directory
    (logs, records), kept; default: a temporary one."""
    with contextlib.ExitStack() as stack:
        out = keep or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        out.mkdir(parents=True, exist_ok=True)
        h0, h1 = stack.enter_context(hosts(2))
        flags = ["--chameleon-ft-node-timeout-s", str(window_s)]
        with running(out, (h0, h1), port, flags, iters=ITERS) as procs:
            wait_for_step(out, 4, procs)
            if blackout_s:
                h1.cut()
                time.sleep(blackout_s)
                h1.restore()
                codes = [p.wait(timeout=300) for p in procs]
            else:
                with impaired(h1, [h0], delay_ms=delay_ms, loss=loss):
                    codes = [p.wait(timeout=600) for p in procs]
        recs = records(out / "metrics.jsonl")
        recoveries = [r for r in recs if r["event"] == "recovery"]
        steps = [(r["iteration"], r["step_time_s"]) for r in recs if r["event"] == "iteration"]
        seen = [it for it, _ in steps]
        failed = sorted({rank for r in recoveries for rank in r.get("failed_ranks") or []})
        outcome = ("the job did not finish" if not seen or seen[-1] != ITERS else
                   "host 1 lost" if failed else
                   "step abandoned, redone" if recoveries or len(seen) != len(set(seen)) else
                   "nothing")
        before = [t for it, t in steps if 2 < it <= 4]
        after = [t for it, t in steps if it > 5]
        slowdown = statistics.median(after) / statistics.median(before) if after else float("nan")
        return {"outcome": outcome, "exit_codes": codes, "recoveries": len(recoveries),
                "steps_redone": len(seen) - len(set(seen)), "slowdown": slowdown}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blackouts", type=float, nargs="*",
                        help="seconds (default: 1 2 3 4 6 8 12 16 when no other case is given)")
    parser.add_argument("--delays-ms", type=float, nargs="*", default=[])
    parser.add_argument("--losses", type=float, nargs="*", default=[],
                        help="probabilities, e.g. 0.01")
    parser.add_argument("--window", type=float, default=10.0,
                        help="--chameleon-ft-node-timeout-s")
    parser.add_argument("--port", type=int, default=29450, help="the first job's store port")
    parser.add_argument("--keep", type=Path, help="keep each job's logs under this folder")
    args = parser.parse_args()
    blackouts = args.blackouts if args.blackouts is not None else (
        [] if args.delays_ms or args.losses else [1, 2, 3, 4, 6, 8, 12, 16])
    cases = [*(("blackout", f"{b:g} s", {"blackout_s": b}) for b in blackouts),
             *(("delay", f"{d:g} ms", {"delay_ms": d}) for d in args.delays_ms),
             *(("loss", f"{p:.0%}", {"loss": p}) for p in args.losses)]
    print("| impairment | outcome | recoveries | steps redone | step time after / before | "
          "exit codes (host 0, 1) |")
    print("|---|---|---|---|---|---|")
    for k, (kind, size, impairment) in enumerate(cases):
        keep = args.keep / f"{kind}-{size.replace(' ', '')}" if args.keep else None
        row = one(args.window, args.port + k, keep=keep, **impairment)
        print(f"| {kind} {size} | {row['outcome']} | {row['recoveries']} | "
              f"{row['steps_redone']} | {row['slowdown']:.2f} | {row['exit_codes']} |",
              flush=True)


if __name__ == "__main__":
    main()
