"""torch's layer norms for megatron-core's local layers under sequence parallelism.

Without Transformer Engine or apex, megatron-core builds its local layers' norms from
torch's (``WrappedTorchNorm``), and that wrapper refuses sequence parallelism. Yet the
computation needs nothing torch lacks: with it each TP rank normalises its own part of the
sequence, so the gradients of the norm's weight and bias are partial sums over that part,
which megatron's ``finalize_model_grads`` sums over the TP group for every parameter marked
``sequence_parallel`` (apex's and TE's norms mark theirs the same way). ``SequenceParallelNorm``
is torch's norm, marked; ``block_spec`` puts it in place of megatron's torch norm in a layer
spec and as the block's final norm (which megatron otherwise picks itself).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any

import torch


def torch_norms(transformer_engine: bool) -> bool:
    """Whether megatron-core builds the norms from torch's (local layers, no apex)."""
    return not transformer_engine and importlib.util.find_spec("apex") is None


class SequenceParallelNorm:
    """torch's LayerNorm or RMSNorm (``config.normalization``), its parameters marked for
    the TP-group sum of sequence parallelism; built with megatron's norm arguments."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5,
                persist_layer_norm: bool = False, zero_centered_gamma: bool = False,
                normalization: str = "LayerNorm") -> torch.nn.Module:
        if config.layernorm_zero_centered_gamma or config.memory_efficient_layer_norm:
            raise ValueError("torch's layer norm has no zero-centred gamma nor memory-"
                             "efficient variant")
        kinds = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}
        if config.normalization not in kinds:
            raise ValueError(f"normalization {config.normalization!r}: torch's norms are "
                             f"{sorted(kinds)}")
        norm = kinds[config.normalization](hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


def _swap_norms(spec: Any) -> Any:
    """``spec`` with megatron's torch norm replaced everywhere in its tree of submodules."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if spec is WrappedTorchNorm:
        return SequenceParallelNorm
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        return dataclasses.replace(spec, **{f.name: _swap_norms(getattr(spec, f.name))
                                            for f in dataclasses.fields(spec) if f.init})
    return spec


def block_spec(layer_spec: Any, num_layers: int) -> Any:
    """A transformer block of ``num_layers`` layers of ``layer_spec`` whose norms (the final
    one included) are ``SequenceParallelNorm``."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    return TransformerBlockSubmodules(layer_specs=[_swap_norms(layer_spec)] * num_layers,
                                      layer_norm=SequenceParallelNorm)
