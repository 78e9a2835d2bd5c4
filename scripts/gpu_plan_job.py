"""The worker of the plan checks of ``gpu_checks.py`` (one rank; launched by torchrun).

    torchrun --standalone --nproc-per-node=N scripts/gpu_plan_job.py OUT --mode MODE
        [--dry-run] [--break]

Every rank shares GPU 0 (gloo, CUDA tensors); ``--dry-run``: the CPU. Each rank writes
``OUT/rank<R>.json``; ``gpu_checks.py`` judges them.

* ``grad_sync``: N depth-1 pipelines, bf16, two steps with the synchronous gradient sync,
  then the same two steps from the same weights with the overlapped one (``GradSync`` with
  ``overlap``). Reports whether losses, gradient norms, main gradients and parameters are
  bitwise equal, and how many groups started early. ``--break``: the overlapped sync starts
  each group's all-reduce at its first ready gradient, not its last.
* ``failover``: N depth-1 pipelines, fp32: the failure-free run, then the same job in which
  the last rank exits after the first step and the survivors regroup, copy their state into
  a rerouting runtime (the restorer's executor) and run its microbatches. Reports every
  step's loss of both runs, and device memory: the steady state (one step after warm-up)
  and the recovery (regroup, new runtime, state copy, old runtime released).
  ``--break`` with ``--defect drop``: the dead rank's microbatches count no tokens;
  ``--defect hold``: the old runtime is kept alive after the recovery.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TIMEOUT_S = 120
ARGV = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "64", "--vocab-size", "128", "--make-vocab-size-divisible-by", "32",
        "--mock-data", "--micro-batch-size", "1", "--lr", "1e-3", "--hidden-dropout", "0",
        "--attention-dropout", "0"]
STEPS = 3


def parse(nproc: int, bf16: bool, steps: int) -> argparse.Namespace:
    from chameleon_megatron.training.arguments import parse_args
    from chameleon_megatron.training.validate import validate_args

    argv = [*ARGV, "--global-batch-size", str(2 * nproc), "--train-iters", str(steps),
            *(["--bf16"] if bf16 else [])]
    args = parse_args(argv)
    validate_args(args, 1)
    return args


def profile_for(args: argparse.Namespace) -> Any:
    """Uniform costs: the groups, rounds and rerouting only need the plan's shape."""
    from chameleon_megatron.resilience.decision.profile import LayerCost, Profile

    layer = LayerCost(forward_s=1.0, backward_s=2.0, param_bytes=1.0, optimizer_bytes=2.0,
                      activation_bytes=1.0)
    zero = LayerCost(0.0, 0.0, 0.0, 0.0, 0.0)
    return Profile(name="uniform", tp=1, micro_batch_size=args.micro_batch_size,
                   global_batch_size=args.global_batch_size, layers=(layer,) * args.num_layers,
                   embedding=zero, output=zero, boundary_bytes=0.0, device_memory_bytes=1e15,
                   p2p_bandwidth_Bps=1.0, allreduce_bandwidth_Bps=1e12,
                   transfer_bandwidth_Bps=1.0)


def depth_one_plan(args: argparse.Namespace, nproc: int) -> Any:
    from chameleon_megatron.resilience.decision.layout import UniformLayout

    return UniformLayout(tp=1, pp=1, dp=nproc).to_plan(
        args.num_layers, args.global_batch_size // args.micro_batch_size)


class Job:
    """One rank: its store, device, arguments and data."""

    def __init__(self, args: argparse.Namespace, nproc: int, dry_run: bool) -> None:
        import torch
        import torch.distributed as dist

        from chameleon_megatron.training import data

        self.args, self.nproc = args, nproc
        self.launch = int(os.environ["RANK"])
        self.device = torch.device("cpu" if dry_run else "cuda", 0)
        self.store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                   is_master=False,
                                   timeout=datetime.timedelta(seconds=TIMEOUT_S))
        self.datasets = data.build_datasets(args)
        self.plan = depth_one_plan(args, nproc)
        self.profile = profile_for(args)

    def world(self, name: str, live: list[int]) -> None:
        import torch.distributed as dist

        dist.init_process_group("gloo", store=dist.PrefixStore(name, self.store),
                                rank=live.index(self.launch), world_size=len(live),
                                timeout=datetime.timedelta(seconds=TIMEOUT_S))

    def batches(self, step: int) -> Callable[[int], dict]:
        from chameleon_megatron.resilience.execution.runtime import microbatch_source

        a = self.args
        return microbatch_source(self.datasets.train, step * a.global_batch_size,
                                 a.micro_batch_size, self.device)


