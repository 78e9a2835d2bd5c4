"""How an active member takes up the layout a recovery decided: it joins the new world,
then builds megatron's groups and a fresh model and optimizer (a uniform layout) or a plan
runtime under the plan engine (heterogeneous pipelines, rerouting); or, when some state has
no surviving copy, it loads the last checkpoint instead of receiving state."""

from __future__ import annotations

import logging
from typing import Callable

from chameleon_megatron.configurable import ConfigError
from chameleon_megatron.megatron import groups
from chameleon_megatron.resilience.decision.center import RecoveryDecision
from chameleon_megatron.resilience.execution.engine import PlanEngine
from chameleon_megatron.resilience.execution.runtime import PlanRuntime, build_runtime
from chameleon_megatron.resilience.recovery.errors import RecoveryFailed
from chameleon_megatron.resilience.recovery.regroup import Membership, join_world
from chameleon_megatron.resilience.store.job_store import JobStore
from chameleon_megatron.training.plugin import TrainerHandle

logger = logging.getLogger(__name__)


def rebuild(trainer: TrainerHandle, job: JobStore, membership: Membership,
            decision: RecoveryDecision, me: int, *, backend: str, timeout_s: float,
            keepalive: Callable[[], None]) -> PlanRuntime | None:
    """Join the new world and build ``decision``'s layout in ``trainer``; the plan runtime
    it trains through (None: a megatron layout). ``keepalive``: beats before the model is
    built (after a group rendezvous that may have lasted a whole window)."""
    rank, size = decision.active.index(me), len(decision.active)
    join_world(job, membership, rank, size, backend=backend, timeout_s=timeout_s)
    hints = {}
    if me in decision.swap_budgets:  # this stage swaps to fit device memory
        hints["swap_budget_fraction"] = decision.swap_budgets[me]
    if decision.mode == "megatron":
        lay = decision.layout
        groups.build_uniform(lay.tp, lay.pp, timeout_s=timeout_s)
        keepalive()
        trainer.rebuild(tp=lay.tp, pp=lay.pp, rank=rank, world_size=size, hints=hints)
        return None
    runtime = build_runtime(
        trainer.args, decision.plan, me, sync_groups=decision.sync_groups,
        sync_rounds=decision.sync_rounds,
        world={r: k for k, r in enumerate(decision.active)}, reroute=decision.reroute,
        builder=trainer.stage_builder, timeout_s=timeout_s)
    keepalive()
    trainer.use_engine(PlanEngine(runtime, trainer.device),
                       rank=rank, world_size=size, hints=hints)
    return runtime


def load_checkpoint(trainer: TrainerHandle) -> None:
    """The checkpoint fallback: the trainer's state from ``--save`` (or ``--load``)."""
    path = trainer.args.save or trainer.args.load
    try:
        loaded = bool(path) and trainer.load(path)
    except ConfigError as exc:  # a checkpoint of another model: no retry changes that
        raise RecoveryFailed(f"the checkpoint fallback cannot load: {exc}") from None
    if not loaded:
        raise RecoveryFailed(f"some state has no surviving copy and there is no checkpoint "
                             f"to fall back to (--save/--load: {path!r})")
    if trainer.rank == 0:
        logger.warning("some state has no surviving copy: resumed from the checkpoint of "
                       "iteration %d under %s", trainer.iteration, path)
