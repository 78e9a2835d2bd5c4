"""Recovery time by phase (detect, decide, regroup, migrate) of a real training job, for a
failure at start-up (step 2: no step time measured yet, the groups still have the start-up
timeout) and at steady state, on 4 and 8 CPU ranks.

Each case is one ``chameleon-run --chameleon-ft`` job with product defaults (derived
profile, timeouts from the measured step time) in which one rank exits in backward; the
figures are its ``{"event": "recovery"}`` record's ``phases_s``. Targets (issue 12, tiny
model): detection <= 1 s, total <= 5 s.

    python scripts/bench_recovery_phases.py                 # 4 and 8 ranks, both moments
    python scripts/bench_recovery_phases.py --nproc 4 --repeat 3
    python scripts/bench_recovery_phases.py --nproc 8 --moments steady \
        --strategy reroute replan adaptive --precision fp32 bf16     # by strategy (issue 11)
    python scripts/bench_recovery_phases.py --nproc 8 --moments steady \
        --strategy reroute replan adaptive --precision fp32 bf16 --optimizer distributed

Scaling (issue 29): ``--params 10M 100M 300M`` runs each case at those model sizes (seq 32,
micro batch 1, global batch 8, vocabulary 1024: the training state, not the activations,
grows), so a reader sees which phase grows with the state:

    python scripts/bench_recovery_phases.py --nproc 4 8 --moments steady \
        --params 10M 100M 300M --optimizer replicated distributed
    python scripts/bench_recovery_phases.py --nproc 8 --moments steady --pp 4 \
        --params 300M --optimizer replicated distributed   # 300 M on 8 ranks in 24 GiB

``--strategy`` forces the decision center's choice (adaptive: its score picks); the row
says what ran (``layout_after.mode``: rerouting, a heterogeneous plan or a megatron layout;
with the distributed optimizer the state is rebuilt from the shard copies, refreshed every
step here, and a plan shards each part of a stage over its holders).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_recovery_e2e import train  # noqa: E402

PHASES = ("detect", "decide", "regroup", "migrate", "total")
SIZES = {
    "bench": [],  # bench_recovery_e2e's model: 8 layers, hidden 256 (6.6 M parameters)
    "10M": ["--num-layers", "8", "--hidden-size", "320", "--num-attention-heads", "8"],
    "100M": ["--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "16"],
    "300M": ["--num-layers", "24", "--hidden-size", "1024", "--num-attention-heads", "16"],
}
"""Model sizes by parameter count (12 x layers x hidden^2 + the embeddings)."""
SMALL_BATCH = ["--seq-length", "32", "--micro-batch-size", "1", "--global-batch-size", "8"]
MOMENTS = {"start-up": 2, "steady": 12}
"""The failing step: 2 is before any step time is known; by 12 the timeouts are derived."""


def one(tmp: Path, nproc: int, at: int, iters: int, timeout_s: float,
        extra: list[str], pp: int = 2) -> tuple[dict[str, float], str]:
    """(phases of the recovery record with its migrated MiB, what ran after it)."""
    victim = nproc - 1
    fault = f"rank={victim},iteration={at},phase=backward,kind=exit"
    recs = train(tmp, f"n{nproc}-at{at}", nproc,
                 ["--pipeline-model-parallel-size", str(pp), "--chameleon-ft",
                  "--chameleon-inject-fault", fault, *extra], iters, ft=True,
                 timeout_s=timeout_s)
    rec = next(r for r in recs if r["event"] == "recovery")
    return {**rec["phases_s"], "MiB": rec["migrated_bytes"] / 2**20}, rec["layout_after"]["mode"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--repeat", type=int, default=1, help="jobs per case (medians)")
    parser.add_argument("--iters", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=600.0, help="per job, seconds")
    parser.add_argument("--moments", nargs="+", choices=list(MOMENTS), default=list(MOMENTS))
    parser.add_argument("--strategy", nargs="+", default=["adaptive"],
                        choices=["adaptive", "reroute", "replan"])
    parser.add_argument("--precision", nargs="+", default=["fp32"], choices=["fp32", "bf16"])
    parser.add_argument("--optimizer", nargs="+", default=["replicated"],
                        choices=["replicated", "distributed"])
    parser.add_argument("--params", nargs="+", default=["bench"], choices=list(SIZES),
                        help="model sizes (other than bench: seq 32, micro 1, global 8)")
    parser.add_argument("--pp", type=int, default=2,
                        help="pipeline depth (4 fits 300 M on 8 ranks in 24 GiB)")
    args = parser.parse_args()
    rows = []
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        for size, nproc, moment, strategy, precision, optimizer in itertools.product(
                args.params, args.nproc, args.moments, args.strategy, args.precision,
                args.optimizer):
            at = MOMENTS[moment]
            extra = ["--chameleon-ft-strategy", strategy, *(["--bf16"] * (precision == "bf16")),
                     *SIZES[size], *(SMALL_BATCH if SIZES[size] else [])]
            if optimizer == "distributed":
                extra += ["--use-distributed-optimizer",
                          "--chameleon-ft-shard-replica-interval", "1"]
            runs = [one(Path(tempfile.mkdtemp(dir=tmp)), nproc, at, args.iters, args.timeout,
                        extra, args.pp) for _ in range(args.repeat)]
            row = {"params": size, "ranks": nproc, "pp": args.pp, "failure": f"{moment} (step {at})", "strategy": strategy,
                   "precision": precision, "optimizer": optimizer,
                   "ran": "/".join(sorted({m for _, m in runs})),
                   **{p: round(statistics.median(r[p] for r, _ in runs), 3)
                      for p in (*PHASES, "MiB")}}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n| params | ranks | pp | failure | strategy | precision | optimizer | ran | "
          f"{' | '.join(PHASES)} (s) | migrated MiB |")
    print("|---|---|---|---|---|---|---|---|" + "---|" * (len(PHASES) + 1))
    for row in rows:
        print(f"| {row['params']} | {row['ranks']} | {row['pp']} | {row['failure']} | {row['strategy']} | {row['precision']} | "
              f"{row['optimizer']} | {row['ran']} | "
              + " | ".join(f"{row[p]:.2f}" for p in PHASES) + f" | {row['MiB']:.0f} |")
    print(f"\nload average before/after: {load_before:.1f} / {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
