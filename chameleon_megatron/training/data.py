"""Training data through megatron.core.datasets: mock tokens, an indexed GPT dataset, or a
weighted blend of several (``--data-path W1 P1 W2 P2``), split by ``--split``.

Samples are addressed by their global index. The global batch of step k holds samples
``[consumed, consumed + global_batch)``; microbatch j of data-parallel rank r holds the
``micro`` samples starting at ``consumed + (j * dp + r) * micro`` (Megatron's sampler
order). The position in the data is therefore a function of ``consumed_samples`` alone,
which makes a resumed (or recovered) run see exactly the samples it would have seen.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Iterator

import torch
from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset

from chameleon_megatron.training.data_flags import data_blend
from chameleon_megatron.training.tokenizer import build_tokenizer, checked_vocab

Dataset = GPTDataset | BlendedDataset
"""One split: a GPTDataset, or a BlendedDataset of them when --data-path is a blend."""


@dataclass(frozen=True)
class Datasets:
    train: Dataset
    valid: Dataset | None


def _split_sizes(args: argparse.Namespace) -> list[int]:
    """Samples needed per split: every training step plus every evaluation."""
    gbs = args.global_batch_size
    train = max(args.train_iters, 1) * gbs
    n_evals = (args.train_iters // args.eval_interval + 1) if args.eval_interval else 1
    valid = max(args.eval_iters, 1) * gbs * n_evals
    return [train, valid, 0]


def build_datasets(args: argparse.Namespace) -> Datasets:
    """Build train/valid GPT datasets on every rank (deterministic, so no broadcast needed)."""
    tokenizer = checked_vocab(build_tokenizer(args), args)
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=None if args.mock_data else data_blend(args.data_path),
        split=args.split,
        path_to_cache=args.data_cache_path,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
    )
    cls = MockGPTDataset if args.mock_data else GPTDataset
    train, valid, _ = BlendedMegatronDatasetBuilder(
        cls, _split_sizes(args), lambda: True, config
    ).build()
    return Datasets(train=train, valid=valid)


def microbatch_indices(consumed: int, *, micro: int, dp: int, dp_rank: int,
                       num_microbatches: int) -> list[list[int]]:
    """Global sample indices of this rank's microbatches for one step."""
    return [
        [consumed + (j * dp + dp_rank) * micro + i for i in range(micro)]
        for j in range(num_microbatches)
    ]


BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids", "attention_mask")
"""What a microbatch holds of its samples (Megatron-LM's datasets add the attention mask
where ``--create-attention-mask-in-dataloader`` says)."""


def _collate(dataset: Dataset, indices: list[int], device: torch.device) -> dict:
    samples = [dataset[i % len(dataset)] for i in indices]
    batch = {k: torch.stack([torch.as_tensor(s[k]) for s in samples]) for k in BATCH_KEYS
             if k in samples[0]}
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def step_iterator(dataset: Dataset, consumed: int, *, micro: int, dp: int, dp_rank: int,
                  num_microbatches: int, device: torch.device) -> Iterator[dict]:
    """The microbatches this rank feeds into one forward-backward call."""
    for idx in microbatch_indices(consumed, micro=micro, dp=dp, dp_rank=dp_rank,
                                  num_microbatches=num_microbatches):
        yield _collate(dataset, idx, device)


def global_batch_size_at(args: argparse.Namespace, consumed: int) -> int:
    """Global batch size after ``consumed`` samples, with Megatron's linear ramp-up rule."""
    if args.rampup_batch_size is None:
        return args.global_batch_size
    start, incr, ramp_samples = args.rampup_batch_size
    steps = max((args.global_batch_size - start) // incr, 1)
    # One increment every ramp_samples / steps samples, in integers to avoid float edges.
    done = consumed * steps // max(ramp_samples, 1)
    return min(start + done * incr, args.global_batch_size)
