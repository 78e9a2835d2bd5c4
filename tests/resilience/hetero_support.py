"""Shared by the rt_hetero and rt_reroute tests: the failure-free reference, a plan's worker,
launching and comparing. The reference is the trainer itself (megatron DDP, megatron's
optimizer, megatron's parallel state) in a world of one process, run by launch rank 0 before
it joins the plan's world; the plan's ranks start from its initial weights.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))
from dist_utils import run_command  # noqa: E402
from rt_support import guard_worker, worker_env  # noqa: E402

pytestmark = pytest.mark.timeout(30)

ITERATIONS = 2
ARGV = [
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--vocab-size", "128", "--make-vocab-size-divisible-by", "32",
    "--mock-data", "--micro-batch-size", "1", "--global-batch-size", "10", "--lr", "1e-3",
    "--train-iters", str(ITERATIONS), "--hidden-dropout", "0", "--attention-dropout", "0",
]
"""10 microbatches of one sample; clipping (1.0) and linear LR decay as the trainer's default."""


def launch(script: str, nproc: int, out: Path, timeout_s: float) -> None:
    """Run ``script out`` on ``nproc`` ranks under torchrun; raises with the log on failure."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", script, str(out)]
    run_command(cmd, timeout=timeout_s, env=worker_env(), log=out / "log")


def parse(num_layers: int = 4):
    from chameleon_megatron.training.arguments import parse_args
    from chameleon_megatron.training.validate import validate_args

    argv = list(ARGV)
    argv[argv.index("--num-layers") + 1] = str(num_layers)
    args = parse_args(argv)
    validate_args(args, 1)
    return args


def unit_tensors(model: list, what: Callable) -> dict:
    from chameleon_megatron.resilience.model_state import unit_parameters

    return {u: {n: what(p).detach().clone() for n, p in params.items()}
            for u, params in unit_parameters(model).items()}


def reference(args, out: Path) -> None:
    """The failure-free run in a world of one; writes reference.pt (initial state too)."""
    import torch
    import torch.distributed as dist

    from chameleon_megatron.config import config_from_args
    from chameleon_megatron.megatron import groups
    from chameleon_megatron.resilience.model_state import ModelState
    from chameleon_megatron.training.env import DistEnv
    from chameleon_megatron.training.trainer import Trainer

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    trainer = Trainer(args, config_from_args(args), [], DistEnv(0, 1, 0))
    trainer.setup()
    source = ModelState(trainer.model, trainer.optimizer, role="source")
    init = {u: source.tensors(u, "params") for u in source.units()}
    init = {u: {n: t.clone() for n, t in ts.items()} for u, ts in init.items()}
    rec = {"init": init, "loss": [], "grad_norm": []}
    for it in range(ITERATIONS):
        r = trainer.train_one()
        rec["loss"].append(r["loss"])
        rec["grad_norm"].append(r["grad_norm"])
        if it == 0:
            rec["grads"] = unit_tensors(trainer.model, lambda p: p.main_grad)
    rec["params"] = unit_tensors(trainer.model, lambda p: p)
    rec["adam"] = adam_state(trainer.model, trainer.optimizer)
    groups.destroy()
    torch.save(rec, out / "reference.pt")


@dataclass(frozen=True)
class Scenario:
    name: str
    plan: Any
    step: Callable
    """step(runtime, batches) -> StepResult"""
    reroute: Any = None
    """The ReroutePlan of ``plan``, if its dead ranks' work is rerouted."""
    overlap: bool = False
    """--overlap-grad-reduce: each group's all-reduce starts during the last backward."""
    distributed: bool = False
    """--use-distributed-optimizer: each part of a stage is sharded over its holders."""
    trainer_steps: int = 0
    """Steps the trainer runs first on ``plan`` (a uniform layout, all ranks alive); then
    the dead ranks leave and the survivors switch to the plan runtime with their own state
    (launch rank = plan rank). Without: the plan's live ranks start from the reference's
    initial state (launch rank k = k-th live plan rank)."""


