"""In-memory recovery against checkpoint-restart: one job, three ways, in one run.

The same model, layout and N iterations, on CPU gloo ranks:

1. failure-free: plain torchrun, one checkpoint at the end (its save time C is measured);
2. in-memory: ``chameleon-run --chameleon-ft`` (each failed worker respawned and admitted
   back, ``--chameleon-ft-respawns``), K failures;
3. restart: torchrun ``--max-restarts=K`` restarting every worker, the trainer saving through
   dist_checkpointing every S steps (``--save/--save-interval``) and resuming from the latest
   one (``--load``), S from Young's formula sqrt(2 C MTBF) with the measured C, the same K
   failures.

A failure is a SIGKILL of one worker early in a given step (``job_watch``), the same steps
and ranks in both jobs. Per failure: downtime (the kill to the next completed step), the
time until the failed step itself is complete, steps redone; per job: wall time for the N
iterations (launch to exit) and its ratio to the failure-free job's.

    python scripts/bench_vs_restart.py --nproc 4                 # 102 M parameters, PP2 x DP2
    python scripts/bench_vs_restart.py --nproc 8 --hidden 512 --heads 8 --iters 30 \
        --fail-at 8 16 24                                        # 26 M parameters, PP2 x DP4
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_recovery_e2e import REPO, layout_flags  # noqa: E402
from job_watch import Kill, Trace, watch_job  # noqa: E402

TRACKER = "latest_checkpointed_iteration.txt"
"""Megatron's file naming the newest complete checkpoint (written after the save)."""
RESTART_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
"""A fresh store per restart, hosted by the new rank 0: in the agent's shared store the
restarted workers read the dead generation's gloo addresses (connectFullMesh: connection
refused) and the restart fails."""
LOADED = re.compile(r"loaded checkpoint of iteration (\d+)")
SAVED = re.compile(r"saved checkpoint at iteration (\d+)")


def gpt(layers: int, hidden: int, heads: int) -> list[str]:
    """A GPT whose training state, not its activations, makes the memory and the checkpoint:
    short sequences, one-sample microbatches, fp32 Adam (``bench_recovery_memory``'s)."""
    return ["--num-layers", str(layers), "--hidden-size", str(hidden),
            "--num-attention-heads", str(heads), "--seq-length", "32",
            "--max-position-embeddings", "32", "--vocab-size", "1024", "--mock-data",
            "--micro-batch-size", "1", "--global-batch-size", "4", "--lr", "1e-4",
            "--log-interval", "1", "--distributed-timeout-minutes", "5"]


def parameters(layers: int, hidden: int) -> int:
    """Weights of ``gpt`` (transformer layers, word and position embeddings)."""
    return layers * 12 * hidden**2 + 1024 * hidden + 32 * hidden


@dataclass(frozen=True)
class Job:
    """What the three ways share: model and layout flags, ranks, iterations."""

    model: tuple[str, ...]
    nproc: int
    iters: int
    timeout_s: float

    def trainer(self, metrics: Path, *extra: str) -> list[str]:
        return ["-m", "chameleon_megatron.pretrain_gpt", *self.model, "--train-iters",
                str(self.iters), "--chameleon-metrics-file", str(metrics), *extra]

    def launcher(self, module: str, *options: str) -> list[str]:
        return [sys.executable, "-m", module, "--standalone",
                f"--nproc-per-node={self.nproc}", "--monitor-interval=0.1", *options]


def run(job: Job, tmp: Path, name: str, cmd_of: Callable[[Path], list[str]],
        kills: tuple[Kill, ...] = (), ready: Callable[[int], bool] = lambda step: True,
        env: dict[str, str] | None = None) -> Trace:
    """``cmd_of(metrics)``'s job under ``watch_job``; exits with the log's tail on failure."""
    (tmp / name).mkdir()
    metrics, log = tmp / name / "metrics.jsonl", tmp / name / "log"
    trace = watch_job(cmd_of(metrics), cwd=REPO, metrics=metrics, log=log, tag=str(tmp / name),
                      kills=kills, ready=ready, env=env, timeout_s=job.timeout_s)
    if trace.exit_code != 0 or len(trace.kills) != len(kills):
        raise RuntimeError(f"{name} job: exit {trace.exit_code}, {len(trace.kills)} of "
                           f"{len(kills)} kills; log tail:\n{log.read_text()[-3000:]}")
    return trace


def failure_free(job: Job, tmp: Path) -> Trace:
    ckpt = tmp / "ckpt-failure-free"
    return run(job, tmp, "failure-free", lambda m: [
        *job.launcher("torch.distributed.run"), *job.trainer(m, "--save", str(ckpt))])


def in_memory(job: Job, tmp: Path, kills: tuple[Kill, ...]) -> Trace:
    ckpt = tmp / "ckpt-in-memory"
    return run(job, tmp, "in-memory", lambda m: [
        *job.launcher("chameleon_megatron.run"),
        *job.trainer(m, "--save", str(ckpt), "--chameleon-ft",
                     "--chameleon-ft-respawns", str(len(kills)))], kills)


