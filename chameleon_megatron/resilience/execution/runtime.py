"""Training a plan whose pipelines have different depths, layer splits and microbatch shares.

``build_runtime`` gives each rank its stage in megatron's DDP with megatron's optimizer
(``stage_model``), its groups (``plan_groups``) and the per-layer gradient sync
(``grad_sync``). ``run_hetero_step`` runs megatron-core's 1F1B schedule in each pipeline
over the pipeline's own group, with the sync as the schedule's ``finalize_model_grads_func``,
then the optimizer step. The global batch is the failure-free one: global microbatch g holds
samples ``consumed + g * micro ...``, each pipeline runs its share of them
(``microbatch_ids``), and the loss is the sum of per-token losses divided once by the global
token count, so the step computes what the failure-free step computes.

The same runtime, built with a rerouting plan (the kept layout and its dead ranks), serves
rerouting (``rerouted``).
"""

from __future__ import annotations

import argparse
import contextlib
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, ContextManager, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist

from chameleon_megatron.megatron import plan_seams
from chameleon_megatron.resilience.decision.layout import Plan
from chameleon_megatron.resilience.decision.placement import (
    Slot,
    check_plan_runtime,
    microbatch_ids,
    slot_of,
)
from chameleon_megatron.resilience.decision.reroute import ReroutePlan
from chameleon_megatron.resilience.decision.restorer import AllReduceGroup
from chameleon_megatron.resilience.execution.grad_sync import (
    GradSync,
    reduction_device,
    sync_spec,
)
from chameleon_megatron.resilience.execution.plan_groups import PlanGroups, build_plan_groups
from chameleon_megatron.resilience.execution.stage_model import build_stage_model, seed_stage
from chameleon_megatron.resilience.model_state import unwrap
from chameleon_megatron.training import data
from chameleon_megatron.training.stage_builder import ForwardStep, StageBuilder
from chameleon_megatron.training.step import Applied, StepResult, share_loss

Batches = Callable[[int], dict]
"""Global microbatch index of the step -> its batch (tokens, labels, loss_mask, position_ids)."""


def microbatch_source(dataset: Any, consumed: int, micro: int, device: torch.device) -> Batches:
    """The batches of the step that starts after ``consumed`` samples (training.data's order)."""
    def batch(g: int) -> dict:
        return next(data.step_iterator(dataset, consumed + g * micro, micro=micro, dp=1,
                                       dp_rank=0, num_microbatches=1, device=device))
    return batch


@contextlib.contextmanager
def _in_stage(builder: StageBuilder, *, stage: int, depth: int,
              groups: PlanGroups) -> Iterator[None]:
    """Megatron's parallel state and the job's arguments as stage ``stage`` of a pipeline
    of ``depth`` sees them."""
    with plan_seams.stage_view(stage=stage, depth=depth, tp=groups.tp, cp=groups.solo), \
            builder.arguments(depth):
        yield


def stage_forward_step(forward_step: ForwardStep,
                       view: Callable[[], ContextManager[None]]) -> ForwardStep:
    """The job's ``forward_step`` and the loss function it returns, each run in ``view``
    (the stage's view of megatron's parallel state and of the job's arguments)."""
    def step(data_iterator: Iterator[dict], model: torch.nn.Module):
        with view():
            output, loss = forward_step(data_iterator, model)

        def loss_in_view(output_tensor: torch.Tensor):
            with view():
                return loss(output_tensor)
        return output, loss_in_view
    return step


@dataclass
class PlanRuntime:
    """What one rank needs to train its slot of a plan."""

    args: argparse.Namespace
    plan: Plan
    me: int
    """This rank's id in the plan."""
    reroute: ReroutePlan | None
    """The rerouting this runtime executes (None: the plan's pipelines run whole)."""
    model: torch.nn.Module
    """This rank's stage: megatron-core's ``GPTModel`` (with bf16, in ``Float16Module``)."""
    parts: list[Any]
    """Its parameters in megatron's DDP, one per part (``stage_model``)."""
    optimizer: Any
    """megatron's optimizer over ``parts``, stepped with the plan's norm (``apply_update``)."""
    sync: GradSync
    groups: PlanGroups
    p2p: Any
    """megatron's communicator over this rank's pipeline (None: depth 1 or rerouting)."""
    forward_step: ForwardStep
    """The job's forward step, in this stage's view of megatron's parallel state."""

    @property
    def gpt(self) -> torch.nn.Module:
        """The ``GPTModel`` inside the wrappers."""
        return unwrap(self.model)

    @property
    def slot(self) -> Slot:
        return self.groups.slot

    def unit_sharers(self) -> tuple[int, ...]:
        """The live ranks holding any of this rank's units at its TP index (this one too):
        the distributed optimizer shards each unit over some of them."""
        held = self.plan.holdings()
        index, mine = held[self.me]
        dead = set(self.reroute.stopped_ranks if self.reroute else ())
        return tuple(sorted(r for r, (i, units) in held.items()
                            if i == index and r not in dead and set(units) & set(mine)))

    def schedule_groups(self) -> Any:
        return plan_seams.stage_groups(self.groups.solo, self.groups.tp, self.groups.pipeline)


