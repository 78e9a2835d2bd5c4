"""The one line a run starts with: the model, the layout, the precision and what Chameleon
does (features and budgets), so a log says at its top what it is a log of."""

from __future__ import annotations

import argparse

import torch

from chameleon_megatron.config import ChameleonConfig


def parameters_held(chunks: list[torch.nn.Module], first_stage: bool) -> int:
    """Parameters of this rank's model chunks, the output layer's copy of the word
    embeddings (held by the last stage, not the first) not counted again."""
    seen: set[int] = set()
    total = 0
    for chunk in chunks:
        for p in chunk.parameters():
            if id(p) in seen or (getattr(p, "shared_embedding", False) and not first_stage):
                continue
            seen.add(id(p))
            total += p.numel()
    return total


def swap_summary(cfg: ChameleonConfig) -> str:
    s = cfg.swap
    if not s.enabled:
        return "swap off"
    if s.budget_bytes_per_stage:
        budget = "budgets " + "/".join(f"{b / 2**20:.1f}" for b in s.budget_bytes_per_stage) \
            + " MiB per stage"
    elif s.budget_bytes is not None:
        budget = f"budget {s.budget_bytes / 2**20:.1f} MiB"
    elif s.budget_device_fraction is not None:
        budget = f"budget {s.budget_device_fraction:.0%} of device memory"
    else:
        budget = f"budget {s.budget_fraction:.0%} of the saved activations"
    return f"swap on ({budget}, granularity {s.granularity}" + \
        (", recompute allowed)" if s.recompute else ")")


def ft_summary(cfg: ChameleonConfig) -> str:
    f = cfg.ft
    if not f.enabled:
        return "fault tolerance off"
    extras = [f"strategy {f.strategy}", f"MTBF prior {f.mtbf_prior_s / 3600:g} h"]
    if f.respawns:
        extras.append(f"{f.respawns} respawns")
    return f"fault tolerance on ({', '.join(extras)})"


def startup_line(args: argparse.Namespace, cfg: ChameleonConfig, parameters: int,
                 world_size: int) -> str:
    vpp = args.virtual_pipeline_model_parallel_size or 1
    return (
        f"start: GPT {args.num_layers} layers, hidden {args.hidden_size}, "
        f"{parameters / 1e6:.2f} M parameters | world {world_size}: "
        f"tp {args.tensor_model_parallel_size}, pp {args.pipeline_model_parallel_size}, "
        f"dp {args.data_parallel_size}, vpp {vpp} | seq {args.seq_length}, micro-batch "
        f"{args.micro_batch_size}, global batch {args.global_batch_size} | "
        f"{'bf16' if args.bf16 else 'fp32'} | {swap_summary(cfg)} | {ft_summary(cfg)}"
    )