def plan_worker(out: Path, scenarios: Callable[[], list[Scenario]]) -> int:
    """Launch rank 0 first runs the reference, then every scenario runs in turn, each in
    worlds of its own on the job's store; rank files go to ``out/<scenario>/``."""
    guard_worker(170)
    from chameleon_megatron.megatron.platform import CpuPlatform

    CpuPlatform().apply()
    import torch
    import torch.distributed as dist

    from chameleon_megatron.megatron import groups
    from chameleon_megatron.resilience.execution.runtime import build_runtime, microbatch_source
    from chameleon_megatron.resilience.decision.restorer import allreduce_groups, allreduce_rounds
    from chameleon_megatron.training import data
    from chameleon_megatron.training.optim import build_scheduler
    from chameleon_megatron.training.stage_builder import trainer_stages
    from dc_helpers import make_profile

    args = parse(scenarios()[0].plan.num_layers)
    launch = int(os.environ["RANK"])
    if launch == 0:
        reference(args, out)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=datetime.timedelta(seconds=60))
    profile = make_profile(args.num_layers, gbs=args.global_batch_size)
    for sc in scenarios():
        rec: dict[str, Any] = {"loss": [], "grad_norm": [], "rounds": []}
        old = _trainer_phase(sc, launch, store, rec) if sc.trainer_steps else None
        dead = set(sc.reroute.failed_ranks if sc.reroute else ())
        live = sorted(r for r in sc.plan.ranks() if r not in dead)
        me = (launch if launch in live else None) if sc.trainer_steps else (
            live[launch] if launch < len(live) else None)
        if me is None:
            continue  # a dead rank: it sits the rest of this scenario out
        dist.init_process_group("gloo", store=dist.PrefixStore(f"{sc.name}/after", store),
                                rank=live.index(me), world_size=len(live),
                                timeout=datetime.timedelta(seconds=60))
        staged = argparse.Namespace(**{**vars(args), "overlap_grad_reduce": sc.overlap,
                                       "use_distributed_optimizer": sc.distributed})
        rt = build_runtime(
            staged, sc.plan, me, sync_groups=allreduce_groups(sc.plan, profile),
            sync_rounds=allreduce_rounds(sc.plan, profile),
            world={r: k for k, r in enumerate(live)}, reroute=sc.reroute,
            builder=trainer_stages(staged), timeout_s=60)
        scheduler = build_scheduler(args, rt.optimizer)
        if old is None:
            load_units(rt.model, torch.load(out / "reference.pt")["init"])
        else:
            _move_in_place(sc, me, live, old, rt, store)
            scheduler.load_state_dict(old[2].state_dict())  # fresh + loaded = the old count
        datasets = data.build_datasets(args)
        for it in range(sc.trainer_steps, ITERATIONS):
            batches = microbatch_source(datasets.train, it * args.global_batch_size,
                                        args.micro_batch_size, torch.device("cpu"))
            result = sc.step(rt, batches)
            scheduler.step(increment=args.global_batch_size)
            rec["loss"].append(result.loss)
            rec["grad_norm"].append(result.grad_norm)
            rec["rounds"].append(list(rt.sync.performed))
            rec.setdefault("early", []).append(rt.sync.early)
            if it == 0:
                rec["grads"] = unit_tensors([rt.model], lambda p: p.main_grad)
        rec["params"] = unit_tensors([rt.model], lambda p: p)
        rec["adam"] = (shard_state if sc.distributed else adam_state)([rt.model], rt.optimizer)
        (out / sc.name).mkdir(exist_ok=True)
        torch.save(rec, out / sc.name / f"rank{me}.pt")
        groups.destroy()
    return 0


def _trainer_phase(sc: Scenario, launch: int, store, rec: dict):
    """The failure-free trainer on the plan's layout for ``sc.trainer_steps`` steps; returns
    this rank's (model, optimizer, scheduler), kept after its groups are gone."""
    import torch.distributed as dist

    from chameleon_megatron.config import config_from_args
    from chameleon_megatron.megatron import groups
    from chameleon_megatron.training.arguments import parse_args
    from chameleon_megatron.training.env import DistEnv
    from chameleon_megatron.training.trainer import Trainer
    from chameleon_megatron.training.validate import validate_args

    size = len(sc.plan.ranks())
    depth = sc.plan.pipelines[0].depth
    args = parse_args(ARGV + ["--pipeline-model-parallel-size", str(depth)])
    validate_args(args, size)
    dist.init_process_group("gloo", store=dist.PrefixStore(f"{sc.name}/before", store),
                            rank=launch, world_size=size, timeout=datetime.timedelta(seconds=60))
    trainer = Trainer(args, config_from_args(args), [], DistEnv(launch, size, 0))
    trainer.setup()  # layout-independent init: the reference's initial weights
    for it in range(sc.trainer_steps):
        r = trainer.train_one()
        rec["loss"].append(r["loss"])
        rec["grad_norm"].append(r["grad_norm"])
        if it == 0:
            rec["grads"] = unit_tensors(trainer.model, lambda p: p.main_grad)
    groups.destroy()
    return trainer.model, trainer.optimizer, trainer.scheduler