def build_runtime(args: argparse.Namespace, plan: Plan, me: int, *,
                  sync_groups: Sequence[AllReduceGroup], sync_rounds: Sequence[Sequence[int]],
                  world: Mapping[int, int], reroute: ReroutePlan | None = None,
                  builder: StageBuilder, timeout_s: float) -> PlanRuntime:
    """Groups, stage model, sync, optimizer. The stage is seeded as the trainer seeds its
    stages and gets megatron's random init: load the real state (and RNG streams) next.

    ``sync_groups``/``sync_rounds``: the restorer's all-reduce groups and DSATUR rounds for
    ``plan`` (``RestorePlan.groups``/``.rounds``, or ``restorer.allreduce_groups`` and
    ``allreduce_rounds``); ``world``: plan rank -> world rank of every live rank (for a
    heterogeneous plan in ``stage_major_order``); ``reroute``: the rerouting plan of ``plan``
    when its dead ranks' work is rerouted; ``builder``: how the job builds its model.
    Collective over the world."""
    check_plan_runtime(args, plan)
    plan_seams.check_plan_seams()
    if reroute is not None and reroute.plan != plan:
        raise ValueError("the rerouting plan is for another plan than the one given")
    dead = frozenset(reroute.stopped_ranks if reroute else ())
    spec = sync_spec(plan, sync_groups, sync_rounds, dead=dead,
                     tied=not args.untie_embeddings_and_output_weights)
    seed_stage(args.seed, slot_of(plan, me))
    groups = build_plan_groups(plan, me, spec, world=world, pipelines=reroute is None,
                               host=args.use_distributed_optimizer, timeout_s=timeout_s)
    model, parts, optimizer = build_stage_model(args, plan, groups, builder)
    sync = GradSync(unwrap(model), spec, me, groups.rounds, groups.tied,
                    tp_index=groups.slot.tp_index, overlap=args.overlap_grad_reduce,
                    tp=groups.tp if plan.tp > 1 else None)
    model.config.finalize_model_grads_func = sync
    model.config.no_sync_func = sync.no_sync if args.overlap_grad_reduce else None
    model.config.grad_scale_func = None
    if reroute is not None:
        # rerouted steps batch their messages over the world group (``rerouted``); a batch
        # that is a group's first NCCL call must involve all its ranks, a collective does
        dist.all_reduce(torch.zeros(1, device=reduction_device()))
    depth = plan.pipelines[groups.slot.pipeline].depth
    p2p = (plan_seams.p2p_communicator(groups.pipeline, model.config)
           if reroute is None and depth > 1 else None)
    view = partial(_in_stage, builder, stage=groups.slot.stage, depth=depth, groups=groups)
    return PlanRuntime(args=args, plan=plan, me=me, reroute=reroute, model=model, parts=parts,
                       optimizer=optimizer, sync=sync, groups=groups, p2p=p2p,
                       forward_step=stage_forward_step(builder.forward_step, view))


def run_hetero_step(rt: PlanRuntime, batches: Batches) -> StepResult:
    """One training step of ``rt.plan`` with its loss (see ``hetero_train``)."""
    return step_result(hetero_train(rt, batches))


def hetero_train(rt: PlanRuntime, batches: Batches) -> Applied:
    """This rank's pipeline runs megatron's 1F1B over its microbatches, gradients are synced
    per layer, the optimizer steps. The LR scheduler is the caller's (as in the trainer)."""
    if rt.reroute is not None:
        raise ValueError("this runtime reroutes: train it with rerouted.reroute_train")
    zero_grads(rt)
    return apply_update(rt, _pipeline_schedule(rt, batches, forward_only=False))


@torch.no_grad()
def hetero_eval(rt: PlanRuntime, batches: Batches) -> tuple[float | None, int]:
    """Forward only over the plan's microbatches: global loss per token and token count."""
    rt.model.eval()
    try:
        reports = _pipeline_schedule(rt, batches, forward_only=True)
    finally:
        rt.model.train()
    return share_loss(reports)


def _pipeline_schedule(rt: PlanRuntime, batches: Batches, *, forward_only: bool) -> list[dict]:
    ids = microbatch_ids(rt.plan)[rt.slot.pipeline]
    depth = rt.plan.pipelines[rt.slot.pipeline].depth
    return plan_seams.pipeline_schedule(depth)(
        forward_step_func=rt.forward_step, data_iterator=(batches(g) for g in ids),
        model=rt.model, num_microbatches=len(ids), seq_length=rt.args.seq_length,
        micro_batch_size=rt.args.micro_batch_size, forward_only=forward_only,
        p2p_communicator=rt.p2p, pg_collection=rt.schedule_groups(),
    )


def zero_grads(rt: PlanRuntime) -> None:
    """Clear the main-gradient buffers before a step, as the trainer does."""
    for part in rt.parts:
        part.zero_grad_buffer()
    rt.optimizer.zero_grad()
    rt.sync.reset()


def apply_update(rt: PlanRuntime, reports: list[dict]) -> Applied:
    """The optimizer step (gradients already synced), clipped by the plan's global norm."""
    applied, norm = plan_seams.step_with_norm(rt.optimizer, rt.args.clip_grad,
                                              rt.sync.grad_norm)
    return Applied(reports=reports, grad_norm=norm, skipped=not applied)


def step_result(applied: Applied) -> StepResult:
    loss, tokens = share_loss(applied.reports)
    return StepResult(loss=loss, tokens=tokens, grad_norm=applied.grad_norm,
                      skipped=applied.skipped)
