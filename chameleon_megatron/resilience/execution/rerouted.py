"""One training step with data rerouting: the layout kept, a failed stage's microbatches run
by its healthy same-stage peers in other pipelines.

Runs this rank's program of the routed schedule (``reroute_program``) on a runtime built
with the rerouting plan (``runtime.build_runtime(..., reroute=...)``); no state moves, every
survivor keeps its stage. Each op uses megatron-core's own ``forward_step`` and
``backward_step`` (looked up at call time, so the swap seams wrap them here too);
activations and gradients travel between the ranks of each microbatch's route in the
program's batches of point-to-point messages over the world group (``batch_isend_irecv``:
deadlock-free on NCCL, whose sends are not buffered). A received tensor is waited for only
when an op uses it (on NCCL the wait orders the streams and the host runs on; gloo, with a
work per message, waits for that message alone). Then the
per-layer gradient sync over the live holders, and the optimizer step: the same computation
as the failure-free step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from chameleon_megatron.megatron import groups, plan_seams
from chameleon_megatron.resilience.decision.placement import microbatch_ids
from chameleon_megatron.resilience.decision.reroute_program import (
    Exchange,
    Step,
    forward_only,
    rank_program,
)
from chameleon_megatron.resilience.decision.reroute_schedule import Op
from chameleon_megatron.resilience.execution.runtime import (
    Batches,
    PlanRuntime,
    apply_update,
    step_result,
    zero_grads,
)
from chameleon_megatron.training.step import Applied, StepResult, share_loss


def rerouted_program(rt: PlanRuntime) -> tuple[Step, ...]:
    """This rank's steps (ops and message batches) of the step, in order (plan rank ids)."""
    if rt.reroute is None:
        raise ValueError("this runtime runs whole pipelines: train it with run_hetero_step")
    return rank_program(rt.plan, rt.reroute, microbatch_ids(rt.plan), rt.me)


def run_reroute_step(rt: PlanRuntime, batches: Batches) -> StepResult:
    """One step of the kept plan without its dead ranks, with its loss."""
    return step_result(reroute_train(rt, batches))


def reroute_train(rt: PlanRuntime, batches: Batches) -> Applied:
    """Forward, backward, gradient sync and optimizer step (see the module docstring)."""
    program = rerouted_program(rt)
    zero_grads(rt)
    runner = _Runner(rt, batches)
    last = max((k for k, step in enumerate(program)
                if isinstance(step, Op) and step.kind == "B"), default=len(program))
    with rt.sync.no_sync():  # gradients are final in the last backward only
        for step in program[:last]:
            runner.run(step)
    for step in program[last:]:
        runner.run(step)
    runner.drain()
    rt.sync([rt.gpt], runner.tokens)
    return apply_update(rt, runner.reports)


@torch.no_grad()
def reroute_eval(rt: PlanRuntime, batches: Batches) -> tuple[float | None, int]:
    """Forward only along the same routes: the forward ops and activation messages of the
    step's program (``reroute_program.forward_only``)."""
    runner = _Runner(rt, batches, keep=False)
    rt.model.eval()
    try:
        for step in forward_only(rerouted_program(rt)):
            runner.run(step)
        runner.drain()
    finally:
        rt.model.train()
    return share_loss(runner.reports)


@dataclass
class _Batch:
    """One posted ``Exchange``: its works (one per op, or NCCL's one for the whole batch),
    and its tensors, kept alive until they complete."""

    works: list[dist.Work]
    tensors: list[torch.Tensor]
    waited: set[int] = field(default_factory=set)

    def wait(self, op: int | None = None) -> None:
        """Wait for op ``op`` of the batch (None: all of it); a batch without a work per op
        (NCCL's) waits whole. gloo's waits keep the timeout the world was created with
        (start-up's) unless given the current one."""
        whole = op is None or len(self.works) != len(self.tensors)
        ops = range(len(self.works)) if whole else [op]
        timeout = groups.current_timeout()
        for k in ops:
            if k not in self.waited:
                self.works[k].wait(timeout)
                self.waited.add(k)

    def done(self) -> bool:
        return all(k in self.waited or w.is_completed() for k, w in enumerate(self.works))


