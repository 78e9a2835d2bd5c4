"""Peak memory during a recovery against the steady state's, per rank (issue 25, part 5).

Each case is one ``chameleon-run --chameleon-ft`` job of a ~100 M-parameter GPT (8 layers,
hidden 1024) on 4 CPU ranks (DP2 x PP2, gloo): short sequences and one-sample microbatches,
so that the training state (weights, gradients, Adam moments, shard copies), not the
activations, makes the memory. One rank exits in backward at step ``--fail-at``; the
recovery record's ``memory_peak_bytes`` gives each survivor's resident high-water mark
(VmHWM) from the start of the job to the failure (steady state) and during the recovery
(``resilience/recovery/memory_peak``). The ratio is recovery peak / steady peak, per rank;
the target is <= 1.25.

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


def one(tmp: Path, strategy: str, optimizer: str, fail_at: int, iters: int,
        timeout_s: float) -> dict:
    metrics = tmp / "metrics.jsonl"
    flags = ["--chameleon-ft", "--chameleon-ft-strategy", strategy, "--chameleon-inject-fault",
             f"rank={VICTIM},iteration={fail_at},phase=backward,kind=exit"]
    if optimizer == "distributed":
        flags += ["--use-distributed-optimizer", "--chameleon-ft-shard-replica-interval", "1"]
    cmd = [sys.executable, "-m", "chameleon_megatron.run", "--standalone",
           f"--nproc-per-node={NPROC}", "--monitor-interval=0.1", "-m",
           "chameleon_megatron.pretrain_gpt", *MODEL, "--train-iters", str(iters), *flags,
           "--chameleon-metrics-file", str(metrics)]
    run(cmd, tmp / "log", timeout_s)
    rec = next(r for r in records(metrics) if r["event"] == "recovery")
    host = rec["memory_peak_bytes"]["host"]
    ranks = rec["memory_peak_bytes"]["ranks"]
    per_rank = {r: {"steady_MiB": s / 2**20, "recovery_MiB": c / 2**20, "ratio": c / s}
                for r, s, c in zip(ranks, host["steady"], host["recovery"])}
    return {"strategy": strategy, "optimizer": optimizer,
            "ran": rec["layout_after"]["mode"], "plan": rec["layout_after"]["plan"],
            "migrated_MiB": rec["migrated_bytes"] / 2**20, "per_rank": per_rank,
            "max_ratio": max(v["ratio"] for v in per_rank.values())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", nargs="+", default=["replan", "reroute"],
                        choices=["replan", "reroute", "adaptive"])
    parser.add_argument("--optimizer", nargs="+", default=["replicated", "distributed"],
                        choices=["replicated", "distributed"])
    parser.add_argument("--fail-at", type=int, default=4)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=900.0, help="per job, seconds")
    args = parser.parse_args()
    print(f"model: {PARAMETERS / 1e6:.0f} M parameters; {NPROC} ranks, DP2 x PP2; "
          f"rank {VICTIM} exits in backward of step {args.fail_at}", flush=True)
    load_before = os.getloadavg()[0]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for strategy, optimizer in itertools.product(args.strategy, args.optimizer):
            row = one(Path(tempfile.mkdtemp(dir=tmp)), strategy, optimizer, args.fail_at,
                      args.iters, args.timeout)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("\n| strategy | optimizer | ran | rank: steady -> recovery peak (MiB), ratio "
          "| max ratio |\n|---|---|---|---|---|")
    for row in rows:
        cells = "; ".join(f"{r}: {v['steady_MiB']:.0f} -> {v['recovery_MiB']:.0f}, "
                          f"{v['ratio']:.2f}" for r, v in row["per_rank"].items())
        print(f"| {row['strategy']} | {row['optimizer']} | {row['ran']} | {cells} | "
              f"{row['max_ratio']:.2f} |")
    print(f"\nload average before/after: {load_before:.1f} / {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