def _move_in_place(sc: Scenario, me: int, live: list, old, rt, store) -> None:
    """Rerouting's transition as the controller runs it: the restorer's executor with a
    transfer list of local copies, from the trainer's model into the runtime's."""
    import torch.distributed as dist

    from chameleon_megatron.megatron.groups import unregistered_gloo_group
    from chameleon_megatron.resilience.decision.placement import kept_in_place
    from chameleon_megatron.resilience.model_state import ModelState
    from chameleon_megatron.resilience.recovery.transfer import migrate

    group = unregistered_gloo_group(dist.PrefixStore(f"{sc.name}/recovery", store),
                                    live.index(me), len(live), timeout_s=60)
    migrate(group, live, me, kept_in_place(sc.plan, sc.reroute.failed_ranks),
            old=ModelState(old[0], old[1], role="source"),
            new=ModelState([rt.model], rt.optimizer, role="sink"),
            store=dist.PrefixStore(f"{sc.name}/migrate", store), timeout_s=60)


def adam_state(model: list, optimizer) -> dict:
    """Adam's moments and step count by unit, read as the restorer's executor reads them
    (the one-process model also offers its embedding's state as the tied output's)."""
    from chameleon_megatron.resilience.model_state import ModelState

    view = ModelState(model, optimizer, role="source")
    return {u: {n: t.clone() for n, t in view.tensors(u, "optimizer").items()}
            for u in view.units()}


def shard_state(model: list, optimizer) -> dict:
    """A distributed optimizer's pieces: (unit, name, start, end, numel of the whole) ->
    the piece's fp32 main elements and optimizer state."""
    from chameleon_megatron.resilience.dist_opt import owned

    return {(o.piece.unit, o.piece.name, o.piece.start, o.piece.end, o.param.numel()):
            {"main": o.main.detach().clone(),
             **{k: v.detach().clone() for k, v in o.state.items()}}
            for o in owned(model, optimizer)}


def load_units(model, state: dict) -> None:
    """Copy each of the model's tensors from ``state`` (unit -> name -> tensor)."""
    import torch

    from chameleon_megatron.resilience.model_state import unit_parameters

    with torch.no_grad():
        for unit, params in unit_parameters([model]).items():
            for name, param in params.items():
                param.copy_(state[unit][name])


TOL = 1e-5
STATE_TOL = 5e-5
"""Parameters and Adam state after the last step: Adam turns the reduction-order noise of
small gradients into relative changes of whole steps. Measured 1.85e-5 (an MLP bias, the
unequal-shares plan) on a machine where the same code had passed 1e-5 before: the kernels'
rounding differs between machines. Losses, gradient norms and gradients keep ``TOL``."""
"""Relative error (norm of the difference / norm) allowed: the reduction order differs."""
NOISE = 1e-6
"""Gradient entries below this fraction of their tensor's largest are rounding noise."""


def rel_err(got, want) -> float:
    return float((got - want).norm() / max(float(want.norm()), 1e-30))


def assert_same_state(got: dict, want: dict, who: str) -> None:
    """Gradients of step 1, parameters and Adam state after the last step, unit by unit.

    Parameters are compared where the gradient is not rounding noise: the key bias of
    attention has an exactly zero gradient (softmax ignores a constant per query), so its
    entries carry ~1e-12 of noise that Adam scales up to a full step of either sign."""
    for unit, tensors in got["grads"].items():
        for name, t in tensors.items():
            ref = want["grads"][_ref_unit(unit, name)][_ref_name(unit, name)]
            assert rel_err(t, ref) <= TOL, (who, "grad", unit, name, rel_err(t, ref))
    for unit, tensors in got["params"].items():
        for name, t in tensors.items():
            key = _ref_unit(unit, name), _ref_name(unit, name)
            ref, grad = want["params"][key[0]][key[1]], want["grads"][key[0]][key[1]]
            real = grad.abs() > NOISE * grad.abs().max()
            assert real.float().mean() > 0.5, (who, unit, name)
            assert rel_err(t[real], ref[real]) <= STATE_TOL, (who, "param", unit, name,
                                                              rel_err(t[real], ref[real]))
            for key in ("exp_avg", "exp_avg_sq"):  # the optimizer state took the same steps
                got_m, want_m = got["adam"][unit][f"{name}/{key}"], want["adam"][unit][
                    f"{name}/{key}"]
                assert rel_err(got_m[real], want_m[real]) <= STATE_TOL, (who, key, unit, name)
            assert got["adam"][unit][f"{name}/step"] == want["adam"][unit][f"{name}/step"]


def _ref_unit(unit, name):
    """The one-process model ties its output weight to the embedding."""
    return "embedding" if (unit, name) == ("output", "output_layer.weight") else unit


def _ref_name(unit, name):
    return "word_embeddings.weight" if (unit, name) == ("output", "output_layer.weight") else name