class _Runner:
    """Executes one rank's steps: tensors received and to send, batches in flight, loss
    reports and the token count (on the device: no host read per microbatch)."""

    def __init__(self, rt: PlanRuntime, batches: Batches, *, keep: bool = True) -> None:
        self.rt, self.batches, self.keep = rt, batches, keep
        self.config = rt.model.config
        args = rt.args
        # under sequence parallelism a stage's output is its TP rank's part of the sequence
        seq = args.seq_length // (rt.plan.tp if self.config.sequence_parallel else 1)
        self.shape = (seq, args.micro_batch_size, self.config.hidden_size)
        self.device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        self.last = rt.gpt.post_process
        self.saved: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
        self.inbox: dict[tuple[str, int], tuple[torch.Tensor, _Batch, int]] = {}
        """(kind, microbatch) -> buffer, its batch and its op's index there."""
        self.outbox: dict[tuple[str, int], torch.Tensor] = {}
        self.flight: list[_Batch] = []
        self.reports: list[dict] = []
        self.tokens = torch.zeros((), dtype=torch.int, device=self.device)

    def run(self, step: Step) -> None:
        if isinstance(step, Exchange):
            self.exchange(step)
        elif step.kind == "F":
            self.forward(step)
        else:
            self.backward(step)

    def forward(self, op: Op) -> None:
        x = self._take(op, requires_grad=self.keep)
        out, tokens = plan_seams.forward_one(
            self.rt.forward_step, iter([self.batches(op.microbatch)]), self.rt.model,
            input_tensor=x, reports=self.reports, config=self.config,
            microbatch=op.microbatch, is_last_stage=self.last)
        self.tokens += tokens
        if op.send is not None:  # a copy travels: the output's storage is freed next
            self.outbox[("F", op.microbatch)] = out.detach().clone()
        if self.keep:  # for the backward
            plan_seams.release_output(out, self.config)
            self.saved[op.microbatch] = (x, out)

    def backward(self, op: Op) -> None:
        x, out = self.saved.pop(op.microbatch)
        grad = self._take(op, requires_grad=False)
        grad_x = plan_seams.backward_one(x, out, grad, self.rt.model, self.config)
        if op.send is not None:
            self.outbox[("B", op.microbatch)] = grad_x

    def exchange(self, ex: Exchange) -> None:
        """Post the batch (never waits: the sends' tensors are ready, receives land in new
        buffers that the ops using them wait for)."""
        world = self.rt.groups.world
        ops = [dist.P2POp(dist.isend, self.outbox.pop((m.kind, m.microbatch)), world[m.dst])
               for m in ex.sends]
        received = []
        for m in ex.recvs:
            buf = torch.empty(self.shape, dtype=self.config.pipeline_dtype, device=self.device)
            received.append(((m.kind, m.microbatch), buf, len(ops)))
            ops.append(dist.P2POp(dist.irecv, buf, world[m.src]))
        batch = _Batch(dist.batch_isend_irecv(ops), [op.tensor for op in ops])
        for key, buf, index in received:
            self.inbox[key] = (buf, batch, index)
        self.flight = [b for b in self.flight if not b.done()] + [batch]

    def _take(self, op: Op, *, requires_grad: bool) -> torch.Tensor | None:
        """The input ``op`` receives, once its batch has completed (None: it receives none)."""
        if op.recv is None:
            return None
        buf, batch, index = self.inbox.pop((op.kind, op.microbatch))
        batch.wait(index)
        return buf.requires_grad_(requires_grad)

    def drain(self) -> None:
        for batch in self.flight:
            batch.wait()
        self.flight = []
