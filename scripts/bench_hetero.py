"""Training after losing one rank of four: rerouting and re-plans, timed and predicted.

One torchrun job of 4 workers, five cases in turn (each in its own world on the job's
store), all over the same GPT and global batch:

1. megatron: failure-free DP2 x PP2, the trainer (megatron DDP + optimizer), the baseline;
2. plan: the same layout run by the plan runtime (its overhead against 1);
3. reroute: rank 3 dead, its pipeline's last stage rerouted to the peer (3 ranks);
4. replan: rank 3 dead, the planner's best plan for the 3 survivors (the restorer assigns
   the slots; may be heterogeneous), run by the plan runtime;
5. uniform: the planner's best megatron-native plan for the survivors (equal depths and
   shares, which may leave a survivor idle), run by the plan runtime: what a re-plan
   without heterogeneous pipelines gets.

The decision center plans with the runtime profile (``live_profile``: FLOP shares, gloo
link figures) calibrated to case 1's measured step, as a running job would; the same
profile predicts every case. For each case: the build time (groups, model, optimizer; no
state moved) and, per step after a warm-up, the wall time (until the slowest rank ends) and
each rank's CPU time; the best step is reported (the host is shared: the least disturbed
step is the most telling). Ratios are to case 1 in the same run.

    python scripts/bench_hetero.py
    python scripts/bench_hetero.py --layers 8 --hidden 256 --seq 256 --gbs 16 --steps 6
    python scripts/bench_hetero.py --overlap-grad-reduce   # the same, reduces overlapped
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CASE_PLAN = {"megatron": "plan", "plan": "plan", "reroute": "plan", "replan": "replan",
             "uniform": "uniform"}
"""Each case and the plan it trains (a key of ``decide``'s result)."""
CASES = tuple(CASE_PLAN)
DEAD = 3


def trainer_args(a: argparse.Namespace):
    from chameleon_megatron.training.arguments import parse_args
    from chameleon_megatron.training.validate import validate_args

    args = parse_args([
        "--num-layers", str(a.layers), "--hidden-size", str(a.hidden),
        "--num-attention-heads", "4", "--seq-length", str(a.seq), "--vocab-size", "512",
        "--make-vocab-size-divisible-by", "128", "--mock-data", "--micro-batch-size", "1",
        "--global-batch-size", str(a.gbs), "--train-iters", str(a.steps + 1),
        "--pipeline-model-parallel-size", "2", "--hidden-dropout", "0",
        "--attention-dropout", "0",
        *(["--overlap-grad-reduce"] if a.overlap_grad_reduce else [])])
    validate_args(args, 4)
    return args


def decide(args, step_s: float) -> dict:
    """Profile calibrated to the failure-free step, and every case's plan (pure: the same
    on every rank)."""
    from chameleon_megatron.resilience.decision.layout import UniformLayout
    from chameleon_megatron.resilience.decision.planner import Planner, SearchOptions
    from chameleon_megatron.resilience.decision.reroute import plan_reroute
    from chameleon_megatron.resilience.decision.restorer import assign_slots, live_holdings
    from chameleon_megatron.resilience.recovery.live_profile import CPU_GLOO, runtime_profile

    plan = UniformLayout(tp=1, pp=2, dp=2).to_plan(args.num_layers, args.global_batch_size)
    profile = runtime_profile(args, path=None, hardware=CPU_GLOO, plan=plan, step_time_s=step_s,
                              regroup_s=None)
    survivors = [(r,) for r in range(4) if r != DEAD]
    out = {"profile": profile, "plan": plan, "reroute": plan_reroute(plan, [DEAD], profile)}
    for name, options in (("replan", SearchOptions()), ("uniform", SearchOptions(uniform=True))):
        shape = Planner(profile, options).search(len(survivors)).pipelines
        out[name] = assign_slots(shape, survivors, live_holdings(plan, [DEAD]), profile)
    return out


def best_step(ranks: list[dict]) -> tuple[float, float, float]:
    """(wall, busiest rank's CPU, all ranks' CPU) of the least disturbed step."""
    steps = list(zip(*(r["steps"] for r in ranks)))
    return (min(max(s[0] for s in step) for step in steps),
            min(max(s[1] for s in step) for step in steps),
            min(sum(s[1] for s in step) for step in steps))


def worker(out: Path, a: argparse.Namespace) -> int:
    from chameleon_megatron.megatron.platform import CpuPlatform

    CpuPlatform().apply()
    import torch.distributed as dist

    from chameleon_megatron.megatron import groups
    from chameleon_megatron.resilience.decision.placement import stage_major_order

    args = trainer_args(a)
    launch = int(os.environ["RANK"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=datetime.timedelta(seconds=300))
    d: dict = {}
    for name in CASES:
        order = ((0, 1, 2, 3) if name in ("megatron", "plan") else (0, 1, 2)
                 if name == "reroute" else stage_major_order(d[CASE_PLAN[name]]))
        if launch >= len(order):
            continue  # the dead rank sits this case out
        dist.init_process_group("gloo", store=dist.PrefixStore(name, store), rank=launch,
                                world_size=len(order), timeout=datetime.timedelta(seconds=300))
        start = time.perf_counter()
        if name == "megatron":
            step = _trainer_steps(args, launch)
        else:
            step = _plan_steps(args, d[CASE_PLAN[name]], d["reroute"] if name == "reroute"
                               else None, order[launch], dict(zip(order, range(len(order)))),
                               d["profile"])
        build_s = time.perf_counter() - start
        rows = []
        for _ in range(a.steps + 1):
            dist.barrier()
            wall, cpu = time.perf_counter(), time.process_time()
            step()
            rows.append((time.perf_counter() - wall, time.process_time() - cpu))
        ranks: list = [None] * len(order)
        dist.all_gather_object(ranks, {"build_s": build_s, "steps": rows[1:]})
        if name == "megatron":
            d = decide(args, best_step(ranks)[0])
        if launch == 0:
            (out / f"{name}.json").write_text(json.dumps({"ranks": ranks}))
        groups.destroy()
    return 0


def _trainer_steps(args, rank: int):
    from chameleon_megatron.config import config_from_args
    from chameleon_megatron.training.env import DistEnv
    from chameleon_megatron.training.trainer import Trainer

    trainer = Trainer(args, config_from_args(args), [], DistEnv(rank, 4, rank))
    trainer.setup()
    return trainer.train_one


def _plan_steps(args, plan, reroute, me: int, world: dict, profile):
    import torch

    from chameleon_megatron.resilience.execution.runtime import (
        build_runtime, microbatch_source, run_hetero_step,
    )
    from chameleon_megatron.resilience.execution.rerouted import run_reroute_step
    from chameleon_megatron.resilience.decision.restorer import allreduce_groups, allreduce_rounds
    from chameleon_megatron.training import data
    from chameleon_megatron.training.stage_builder import trainer_stages

    rt = build_runtime(args, plan, me, sync_groups=allreduce_groups(plan, profile),
                       sync_rounds=allreduce_rounds(plan, profile), world=world,
                       reroute=reroute, builder=trainer_stages(args), timeout_s=300)
    dataset = data.build_datasets(args).train
    run = run_reroute_step if reroute else run_hetero_step
    consumed = [0]

    def step() -> None:
        run(rt, microbatch_source(dataset, consumed[0], args.micro_batch_size,
                                  torch.device("cpu")))
        consumed[0] += args.global_batch_size
    return step


def report(out: Path, a: argparse.Namespace) -> dict:
    from chameleon_megatron.megatron.platform import CpuPlatform

    CpuPlatform().apply()
    from chameleon_megatron.resilience.decision.perf_model import plan_step

    args = trainer_args(a)
    res = {n: json.loads((out / f"{n}.json").read_text())["ranks"] for n in CASES}
    d = decide(args, best_step(res["megatron"])[0])
    profile = d["profile"]
    plans = {n: d[CASE_PLAN[n]] for n in CASES}
    predicted = {n: plan_step(p, profile).t_step_s for n, p in plans.items()}
    predicted["reroute"] = d["reroute"].estimate(profile).t_step_s
    fig = {}
    for n in CASES:
        wall, busiest, total = best_step(res[n])
        fig[n] = {"plan": plans[n].describe(), "build_s": max(r["build_s"] for r in res[n]),
                  "step_s": wall, "max_rank_cpu_s": busiest, "sum_cpu_s": total,
                  "predicted_s": predicted[n]}
    base = fig["megatron"]
    for f in fig.values():
        f["step_ratio"] = f["step_s"] / base["step_s"]
        f["cpu_ratio"] = f["max_rank_cpu_s"] / base["max_rank_cpu_s"]
        f["predicted_ratio"] = f["predicted_s"] / base["predicted_s"]
    return fig


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--gbs", type=int, default=16, help="global batch (microbatches of 1)")
    p.add_argument("--steps", type=int, default=6, help="measured steps after one warm-up")
    p.add_argument("--overlap-grad-reduce", action="store_true",
                   help="every case reduces gradients during the last backward pass")
    p.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker is not None:
        return worker(a.worker, a)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node=4", __file__, "--worker", tmp, *sys.argv[1:]]
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        subprocess.run(cmd, check=True, cwd=REPO, env=env, timeout=1800)
        fig = report(Path(tmp), a)
    print(json.dumps(fig, indent=1))
    print(f"\n{'case':<9} {'plan':<28} {'build s':>7} {'step s':>7} {'x base':>6} "
          f"{'rank cpu s':>10} {'x base':>6} {'model s':>7} {'x base':>6}")
    for n, f in fig.items():
        print(f"{n:<9} {f['plan']:<28} {f['build_s']:>7.2f} {f['step_s']:>7.3f} "
              f"{f['step_ratio']:>6.2f} {f['max_rank_cpu_s']:>10.3f} {f['cpu_ratio']:>6.2f} "
              f"{f['predicted_s']:>7.3f} {f['predicted_ratio']:>6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
