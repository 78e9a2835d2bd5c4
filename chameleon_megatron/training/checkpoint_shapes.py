"""A checkpoint never loads silently into a model of another shape.

megatron's checkpoints are keyed by global tensor names, so they reshard into any TP/PP
layout; but a global shape that differs (a vocabulary padded to another multiple, another
hidden size or layer count) is not a layout: loading it would either fail deep inside
megatron or, for the padded vocabulary, load rows into the wrong places. Padding rows cannot
be converted exactly (their logits enter the softmax), so a difference is refused with both
shapes and the flag that explains it.
"""

from __future__ import annotations

import argparse
from typing import Any, Iterator

from chameleon_megatron.configurable import ConfigError

VOCAB_KEYS = ("word_embeddings.weight", "output_layer.weight")


def sharded_shapes(state: Any) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(key, global shape) of every sharded tensor in a (nested) sharded state dict."""
    if isinstance(state, dict):
        for value in state.values():
            yield from sharded_shapes(value)
    elif isinstance(state, (list, tuple)):
        for value in state:
            yield from sharded_shapes(value)
    elif hasattr(state, "global_shape") and hasattr(state, "key"):
        yield state.key, tuple(state.global_shape)


def check_shapes(saved: dict[str, Any], model_state: Any, args: argparse.Namespace,
                 path: str) -> None:
    """ConfigError naming the first tensor whose global shape in the checkpoint at ``path``
    (``saved``: its tensors' metadata) differs from the model's."""
    for key, shape in sharded_shapes(model_state):
        if key not in saved:
            continue
        theirs = tuple(saved[key].global_shape)
        if theirs != shape:
            raise ConfigError(f"--load {path}: {key} has shape {list(theirs)} in the "
                              f"checkpoint but {list(shape)} in this model; "
                              f"{_explain(key, theirs, shape, args)}")


def _explain(key: str, theirs: tuple[int, ...], ours: tuple[int, ...],
             args: argparse.Namespace) -> str:
    if key.endswith(VOCAB_KEYS) and theirs[1:] == ours[1:]:
        tp = args.tensor_model_parallel_size
        fix = ""
        if theirs[0] % tp == 0 and theirs[0] // tp >= 1:
            fix = (f"; --make-vocab-size-divisible-by {theirs[0] // tp} pads it to "
                   f"{theirs[0]} rows at TP {tp}, as the checkpoint has")
        return (f"the padded vocabulary differs: this run pads {args.vocab_size} tokens to a "
                f"multiple of --make-vocab-size-divisible-by {args.make_vocab_size_divisible_by}"
                f" x --tensor-model-parallel-size {tp} = {ours[0]} rows{fix}")
    return ("the model differs from the one saved (--num-layers, --hidden-size, "
            "--ffn-hidden-size, --num-attention-heads, --num-experts or the vocabulary)")