def restart_baseline(job: Job, tmp: Path, kills: tuple[Kill, ...], interval: int,
                     *, load: bool = True) -> Trace:
    """torchrun restarting every worker after each kill; each start loads the newest
    checkpoint under ``--load`` (``load=False``: none, a baseline that cannot resume)."""
    ckpt = tmp / "ckpt-restart"
    resume = ["--load", str(ckpt)] if load else []
    return run(job, tmp, "restart", lambda m: [
        *job.launcher("torch.distributed.run", f"--max-restarts={len(kills)}"),
        *job.trainer(m, "--save", str(ckpt), "--save-interval", str(interval), *resume,
                     "--chameleon-metrics-append")],  # each start adds its run
        kills, ready=lambda step: saved_through(ckpt, step - 1, interval), env=RESTART_ENV)


def saved_through(ckpt: Path, step: int, interval: int) -> bool:
    """Whether a checkpoint due after ``step`` is complete (a kill waits for it: a node
    dying inside a save is another experiment)."""
    if step % interval:
        return True
    tracker = ckpt / TRACKER
    return tracker.exists() and int(tracker.read_text()) >= step


# --------------------------------------------------------------------------- analysis
@dataclass(frozen=True)
class FailureCost:
    step: int
    """The step the failure hit."""
    downtime_s: float
    """From the kill to the next completed step."""
    back_s: float
    """From the kill to the failed step completed (downtime plus the redone steps)."""
    redone: tuple[int, ...]
    """Steps completed before the failure and completed again after it."""
    resumed_from: int | None
    """The checkpoint iteration loaded after the failure (None: none loaded)."""


def failure_costs(trace: Trace, kills: tuple[Kill, ...]) -> list[FailureCost]:
    costs = []
    for k, (kill, at) in enumerate(zip(kills, trace.kills)):
        until = trace.kills[k + 1] if k + 1 < len(trace.kills) else math.inf
        after = [(t, it) for t, it in trace.iterations() if at < t < until]
        if not after or after[-1][1] < kill.step:
            raise RuntimeError(f"step {kill.step} never completed after its failure")
        loaded = [int(m.group(1)) for t, line in trace.lines
                  if at < t < until and (m := LOADED.search(line))]
        costs.append(FailureCost(
            step=kill.step, downtime_s=after[0][0] - at,
            back_s=next(t for t, it in after if it == kill.step) - at,
            redone=tuple(sorted({it for _, it in after if it < kill.step})),
            resumed_from=loaded[0] if loaded else None))
    return costs


def step_seconds(trace: Trace) -> float:
    """Median step time, the first two steps (warm-up) left out."""
    return statistics.median([r["step_time_s"] for _, r in trace.records
                              if r.get("event") == "iteration"][2:])


def save_seconds(trace: Trace, iteration: int) -> float:
    """From the record of ``iteration`` to the log line of its completed checkpoint."""
    done = next(t for t, line in trace.lines
                if (m := SAVED.search(line)) and int(m.group(1)) == iteration)
    return done - next(t for t, it in trace.iterations() if it == iteration)


def young_interval(save_s: float, mtbf_s: float, step_s: float) -> int:
    """Young's checkpoint interval sqrt(2 C MTBF), in whole steps (at least one)."""
    return max(1, round(math.sqrt(2 * save_s * mtbf_s) / step_s))


def check_inputs(iters: int, fail_at: list[int], mtbf_s: float | None, nproc: int) -> None:
    """ValueError with the value and the limit, before anything starts."""
    if iters < 4:
        raise ValueError(f"--iters={iters}: must be >= 4")
    if nproc < 2:
        raise ValueError(f"--nproc={nproc}: must be >= 2 (rank 0 writes the metrics; "
                         "another rank fails)")
    if mtbf_s is not None and not mtbf_s > 0:
        raise ValueError(f"--mtbf-s={mtbf_s}: must be > 0")
    if not fail_at:
        raise ValueError("--fail-at: give at least one step")
    if fail_at != sorted(set(fail_at)):
        raise ValueError(f"--fail-at={fail_at}: must be increasing, each step once")
    if fail_at[0] < 3 or fail_at[-1] > iters:
        raise ValueError(f"--fail-at={fail_at}: each step must be in 3..{iters} (--iters; "
                         "a failure needs two steps measured before it)")


def victims(nproc: int, count: int) -> tuple[int, ...]:
    """Launch ranks to kill, alternately from the top and the bottom (never rank 0, which
    writes the metrics): the failures hit different stages."""
    order = [r for pair in zip(range(nproc - 1, 0, -1), range(1, nproc)) for r in pair]
    order = list(dict.fromkeys(order))
    return tuple(order[k % len(order)] for k in range(count))


