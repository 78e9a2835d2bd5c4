"""Recovery building blocks, timed under chameleon-run on this machine (CPU, gloo).

One job of N workers (megatron layout TP x PP x DP), one worker exits (or hangs) while the
others run collectives. Each survivor times: detection (its collective failing, and the
agent's announcement reaching it), the survivor rendezvous, the new world and megatron
groups, the recovery group, and a state migration of --mib MiB from one survivor to another.
Figures are printed as JSON and one table; the baseline in the same run is one collective
"step" before the failure (and, for the migration, an in-process copy of the same bytes).

    python scripts/bench_recovery.py --nproc 4 --tp 1 --pp 2
    python scripts/bench_recovery.py --nproc 8 --tp 2 --pp 2 --kind hang
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


class DictView:
    """item -> kind -> name -> tensor, the executor's view of one rank's state."""

    def __init__(self, data: dict) -> None:
        self.data = data

    def tensors(self, item, kind):
        return self.data.get(item, {}).get(kind, {})


def worker(out: Path, tp: int, pp: int, kind: str, pg_timeout: float, mib: float) -> int:
    import datetime

    import torch
    import torch.distributed as dist

    from chameleon_megatron.megatron import groups
    from chameleon_megatron.megatron.platform import CpuPlatform
    from chameleon_megatron.resilience.config import ResilienceConfig
    from chameleon_megatron.resilience.recovery.detector import FailureDetector
    from chameleon_megatron.resilience.store.heartbeat import Heartbeat
    from chameleon_megatron.resilience.store.job_store import JobStore
    from chameleon_megatron.resilience.recovery.regroup import agree_membership, join_world, recovery_group
    from chameleon_megatron.resilience.decision.restorer import Transfer
    from chameleon_megatron.resilience.recovery.transfer import migrate

    CpuPlatform().apply()
    me, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    victim = world - 1
    job = JobStore.from_env()
    detector = FailureDetector(job, me, ResilienceConfig(startup_timeout_s=120))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    groups.build_uniform(tp, pp, timeout_s=pg_timeout)
    groups.set_timeouts(pg_timeout)
    payload = torch.ones(256 * 1024)  # 1 MiB per collective "step"
    for _ in range(3):
        dist.all_reduce(payload)
    start = time.perf_counter()
    for _ in range(5):
        dist.all_reduce(payload)
    step_s = (time.perf_counter() - start) / 5
    dist.barrier()
    if me == victim:
        if kind == "hang":
            Heartbeat.from_env(me).beat(timeout_s=1.0)  # silent for 1 s: killed by its agent
        (out / "failed_at").write_text(repr(time.time()))
        if kind == "exit":
            os._exit(3)
        time.sleep(3600)
    detector.beat()
    try:
        while True:
            dist.all_reduce(payload)
    except RuntimeError:
        t_error = time.time()
    failures = detector.wait_for_failures(timeout_s=60)
    t_announced = time.time()
    membership = agree_membership(job, 1, me, range(world), timeout_s=60, on_wait=detector.beat)
    t_agreed = time.time()
    active = membership.members[: (len(membership.members) // (tp * pp)) * tp * pp]
    if me in active:
        join_world(job, membership, active.index(me), len(active), backend="gloo",
                   timeout_s=pg_timeout)
        groups.build_uniform(tp, pp, timeout_s=pg_timeout)
    else:
        groups.destroy()
    t_world = time.time()
    group = recovery_group(job, membership, me, timeout_s=30)
    t_group = time.time()
    n = int(mib * 2**20 / 4)
    old = {0: {"params": {"w": torch.randn(n)}}}
    new = {0: {"params": {"w": torch.empty(n)}}}
    src, dst = membership.members[:2]
    report = migrate(group, membership.members, me, [Transfer(src, dst, 0, "params", mib * 2**20)],
                     old=DictView(old if me == src else {}), new=DictView(new if me == dst else {}),
                     store=job.scoped("gen/1/migrate"), timeout_s=30)
    start = time.perf_counter()
    new[0]["params"]["w"].copy_(old[0]["params"]["w"])
    copy_s = time.perf_counter() - start
    failed_at = float((out / "failed_at").read_text())  # written by the victim as it failed
    milestones = {"detected": t_error, "announced": t_announced, "agreed": t_agreed,
                  "world": t_world, "recovery_group": t_group, "migrated": t_group + report.seconds}
    (out / f"{me}.json").write_text(json.dumps({
        "rank": me, "step_s": step_s, "reason": failures[0].reason,
        "at": {k: v - failed_at for k, v in milestones.items()},
        "migrate_s": report.seconds, "moved": bool(report.sent_bytes + report.received_bytes),
        "copy_s": copy_s,
    }))
    if me == src:
        job.mark_done()
    return 0


def launch(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        cmd = [sys.executable, "-m", "chameleon_megatron.run", "--standalone",
               f"--nproc-per-node={args.nproc}", "--monitor-interval=0.05", __file__, "--worker",
               str(out), "--tp", str(args.tp), "--pp", str(args.pp), "--kind", args.kind,
               "--pg-timeout", str(args.pg_timeout), "--mib", str(args.mib), "--chameleon-ft"]
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            sys.exit(f"job failed ({proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
        return {int(p.stem): json.loads(p.read_text()) for p in out.glob("[0-9]*.json")}


def summarize(ranks: dict, args: argparse.Namespace) -> dict:
    """Each milestone when the last survivor passed it (seconds after the failure), and the
    phases between them: the recovery's critical path."""
    last = {k: max(r["at"][k] for r in ranks.values()) for k in next(iter(ranks.values()))["at"]}
    order = list(last)
    phases = {f"{a}->{b}": last[b] - last[a] for a, b in zip(order, order[1:])}
    movers = [r for r in ranks.values() if r["moved"]]
    migrate_s = max(r["migrate_s"] for r in movers)
    return {
        "layout": f"TP{args.tp} x PP{args.pp} x DP{args.nproc // (args.tp * args.pp)}",
        "failure": args.kind, "reason_seen": sorted({r["reason"] for r in ranks.values()}),
        "pg_timeout_s": args.pg_timeout,
        "baseline_step_s": statistics.median(r["step_s"] for r in ranks.values()),
        "first_detection_s": min(r["at"]["detected"] for r in ranks.values()),
        "last_survivor_at_s": last, "phases_s": phases,
        "migrate_MBps": args.mib * 2**20 / 1e6 / migrate_s,
        "copy_MBps": args.mib * 2**20 / 1e6 / statistics.median(r["copy_s"] for r in movers),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--kind", choices=["exit", "hang"], default="exit")
    parser.add_argument("--pg-timeout", type=float, default=2.0)
    parser.add_argument("--mib", type=float, default=64.0)
    parser.add_argument("--worker", type=Path, default=None)
    args, _ = parser.parse_known_args()
    if args.worker is not None:
        return worker(args.worker, args.tp, args.pp, args.kind, args.pg_timeout, args.mib)
    result = summarize(launch(args), args)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
