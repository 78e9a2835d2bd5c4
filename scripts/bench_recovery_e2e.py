"""Recovery of a real training job, end to end: time per phase, throughput after recovery,
and the decision center's step-time estimate against the measured one.

Three jobs of the same model and global batch, all on this machine:

1. the faulty job: ``chameleon-run`` with ``--chameleon-ft`` (product defaults: derived
   profile calibrated to the measured step time, timeouts from it), one rank killed at a
   given iteration and phase; its ``{"event": "recovery"}`` record gives the phases, the
   layout after, and the estimate the decision was made with;
2. failure-free at the new size (the layout the survivors ended in, plain torchrun): the
   throughput the survivors should reach;
3. failure-free at the original size: the baseline before the failure.

Step times are medians over the steps after the first two of each layout (warm-up).

    python scripts/bench_recovery_e2e.py --nproc 4 --tp 1 --pp 2
    python scripts/bench_recovery_e2e.py --nproc 8 --tp 2 --pp 2 --victim 5
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL = ["--num-layers", "8", "--hidden-size", "256", "--num-attention-heads", "8",
         "--seq-length", "128", "--vocab-size", "1024", "--mock-data", "--micro-batch-size", "2",
         "--global-batch-size", "16", "--lr", "1e-4", "--log-interval", "5"]


def run(cmd: list[str], log: Path, timeout_s: float) -> None:
    """Run ``cmd`` in its own session; on timeout or failure kill the session and exit."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    if code != 0:
        sys.exit(f"{' '.join(cmd[:6])} ... failed ({code}); log tail:\n"
                 f"{log.read_text()[-3000:]}")


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def median_step(recs: list[dict], first: int = 1, last: int = 10**9) -> float:
    """Median step time of iterations ``first``..``last``, less the first two (warm-up)."""
    times = [r["step_time_s"] for r in recs
             if r["event"] == "iteration" and first <= r["iteration"] <= last]
    return statistics.median(times[2:])


def train(tmp: Path, name: str, nproc: int, flags: list[str], iters: int, *, ft: bool,
          timeout_s: float) -> list[dict]:
    metrics = tmp / f"{name}.jsonl"
    launcher = "chameleon_megatron.run" if ft else "torch.distributed.run"
    cmd = [sys.executable, "-m", launcher, "--standalone", f"--nproc-per-node={nproc}",
           "--monitor-interval=0.1", "-m", "chameleon_megatron.pretrain_gpt", *MODEL,
           "--train-iters", str(iters), *flags, "--chameleon-metrics-file", str(metrics)]
    run(cmd, tmp / f"{name}.log", timeout_s)
    return records(metrics)


def layout_flags(tp: int, pp: int) -> list[str]:
    return ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]


def bench(args: argparse.Namespace, tmp: Path) -> dict:
    fault = f"rank={args.victim},iteration={args.fail_at},phase={args.phase},kind={args.kind}"
    faulty = train(tmp, "faulty", args.nproc, [*layout_flags(args.tp, args.pp), "--chameleon-ft",
                                               "--chameleon-inject-fault", fault],
                   args.iters, ft=True, timeout_s=args.timeout)
    rec = next(r for r in faulty if r["event"] == "recovery")
    after = rec["layout_after"]
    at_new = None  # a heterogeneous plan has no failure-free megatron twin
    if after["mode"] == "megatron":
        at_new = train(tmp, "new_size", after["tp"] * after["pp"] * after["dp"],
                       layout_flags(after["tp"], after["pp"]), args.iters, ft=False,
                       timeout_s=args.timeout)
    new_step = median_step(at_new) if at_new else None
    at_old = train(tmp, "old_size", args.nproc, layout_flags(args.tp, args.pp), args.iters,
                   ft=False, timeout_s=args.timeout)
    recovered = median_step(faulty, first=rec["redo_iteration"])
    replan = next(c for c in rec["decision"]["candidates"] if c["name"] == "replan")
    return {
        "layout_before": f"TP{args.tp} x PP{args.pp} x DP{args.nproc // (args.tp * args.pp)}",
        "fault": fault,
        "layout_after": after["plan"],
        "spares": rec["spares"],
        "decision": {"choice": rec["decision"]["choice"],
                     "executed": rec["decision"]["executed"],
                     "candidates": {c["name"]: {k: c[k] for k in
                                                ("t_step_s", "t_transition_s", "score")}
                                    for c in rec["decision"]["candidates"]}},
        "phases_s": rec["phases_s"],
        "migrated_MiB": rec["migrated_bytes"] / 2**20,
        "step_s": {"before_failure": median_step(faulty, last=args.fail_at - 1),
                   "failure_free_old_size": median_step(at_old),
                   "after_recovery": recovered, "failure_free_new_size": new_step},
        "throughput_after_vs_failure_free_new_size": new_step and new_step / recovered,
        "estimate": {"estimated_step_s": replan["t_step_s"], "measured_step_s": recovered,
                     "relative_error": (replan["t_step_s"] - recovered) / recovered},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--victim", type=int, default=3, help="launch rank that fails")
    parser.add_argument("--fail-at", type=int, default=10, help="iteration of the failure")
    parser.add_argument("--phase", default="backward", choices=["forward", "backward", "optimizer"])
    parser.add_argument("--kind", default="exit", choices=["exit", "hang", "exception"])
    parser.add_argument("--iters", type=int, default=25)
    parser.add_argument("--timeout", type=float, default=900.0, help="per job, seconds")
    parser.add_argument("--json", default=None, help="also write the result to this file")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        result = bench(args, Path(tmp))
    # other processes on the host inflate every time: say how busy it was
    result["load_average"] = [load_before, os.getloadavg()[0]]
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
