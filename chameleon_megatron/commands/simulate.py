"""``chameleon simulate``: replay a failure trace (given, or drawn from an MTBF and a
repair time) against Chameleon and the baselines; print JSON, optionally draw a PNG.

The PNG (``--plot``): a strip of the trace's failures (red x) and repairs (green ^), each
strategy's throughput over time as a step line (a gap while it is down; Chameleon thick,
black, on top) and each strategy's average as a bar with its value. A run longer than
``--progress-s`` says how far it is on stderr."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable, TextIO

from chameleon_megatron.sim.config import STRATEGIES, load_preset
from chameleon_megatron.sim.plotting import plot_throughput
from chameleon_megatron.sim.simulator import setup, simulate
from chameleon_megatron.sim.traces import save_trace

PRESETS = Path(__file__).resolve().parents[2] / "configs" / "sim"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("simulate", help="compare recovery strategies on a failure trace",
                              description=__doc__)
    p.add_argument("--preset", required=True,
                   help=f"preset YAML, or the name of one in configs/sim ({PRESETS})")
    p.add_argument("--mtbf-s", type=float, help="job MTBF at full size, s")
    p.add_argument("--repair-s", type=float, help="mean repair time, s (0: never)")
    p.add_argument("--horizon-s", type=float, help="simulated time, s")
    p.add_argument("--seed", type=int)
    p.add_argument("--trace", help="trace JSON to replay instead of drawing one")
    p.add_argument("--regroup-s", type=float, help="override the profile's regroup cost, s")
    p.add_argument("--strategies", help=f"comma-separated subset of {','.join(STRATEGIES)}")
    p.add_argument("--save-trace", help="write the replayed trace as JSON")
    p.add_argument("--plot", help="write throughput over time, failures, repairs and "
                                  "averages as PNG")
    p.add_argument("--progress-s", type=float, default=2.0,
                   help="a progress line on stderr every this many seconds (0: none)")
    return p


class ProgressLines:
    """A ``simulate`` progress callback that writes a line at most every ``every_s``
    seconds, so a run shorter than that stays quiet."""

    def __init__(self, label: str, every_s: float, stream: TextIO,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.label, self.every_s, self.stream, self.clock = label, every_s, stream, clock
        self.last = clock()

    def __call__(self, fraction: float, strategy: str) -> None:
        now = self.clock()
        if self.every_s > 0 and now - self.last >= self.every_s:
            self.last = now
            print(f"simulating {self.label}: {fraction:.0%} (strategy {strategy})",
                  file=self.stream, flush=True)


def run(args: argparse.Namespace) -> int:
    preset = Path(args.preset)
    if not preset.exists():
        preset = PRESETS / f"{args.preset}.yaml"
    config = load_preset(
        preset, mtbf_s=args.mtbf_s, repair_s=args.repair_s, horizon_s=args.horizon_s,
        seed=args.seed, trace=args.trace, regroup_s=args.regroup_s,
        strategies=args.strategies.split(",") if args.strategies else None,
    )
    events = setup(config).events
    report, results = simulate(config, events=events,
                               progress=ProgressLines(preset.stem, args.progress_s, sys.stderr))
    if args.save_trace:
        save_trace(events, args.save_trace)
    if args.plot:
        plot_throughput(results, report["failure_free"]["throughput"], args.plot,
                        title=f"{report['profile']} on {report['devices']} devices, "
                              f"MTBF {config.mtbf_s / 3600:g} h", events=events)
        report["plot"] = args.plot
    print(json.dumps(report, indent=2))
    return 0
