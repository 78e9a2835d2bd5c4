"""The optimizer of a plan's stage: the step megatron's fp32 optimizer takes, without its groups.

megatron's optimizer needs megatron's DDP buffers and computes the clipping norm over one
model-parallel group; a plan has neither. This one applies the same update: parameter
groups as megatron forms them (no weight decay on biases and 1-D parameters, the
``wd_mult``/``max_lr``/``min_lr`` keys its LR scheduler reads), clipping by megatron's own
``clip_grad_by_total_norm_fp32`` with the global norm, then torch's AdamW or SGD with
momentum (megatron's optimizers on a host without TransformerEngine or apex; with them
megatron takes their fused AdamW, the same update up to rounding). ``model_state.ModelState`` reads its state like a
megatron optimizer's (``.optimizer`` is the torch optimizer).
"""

from __future__ import annotations

import argparse
from typing import Callable

import torch

from chameleon_megatron.megatron import plan_seams


def param_groups(model: torch.nn.Module, args: argparse.Namespace) -> list[dict]:
    """megatron's default groups: weight decay except on biases and 1-D parameters."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim == 1 or name.endswith(".bias") else decay).append(p)
    base = {"lr_mult": 1.0, "is_decoupled_lr": False, "max_lr": args.lr, "min_lr": args.min_lr,
            "default_config": True}
    return [{**base, "params": decay, "wd_mult": 1.0},
            {**base, "params": no_decay, "wd_mult": 0.0}]


class PlanOptimizer:
    """``step()`` returns (applied, grad norm, None) as megatron's optimizers do."""

    def __init__(self, model: torch.nn.Module, args: argparse.Namespace,
                 grad_norm: Callable[[], float]) -> None:
        groups = param_groups(model, args)
        if args.optimizer == "sgd":
            self.optimizer: torch.optim.Optimizer = torch.optim.SGD(
                groups, lr=args.lr, weight_decay=args.weight_decay, momentum=args.sgd_momentum)
        else:
            self.optimizer = torch.optim.AdamW(
                groups, lr=args.lr, weight_decay=args.weight_decay,
                betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps)
        self.clip_grad = args.clip_grad
        self._grad_norm = grad_norm
        self._params = [p for g in self.optimizer.param_groups for p in g["params"]]

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def zero_grad(self) -> None:
        for p in self._params:
            p.grad = None

    def step(self) -> tuple[bool, float | None, None]:
        norm = None
        if self.clip_grad > 0:
            norm = self._grad_norm()
            plan_seams.clip_grads(self._params, self.clip_grad, norm)
        self.optimizer.step()
        return True, norm, None
