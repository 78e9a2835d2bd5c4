"""Optimizer and learning-rate schedule through megatron-core (Adam or SGD)."""

from __future__ import annotations

import argparse
from typing import Any

import torch
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler


def build_optimizer(args: argparse.Namespace, model: list[torch.nn.Module], *,
                    pg_collection: Any = None):
    """megatron's optimizer over ``model`` (DDP chunks). ``pg_collection``: a plan's stage
    (``plan_seams.stage_ddp_groups``): the plan clips with its global norm
    (``plan_seams.step_with_norm``), so this optimizer's own clipping is off; with the
    distributed optimizer each chunk is sharded over its own DDP's data-parallel group."""
    config = OptimizerConfig(
        optimizer=args.optimizer,
        lr=args.lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        bf16=args.bf16,
        params_dtype=torch.bfloat16 if args.bf16 else torch.float32,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        sgd_momentum=args.sgd_momentum,
        use_distributed_optimizer=args.use_distributed_optimizer,
        clip_grad=args.clip_grad if pg_collection is None else 0.0,
    )
    return get_megatron_optimizer(config, model, pg_collection=pg_collection,
                                  use_gloo_process_groups=pg_collection is None)


def build_scheduler(args: argparse.Namespace, optimizer) -> OptimizerParamScheduler:
    """Megatron-LM's convention: steps counted in samples, so batch ramp-up is exact."""
    gbs = args.global_batch_size
    return OptimizerParamScheduler(
        optimizer,
        init_lr=args.lr_warmup_init,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters * gbs,
        lr_decay_steps=args.lr_decay_iters * gbs,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters * gbs,
        wd_incr_style="constant",
    )
