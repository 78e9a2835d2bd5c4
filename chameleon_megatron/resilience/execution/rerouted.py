"""One training step with data rerouting: the layout kept, a failed stage's microbatches run
by its healthy same-stage peers in other pipelines.

Runs the routed schedule (``reroute_schedule``) on a runtime built with the rerouting plan
(``runtime.build_runtime(..., reroute=...)``); no state moves, every survivor keeps its
stage. Each op uses megatron-core's own ``forward_step`` and ``backward_step`` (looked up at
call time, so the swap seams wrap them here too); activations and gradients travel between
the ranks of each microbatch's route by point-to-point messages of the world group. Then the
per-layer gradient sync over the live holders, and the optimizer step: the same computation
as the failure-free step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from chameleon_megatron.megatron import groups, plan_seams
from chameleon_megatron.resilience.decision.placement import microbatch_ids
from chameleon_megatron.resilience.decision.reroute_schedule import Op, rank_ops
from chameleon_megatron.resilience.execution.runtime import (
    Batches,
    PlanRuntime,
    apply_update,
    step_result,
    zero_grads,
)
from chameleon_megatron.resilience.execution.runtime import forward_step as plan_forward_step
from chameleon_megatron.training.step import Applied, StepResult, share_loss


def rerouted_ops(rt: PlanRuntime) -> tuple[Op, ...]:
    """This rank's operations of the step, in order (plan rank ids)."""
    if rt.reroute is None:
        raise ValueError("this runtime runs whole pipelines: train it with run_hetero_step")
    return rank_ops(rt.plan, rt.reroute, microbatch_ids(rt.plan), rt.me)


def run_reroute_step(rt: PlanRuntime, batches: Batches) -> StepResult:
    """One step of the kept plan without its dead ranks, with its loss."""
    return step_result(reroute_train(rt, batches))


def reroute_train(rt: PlanRuntime, batches: Batches) -> Applied:
    """Forward, backward, gradient sync and optimizer step (see the module docstring)."""
    ops = rerouted_ops(rt)
    zero_grads(rt)
    runner = _Runner(rt, batches)
    last = max((k for k, op in enumerate(ops) if op.kind == "B"), default=len(ops))
    with rt.sync.no_sync():  # gradients are final in the last backward only
        for op in ops[:last]:
            runner.run(op)
    for op in ops[last:]:
        runner.run(op)
    runner.drain()
    rt.sync([rt.gpt], torch.tensor(runner.tokens))
    return apply_update(rt, runner.reports)


@torch.no_grad()
def reroute_eval(rt: PlanRuntime, batches: Batches) -> tuple[float | None, int]:
    """Forward only along the same routes: each rank runs its forward ops in the step's
    order (dropping the backward ops only removes waits, so no deadlock can appear)."""
    runner = _Runner(rt, batches)
    rt.model.eval()
    try:
        for op in rerouted_ops(rt):
            if op.kind == "F":
                runner.forward(op, keep=False)
        runner.drain()
    finally:
        rt.model.train()
    return share_loss(runner.reports)


class _Runner:
    """Executes one rank's ops: tensors in flight, outstanding sends, loss reports."""

    def __init__(self, rt: PlanRuntime, batches: Batches) -> None:
        self.rt, self.batches = rt, batches
        self.config = rt.model.config
        args = rt.args
        # under sequence parallelism a stage's output is its TP rank's part of the sequence
        seq = args.seq_length // (rt.plan.tp if self.config.sequence_parallel else 1)
        self.shape = (seq, args.micro_batch_size, self.config.hidden_size)
        self.device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        self.last = rt.gpt.post_process
        self.saved: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
        self.sends: list[tuple[dist.Work, torch.Tensor]] = []
        self.reports: list[dict] = []
        self.tokens = 0

    def run(self, op: Op) -> None:
        if op.kind == "F":
            self.forward(op)
        else:
            self.backward(op)

    def forward(self, op: Op, *, keep: bool = True) -> None:
        x = self._recv(op.recv, requires_grad=keep)
        out, tokens = plan_seams.forward_one(
            plan_forward_step, iter([self.batches(op.microbatch)]), self.rt.model,
            input_tensor=x, reports=self.reports, config=self.config,
            microbatch=op.microbatch, is_last_stage=self.last)
        self.tokens += int(tokens)
        if op.send is not None:  # a copy travels: the output's storage is freed next
            self._send(out.detach().clone(), op.send)
        if keep:  # for the backward
            plan_seams.release_output(out, self.config)
            self.saved[op.microbatch] = (x, out)

    def backward(self, op: Op) -> None:
        x, out = self.saved.pop(op.microbatch)
        grad = self._recv(op.recv, requires_grad=False)
        grad_x = plan_seams.backward_one(x, out, grad, self.rt.model, self.config)
        if op.send is not None:
            self._send(grad_x, op.send)

    def _recv(self, src: int | None, *, requires_grad: bool) -> torch.Tensor | None:
        if src is None:
            return None
        buf = torch.empty(self.shape, dtype=self.config.pipeline_dtype, device=self.device,
                          requires_grad=requires_grad)
        # gloo's recv would wait for the timeout the world was created with (start-up's)
        dist.irecv(buf, src=self.rt.groups.world[src]).wait(groups.current_timeout())
        return buf

    def _send(self, tensor: torch.Tensor, dst: int) -> None:
        """Non-blocking (the schedule's deadlock freedom relies on it); the tensor is kept
        alive until its send completes."""
        self.sends = [(w, t) for w, t in self.sends if not w.is_completed()]
        self.sends.append((dist.isend(tensor, dst=self.rt.groups.world[dst]), tensor))

    def drain(self) -> None:
        timeout = groups.current_timeout()
        for work, _ in self.sends:
            work.wait(timeout)
        self.sends = []
