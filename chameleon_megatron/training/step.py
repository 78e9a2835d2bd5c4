"""One training or evaluation step through megatron-core's pipeline schedules.

The loss of a step is the sum of per-token losses divided once by the global token count
(``calculate_per_token_loss``), so its value does not depend on the layout or on how the
global batch is split into microbatches.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import finalize_model_grads
from megatron.core.pipeline_parallel import get_forward_backward_func


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Sum of masked per-token losses, the token count, and both for reporting."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss_sum = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.stack([loss_sum.detach(), mask.sum()])
    return loss_sum, num_tokens, {"lm loss": report}


def forward_step(data_iterator: Iterator[dict], model: torch.nn.Module):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"])


def configure_schedule(config: Any, model: list[torch.nn.Module], optimizer: Any,
                       overlap_grad_reduce: bool) -> None:
    """The callables megatron's schedules read from the model config."""
    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = finalize_model_grads
    if overlap_grad_reduce:
        no_sync = [m.no_sync for m in model]
        config.no_sync_func = no_sync[0] if len(model) == 1 else no_sync


@dataclass(frozen=True)
class StepResult:
    loss: float | None
    """Global mean loss per token (None when no token was seen)."""
    tokens: int
    grad_norm: float | None = None
    skipped: bool = False


@dataclass(frozen=True)
class Applied:
    """A training step whose optimizer update has been applied on this rank."""

    reports: list[dict]
    grad_norm: float | None
    skipped: bool


def global_loss(reports: list[dict]) -> tuple[float | None, int]:
    """Sum the last stage's reports and share them with every rank of the job."""
    owns_loss = (parallel_state.is_pipeline_last_stage(ignore_virtual=True)
                 and parallel_state.get_tensor_model_parallel_rank() == 0)
    return share_loss(reports if owns_loss else [])


def share_loss(reports: list[dict]) -> tuple[float | None, int]:
    """Sum ``reports`` over every rank of the job: loss per token and token count."""
    totals = torch.zeros(2, dtype=torch.float64)
    for r in reports:
        totals += r["lm loss"].detach().to("cpu", torch.float64)
    if dist.get_backend() == "nccl":
        totals = totals.cuda()
    dist.all_reduce(totals)
    loss_sum, tokens = totals.tolist()
    return (loss_sum / tokens if tokens else None), int(tokens)


def run_schedule(model: list[torch.nn.Module], iterators: list[Iterator[dict]], *,
                 num_microbatches: int, seq_length: int, micro_batch_size: int,
                 forward_only: bool) -> list[dict]:
    """One call of megatron's forward-backward function (its choice of schedule)."""
    fb = get_forward_backward_func()
    return fb(
        forward_step_func=forward_step,
        data_iterator=iterators if len(iterators) > 1 else iterators[0],
        model=model if len(model) > 1 else model[0],
        num_microbatches=num_microbatches,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=forward_only,
    )


def train_step(model: list[torch.nn.Module], optimizer: Any, iterators: list[Iterator[dict]],
               **schedule: Any) -> Applied:
    """Forward, backward and optimizer update; the loss is summed up separately."""
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    reports = run_schedule(model, iterators, forward_only=False, **schedule)
    ok, grad_norm, _ = optimizer.step()
    return Applied(reports=reports, grad_norm=None if grad_norm is None else float(grad_norm),
                   skipped=not ok)


@torch.no_grad()
def eval_step(model: list[torch.nn.Module], iterators: list[Iterator[dict]],
              **schedule: Any) -> StepResult:
    for chunk in model:
        chunk.eval()
    try:
        reports = run_schedule(model, iterators, forward_only=True, **schedule)
    finally:
        for chunk in model:
            chunk.train()
    loss, tokens = global_loss(reports)
    return StepResult(loss=loss, tokens=tokens)