# ------------------------------------------------------------------- the library calls
def plan_runtime(job: Job, live: list[int], *, overlap: bool = False,
                 dead: tuple[int, ...] = ()) -> Any:
    """The plan's runtime on this rank (collective over the current world): whole
    pipelines, or with ``dead`` ranks their microbatches rerouted."""
    from chameleon_megatron.resilience.decision.reroute import plan_reroute
    from chameleon_megatron.resilience.decision.restorer import allreduce_groups, allreduce_rounds
    from chameleon_megatron.resilience.execution.runtime import build_runtime
    from chameleon_megatron.training.stage_builder import trainer_stages

    args = argparse.Namespace(**{**vars(job.args), "overlap_grad_reduce": overlap})
    reroute = plan_reroute(job.plan, dead, job.profile) if dead else None
    return build_runtime(args, job.plan, job.launch,
                         sync_groups=allreduce_groups(job.plan, job.profile),
                         sync_rounds=allreduce_rounds(job.plan, job.profile),
                         world={r: k for k, r in enumerate(live)}, reroute=reroute,
                         builder=trainer_stages(args), timeout_s=TIMEOUT_S)


def train_step(rt: Any, batches: Callable[[int], dict]) -> Any:
    from chameleon_megatron.resilience.execution.rerouted import run_reroute_step
    from chameleon_megatron.resilience.execution.runtime import run_hetero_step

    return (run_reroute_step if rt.reroute is not None else run_hetero_step)(rt, batches)


def copy_in_place(job: Job, live: list[int], dead: tuple[int, ...], old: Any, new: Any) -> None:
    """Each survivor's units from its old runtime into its new one, as the controller moves
    them when it keeps the layout (the restorer's executor, local copies)."""
    import torch.distributed as dist

    from chameleon_megatron.megatron.groups import unregistered_gloo_group
    from chameleon_megatron.resilience.decision.placement import kept_in_place
    from chameleon_megatron.resilience.model_state import ModelState
    from chameleon_megatron.resilience.recovery.transfer import migrate

    group = unregistered_gloo_group(dist.PrefixStore("recovery", job.store),
                                    live.index(job.launch), len(live), timeout_s=TIMEOUT_S)
    migrate(group, live, job.launch, kept_in_place(job.plan, dead),
            old=ModelState([old.model], old.optimizer, role="source"),
            new=ModelState([new.model], new.optimizer, role="sink"),
            store=dist.PrefixStore("migrate", job.store), timeout_s=TIMEOUT_S)


def launch_at_first_ready_gradient(sync: Any) -> None:
    """The ``grad_sync`` defect: each group's all-reduce starts as soon as one of its
    gradients is ready, before the others are final."""
    real = sync.reset

    def reset() -> None:
        real()
        for waiting in sync._waiting:
            waiting.clear()

    sync.reset = reset
    sync.reset()


# ------------------------------------------------------------------------------- modes
def grad_sync(job: Job, broken: bool) -> dict[str, Any]:
    import torch

    from chameleon_megatron.megatron import groups

    live = list(range(job.nproc))
    runs = {}
    for overlap in (False, True):
        job.world(f"overlap{int(overlap)}", live)
        rt = plan_runtime(job, live, overlap=overlap)
        if overlap and broken:
            launch_at_first_ready_gradient(rt.sync)
        losses, norms, early = [], [], []
        for step in range(STEPS):
            result = train_step(rt, job.batches(step))
            losses.append(result.loss)
            norms.append(result.grad_norm)
            early.append(rt.sync.early)
        tensors = [t.detach().float().cpu().clone() for p in rt.model.parameters()
                   for t in (p, p.main_grad)]
        runs[overlap] = (losses, norms, early, tensors)
        groups.destroy()
        del rt
    (l0, n0, _, t0), (l1, n1, early, t1) = runs[False], runs[True]
    differ = sum(not torch.equal(a, b) for a, b in zip(t0, t1))
    return {"losses": l0, "overlapped_losses": l1, "grad_norms": n0,
            "overlapped_grad_norms": n1, "early_groups": early, "tensors": len(t0),
            "tensors_differing": differ,
            "bitwise_equal": l0 == l1 and n0 == n1 and differ == 0 and len(t0) == len(t1)}


