"""Initial weights that depend on the seed only, never on the parallel layout.

Megatron draws initial weights from each rank's generator in build order, so the same seed
gives different weights under PP2 than under PP1. Here every tensor of the model's global
(checkpoint) view, keyed by its sharded-state-dict key and layer/expert index, is drawn
from its own generator, and each rank copies out its shard. A run under TP2xPP2 therefore
starts from exactly the weights of a one-process run, which makes layouts comparable and
lets a re-planned layout after a failure reproduce the failure-free numbers.

Rules match megatron's defaults: normal(0, std) for weights, std / sqrt(2 L) for the
output projections of attention and MLP, ones for norm weights, zeros for biases.
"""

from __future__ import annotations

import math
import zlib
from typing import Any, Iterator

import torch
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedTensor

EMBEDDING_KEY = "embedding.word_embeddings.weight"


def _iter_sharded_tensors(tree: Any) -> Iterator[ShardedTensor]:
    if isinstance(tree, ShardedTensor):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _iter_sharded_tensors(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _iter_sharded_tensors(v)


def _draw(key: str, index: tuple[int, ...], shape: tuple[int, ...], *, seed: int, std: float,
          num_layers: int, device: torch.device) -> torch.Tensor:
    """The full (unsharded) tensor for one key and layer/expert index."""
    if key.endswith("bias"):
        return torch.zeros(shape, device=device)
    if "norm" in key.rsplit(".", 1)[-1] or "layernorm" in key:
        return torch.ones(shape, device=device)
    scale = std
    if key.endswith(("linear_proj.weight", "linear_fc2.weight")):
        scale = std / math.sqrt(2.0 * num_layers)
    gen = torch.Generator(device=device)
    gen.manual_seed(zlib.crc32(f"{seed}|{key}|{index}".encode()))
    return torch.randn(shape, generator=gen, device=device) * scale


def _slice_of(full: torch.Tensor, offset: tuple[int, ...], local: torch.Size) -> torch.Tensor:
    return full[tuple(slice(o, o + n) for o, n in zip(offset, local))]


@torch.no_grad()
def init_layout_independent(chunks: list[torch.nn.Module], *, seed: int, std: float,
                            num_layers: int) -> None:
    """Overwrite every parameter of ``chunks`` with its layout-independent initial value."""
    for chunk in chunks:
        for sh in _iter_sharded_tensors(chunk.sharded_state_dict()):
            if sh.flattened_range is not None or not isinstance(sh.data, torch.Tensor):
                continue
            p = sh.prepend_axis_num
            full = _draw(sh.key, tuple(sh.global_offset[:p]), tuple(sh.global_shape[p:]),
                         seed=seed, std=std, num_layers=num_layers, device=sh.data.device)
            sh.data.copy_(_slice_of(full, tuple(sh.global_offset[p:]), sh.data.shape))
        _init_tied_output(chunk, seed=seed, std=std, num_layers=num_layers)


def _init_tied_output(chunk: torch.nn.Module, *, seed: int, std: float, num_layers: int) -> None:
    """A last stage without the embedding holds a copy of it as its output weight."""
    tied = getattr(chunk, "share_embeddings_and_output_weights", False)
    if not (tied and chunk.post_process and not chunk.pre_process):
        return
    weight = chunk.output_layer.weight
    tp, rank = (parallel_state.get_tensor_model_parallel_world_size(),
                parallel_state.get_tensor_model_parallel_rank())
    full = _draw(EMBEDDING_KEY, (), (weight.shape[0] * tp, weight.shape[1]), seed=seed,
                 std=std, num_layers=num_layers, device=weight.device)
    weight.copy_(full[rank * weight.shape[0]:(rank + 1) * weight.shape[0]])
