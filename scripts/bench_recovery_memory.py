"""Peak memory during a recovery against the steady state's, per rank (issue 25, part 5).

Each case is one ``chameleon-run --chameleon-ft`` job of a ~100 M-parameter GPT (8 layers,
hidden 1024) on 4 CPU ranks (DP2 x PP2, gloo): short sequences and one-sample microbatches,
so that the training state (weights, gradients, Adam moments, shard copies), not the
activations, makes the memory. One rank exits in backward at step ``--fail-at``; the
recovery record's ``memory_peak_bytes`` gives each survivor's resident high-water mark
(VmHWM) from the start of the job to the failure (steady state) and during the recovery
(``resilience/recovery/memory_peak``); each rank's high-water mark from the recovery's end
to the job's (``bench_memory_worker.py``) gives the new layout's steady state. Ratios, per
rank: recovery peak / steady peak before the failure, and recovery peak / the larger of the
steady peaks before and after (the overlap a recovery adds: a rank whose new layout holds more,
such as the dead rank's partner in rerouting, which owns its stage's whole optimizer state,
needs that memory after the recovery in any case). Target: <= 1.25.

    python scripts/bench_recovery_memory.py                     # re-plan and rerouting,
                                                                # replicated and distributed
    python scripts/bench_recovery_memory.py --strategy reroute --optimizer distributed
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_recovery_e2e import records, run  # noqa: E402

MODEL = ["--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "16",
         "--seq-length", "32", "--max-position-embeddings", "32", "--vocab-size", "1024",
         "--mock-data", "--micro-batch-size", "1", "--global-batch-size", "4", "--lr", "1e-4",
         "--log-interval", "1", "--pipeline-model-parallel-size", "2"]
PARAMETERS = 8 * 12 * 1024**2 + 1024 * 1024 + 32 * 1024
"""Weights (transformer layers, word and position embeddings; norms and biases aside)."""
NPROC, VICTIM = 4, 3
WORKER = Path(__file__).resolve().parent / "bench_memory_worker.py"


def one(tmp: Path, strategy: str, optimizer: str, fail_at: int, iters: int,
        timeout_s: float, keep_replicas: bool) -> dict:
    metrics = tmp / "metrics.jsonl"
    flags = ["--chameleon-ft", "--chameleon-ft-strategy", strategy, "--chameleon-inject-fault",
             f"rank={VICTIM},iteration={fail_at},phase=backward,kind=exit"]
    if not keep_replicas:
        flags.append("--no-chameleon-ft-keep-replicas")
    if optimizer == "distributed":
        flags += ["--use-distributed-optimizer", "--chameleon-ft-shard-replica-interval", "1"]
    cmd = [sys.executable, "-m", "chameleon_megatron.run", "--standalone",
           f"--nproc-per-node={NPROC}", "--monitor-interval=0.1", str(WORKER), str(tmp),
           *MODEL, "--train-iters", str(iters), *flags, "--chameleon-metrics-file", str(metrics)]
    run(cmd, tmp / "log", timeout_s)
    rec = next(r for r in records(metrics) if r["event"] == "recovery")
    host = rec["memory_peak_bytes"]["host"]
    ranks = rec["memory_peak_bytes"]["ranks"]
    per_rank = {}
    for r, steady, recovery in zip(ranks, host["steady"], host["recovery"]):
        after = int((tmp / f"{r}.hwm").read_text())
        per_rank[r] = {"steady_MiB": steady / 2**20, "recovery_MiB": recovery / 2**20,
                       "after_MiB": after / 2**20, "ratio": recovery / steady,
                       "ratio_larger": recovery / max(steady, after)}
    return {"strategy": strategy, "optimizer": optimizer,
            "ran": rec["layout_after"]["mode"], "plan": rec["layout_after"]["plan"],
            "migrated_MiB": rec["migrated_bytes"] / 2**20, "per_rank": per_rank,
            "max_ratio": max(v["ratio"] for v in per_rank.values()),
            "max_ratio_larger": max(v["ratio_larger"] for v in per_rank.values())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", nargs="+", default=["replan", "reroute"],
                        choices=["replan", "reroute", "adaptive"])
    parser.add_argument("--optimizer", nargs="+", default=["replicated", "distributed"],
                        choices=["replicated", "distributed"])
    parser.add_argument("--fail-at", type=int, default=4)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=900.0, help="per job, seconds")
    parser.add_argument("--no-keep-replicas", action="store_true",
                        help="let a re-plan choose one pipeline (--no-chameleon-ft-keep-replicas)")
    args = parser.parse_args()
    print(f"model: {PARAMETERS / 1e6:.0f} M parameters; {NPROC} ranks, DP2 x PP2; "
          f"rank {VICTIM} exits in backward of step {args.fail_at}", flush=True)
    load_before = os.getloadavg()[0]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for strategy, optimizer in itertools.product(args.strategy, args.optimizer):
            row = one(Path(tempfile.mkdtemp(dir=tmp)), strategy, optimizer, args.fail_at,
                      args.iters, args.timeout, not args.no_keep_replicas)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("\n| strategy | optimizer | ran | rank: steady before -> recovery peak -> steady "
          "after (MiB) | max ratio vs before | max ratio vs larger |\n|---|---|---|---|---|---|")
    for row in rows:
        cells = "; ".join(f"{r}: {v['steady_MiB']:.0f} -> {v['recovery_MiB']:.0f} -> "
                          f"{v['after_MiB']:.0f}" for r, v in row["per_rank"].items())
        print(f"| {row['strategy']} | {row['optimizer']} | {row['ran']} | {cells} | "
              f"{row['max_ratio']:.2f} | {row['max_ratio_larger']:.2f} |")
    print(f"\nload average before/after: {load_before:.1f} / {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