def memory(device: Any) -> tuple[int, int]:
    """(allocated now, high-water mark since the last reset) on ``device``; zeros on CPU."""
    import torch

    if device.type != "cuda":
        return 0, 0
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device)


def reset_peak(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def failover(job: Job, defect: str | None) -> dict[str, Any]:
    from chameleon_megatron.megatron import groups
    from chameleon_megatron.resilience.decision.placement import microbatch_ids

    live = list(range(job.nproc))
    dead = (job.nproc - 1,)
    rec: dict[str, Any] = {"rank": job.launch, "dead": list(dead)}
    # the failure-free run, and the steady state's memory (a step after warm-up)
    job.world("reference", live)
    rt = plan_runtime(job, live)
    rec["reference_losses"] = []
    for step in range(STEPS):
        if step == 1:
            rec["steady_resident_bytes"], _ = memory(job.device)
            reset_peak(job.device)
        rec["reference_losses"].append(train_step(rt, job.batches(step)).loss)
        if step == 1:
            _, rec["steady_peak_bytes"] = memory(job.device)
    groups.destroy()
    del rt
    gc.collect()
    # the same job; the last rank leaves after the first step
    job.world("before", live)
    old = plan_runtime(job, live)
    rec["losses"] = [train_step(old, job.batches(0)).loss]
    if job.launch in dead:
        return rec  # the caller writes it and exits at once: a dead peer from now on
    groups.destroy()
    survivors = [r for r in live if r not in dead]
    reset_peak(job.device)
    job.world("after", survivors)
    new = plan_runtime(job, survivors, dead=dead)
    copy_in_place(job, survivors, dead, old, new)
    held = [old] if defect == "hold" else []
    rec["extra_copy_held"] = bool(held)
    del old
    gc.collect()
    rec["recovery_resident_bytes"], rec["recovery_peak_bytes"] = memory(job.device)
    dropped = set(microbatch_ids(job.plan)[dead[0]]) if defect == "drop" else set()
    rec["dropped_microbatches"] = sorted(dropped)
    for step in range(1, STEPS):
        rec["losses"].append(train_step(new, drop(job.batches(step), dropped)).loss)
    groups.destroy()
    return rec


def drop(batches: Callable[[int], dict], ids: set[int]) -> Callable[[int], dict]:
    """The ``failover`` defect: the given global microbatches count no tokens."""
    def batch(g: int) -> dict:
        b = batches(g)
        if g in ids:
            b = {**b, "loss_mask": b["loss_mask"] * 0}
        return b
    return batch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--mode", required=True, choices=["grad_sync", "failover"])
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--break", dest="broken", action="store_true")
    ap.add_argument("--defect", choices=["drop", "hold"], default=None)
    a = ap.parse_args()
    import torch

    if a.dry_run:
        from chameleon_megatron.megatron.platform import CpuPlatform

        CpuPlatform().apply()
    else:
        torch.cuda.set_device(0)
    nproc = int(os.environ["WORLD_SIZE"])
    args = parse(nproc, bf16=a.mode == "grad_sync", steps=STEPS)
    job = Job(args, nproc, a.dry_run)
    rec = grad_sync(job, a.broken) if a.mode == "grad_sync" else failover(
        job, a.defect if a.broken else None)
    (a.out / f"rank{job.launch}.json").write_text(json.dumps(rec, default=str))
    if a.mode == "failover" and job.launch in rec["dead"]:
        os._exit(0)  # no clean-up: its peers see it gone
    return 0


if __name__ == "__main__":
    sys.exit(main())