# --------------------------------------------------------------------------- report
def summary(name: str, trace: Trace, kills: tuple[Kill, ...], base_s: float,
            interval: int | None) -> dict:
    """One job's row; ``recovery_s``: each in-memory recovery's total (failure to the redone
    step's start), joins of respawned workers aside."""
    costs = failure_costs(trace, kills)
    recoveries = [r["phases_s"]["total"] for _, r in trace.records
                  if r.get("event") == "recovery" and r.get("cause") == "failure"]
    return {"job": name, "wall_s": trace.wall_s, "vs_failure_free": trace.wall_s / base_s,
            "checkpoint_interval": interval, "failures": [asdict(c) for c in costs],
            "step_s": step_seconds(trace), "load": trace.load, "recovery_s": recoveries}


def table(rows: list[dict]) -> str:
    out = ["| ranks | job | checkpoint every | downtime per failure (s) | failed step done (s) "
           "| steps redone | wall (s) | vs failure-free | median step (s) | load |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        f = r["failures"]
        down = " / ".join(f"{c['downtime_s']:.1f}" for c in f) or "-"
        back = " / ".join(f"{c['back_s']:.1f}" for c in f) or "-"
        redone = " / ".join(str(len(c["redone"])) for c in f) or "-"
        out.append(f"| {r['ranks']} | {r['job']} | {r['checkpoint_interval'] or '-'} | {down} | "
                   f"{back} | {redone} | {r['wall_s']:.0f} | {r['vs_failure_free']:.2f} | "
                   f"{r['step_s']:.2f} | {r['load'][0]:.0f}-{r['load'][1]:.0f} |")
    return "\n".join(out)


def targets(rows: list[dict]) -> str:
    """The issue's targets, from the rows of one rank count: in-memory downtime per failure
    <= 1/10 of the restart's; in-memory wall within 10 % of the failure-free job's."""
    by = {r["job"]: r for r in rows}
    mem, rst = by["in-memory"], by["restart"]
    ratio = (statistics.mean(c["downtime_s"] for c in mem["failures"])
             / statistics.mean(c["downtime_s"] for c in rst["failures"]))
    return (f"{mem['ranks']} ranks: downtime in-memory / restart {ratio:.3f} (target <= 0.1); "
            f"wall in-memory / failure-free {mem['vs_failure_free']:.3f}, restart / "
            f"failure-free {rst['vs_failure_free']:.3f} (target <= 1.10); in-memory "
            f"recoveries (failure -> redone step starts) {mem['recovery_s']}")


def bench(job: Job, tmp: Path, fail_at: list[int], mtbf_s: float | None) -> list[dict]:
    kills = tuple(Kill(step=s, rank=r) for s, r in zip(fail_at, victims(job.nproc, len(fail_at))))
    free = failure_free(job, tmp)
    step_s, save_s = step_seconds(free), save_seconds(free, job.iters)
    mtbf = mtbf_s or job.iters * step_s / len(kills)  # the injected failures' rate
    interval = young_interval(save_s, mtbf, step_s)
    regime = {"ranks": job.nproc, "step_s": step_s, "save_s": save_s, "mtbf_s": mtbf,
              "young_interval_steps": interval, "kills": [asdict(k) for k in kills]}
    print(json.dumps(regime), flush=True)
    memory = in_memory(job, tmp, kills)
    restart = restart_baseline(job, tmp, kills, interval)
    rows = [summary("failure-free", free, (), free.wall_s, None),
            summary("in-memory", memory, kills, free.wall_s, None),
            summary("restart", restart, kills, free.wall_s, interval)]
    for row in rows:
        row.update(ranks=job.nproc, regime=regime)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, nargs="+", default=[4])
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--iters", type=int, default=36)
    parser.add_argument("--fail-at", type=int, nargs="+", default=[8, 20, 32],
                        help="steps a worker dies in (one failure each)")
    parser.add_argument("--mtbf-s", type=float, default=None,
                        help="MTBF for Young's interval (default: the failures' own rate, "
                             "iters x step time / failures)")
    parser.add_argument("--timeout", type=float, default=900.0, help="per job, seconds")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    args = parser.parse_args()
    try:
        for n in args.nproc:
            check_inputs(args.iters, args.fail_at, args.mtbf_s, n)
    except ValueError as exc:
        parser.exit(2, f"bench_vs_restart: error: {exc}\n")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    model = (*gpt(args.layers, args.hidden, args.heads), *layout_flags(args.tp, args.pp))
    print(f"model: {parameters(args.layers, args.hidden) / 1e6:.0f} M parameters; "
          f"TP{args.tp} x PP{args.pp}; failures at {args.fail_at}", flush=True)
    load_before, rows = os.getloadavg()[0], []
    for n in args.nproc:
        with tempfile.TemporaryDirectory() as tmp:
            rows += bench(Job(model, n, args.iters, args.timeout), Path(tmp), args.fail_at,
                          args.mtbf_s)
    print(table(rows))
    for n in args.nproc:
        print(targets([r for r in rows if r["ranks"] == n]))
    print(f"\nload average before/after: {load_before:.1f} / {os.getloadavg()[0]:.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
