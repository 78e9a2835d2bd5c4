"""A rank's model and optimizer state by state unit: what the restorer's executor moves.

A unit is a transformer layer (global index, 0-based), the embedding or the output layer
(final norm and output projection), as in ``resilience.layout``. Within a unit, tensors are
named by their parameter path below the unit (``self_attention.linear_qkv.weight``), so the
same layer has the same names on every rank whatever the pipeline split. Optimizer state is
named ``<param>/<key>`` (Adam's ``exp_avg``, ``exp_avg_sq``, ``step``; SGD's
``momentum_buffer``); with mixed precision
the fp32 main copy travels with the parameters as ``<param>/main``.

Tied embeddings: a model held by one stage has no output weight of its own (it reuses the
embedding's). As a *source* such a model also offers the embedding weight (and its Adam
state) under the output unit, so that a last stage of a deeper layout can be filled from it.
"""

from __future__ import annotations

from typing import Any, Iterator, Literal

import torch

from chameleon_megatron.resilience.decision.layout import EMBEDDING, OUTPUT, StateUnit
from chameleon_megatron.resilience.decision.restorer import StateKind

_MIGRATED = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)
_OUTPUT_WEIGHT = "output_layer.weight"


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The ``GPTModel`` inside megatron's wrappers (DDP, ``Float16Module``)."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def _unit_of(gpt: torch.nn.Module, name: str) -> tuple[StateUnit, str]:
    """(unit, name within the unit) of a GPTModel parameter name."""
    head, _, rest = name.partition(".")
    if head == "embedding":
        return EMBEDDING, rest
    if head == "output_layer":
        return OUTPUT, name
    if name.startswith("decoder.final_layernorm."):
        return OUTPUT, name.removeprefix("decoder.")
    if name.startswith("decoder.layers."):
        index, _, rest = name.removeprefix("decoder.layers.").partition(".")
        return gpt.decoder.layers[int(index)].layer_number - 1, rest
    raise ValueError(f"parameter {name!r}: not in a known state unit (embedding, "
                     "decoder.layers.N, decoder.final_layernorm, output_layer)")


def unit_parameters(model: list[torch.nn.Module]) -> dict[StateUnit, dict[str, torch.nn.Parameter]]:
    """unit -> name -> parameter, over this rank's model chunks."""
    units: dict[StateUnit, dict[str, torch.nn.Parameter]] = {}
    for chunk in model:
        gpt = unwrap(chunk)
        for name, param in gpt.named_parameters():
            unit, local = _unit_of(gpt, name)
            units.setdefault(unit, {})[local] = param
    return units


def tied_embedding(model: list[torch.nn.Module]) -> torch.nn.Parameter | None:
    """The embedding weight that also serves as output weight on this rank, if any."""
    for chunk in model:
        gpt = unwrap(chunk)
        if (getattr(gpt, "share_embeddings_and_output_weights", False)
                and gpt.pre_process and gpt.post_process):
            return gpt.embedding.word_embeddings.weight
    return None


def megatron_leaves(optimizer: Any) -> Iterator[Any]:
    """The optimizers inside megatron's ``ChainedOptimizer`` (or ``optimizer`` itself)."""
    if hasattr(optimizer, "chained_optimizers"):
        for inner in optimizer.chained_optimizers:
            yield from megatron_leaves(inner)
    else:
        yield optimizer


def check_migratable(optimizer: Any) -> None:
    """ValueError unless the restorer can move this optimizer's state (torch's Adam, AdamW
    or SGD inside megatron's optimizers)."""
    for leaf in megatron_leaves(optimizer):
        if not isinstance(leaf.optimizer, _MIGRATED):
            raise ValueError(f"in-memory optimizer migration supports Adam, AdamW and SGD, "
                             f"not {type(leaf.optimizer).__name__}")


def optimizer_slots(optimizer: Any) -> dict[int, tuple[torch.optim.Optimizer, torch.Tensor, dict]]:
    """id(model parameter) -> (torch optimizer, the tensor it updates, its param group)."""
    check_migratable(optimizer)
    slots: dict[int, tuple[torch.optim.Optimizer, torch.Tensor, dict]] = {}
    for leaf in megatron_leaves(optimizer):
        if type(leaf).__name__ == "DistributedOptimizer":
            raise ValueError("a distributed optimizer's state is sharded: read it by pieces "
                             "(resilience.dist_opt)")
        inner = leaf.optimizer
        main_of = {}
        if hasattr(leaf, "float16_groups"):  # mixed precision: fp32 main copies
            for model_group, main_group in zip(leaf.float16_groups, leaf.fp32_from_float16_groups):
                main_of.update({id(m): p for p, m in zip(model_group, main_group)})
        for group in inner.param_groups:
            for main in group["params"]:
                model_param = main_of.get(id(main), main)
                slots[id(model_param)] = (inner, main, group)
    return slots


def new_state(inner: torch.optim.Optimizer, main: torch.Tensor, group: dict) -> dict:
    """The state torch's optimizer would start ``main`` with before its first step: Adam's
    zero moments and step; SGD's momentum buffer as zeros (torch starts it from the first
    gradient, which a zero buffer gives exactly: 0 * momentum + gradient)."""
    zeros = torch.zeros_like(main, memory_format=torch.preserve_format)
    if isinstance(inner, torch.optim.SGD):
        return {"momentum_buffer": zeros} if group["momentum"] else {}
    on_device = group.get("capturable") or group.get("fused")
    state = {"step": torch.zeros((), dtype=torch.float32,
                                 device=main.device if on_device else "cpu"),
             "exp_avg": zeros, "exp_avg_sq": torch.zeros_like(zeros)}
    if group.get("amsgrad"):
        state["max_exp_avg_sq"] = torch.zeros_like(zeros)
    return state


def _fits(tensor: torch.Tensor | None, like: torch.Tensor, device: torch.device) -> bool:
    """``tensor`` can stand for ``like`` (made on the meta device for ``device``)."""
    where = device if like.device.type == "meta" else like.device
    return (tensor is not None and tensor.shape == like.shape and tensor.dtype == like.dtype
            and tensor.device == where)


def optimizer_state(inner: torch.optim.Optimizer, main: torch.Tensor, group: dict) -> dict:
    """The optimizer state of ``main``, created (``new_state``) before its first step."""
    state = inner.state[main]
    if not state or any(value is None for value in state.values()):
        for key, value in new_state(inner, main, group).items():
            if state.get(key) is None:
                state[key] = value
    return state


class ModelState:
    """A ``StateView`` over model chunks and their megatron optimizer."""

    def __init__(self, model: list[torch.nn.Module], optimizer: Any, *,
                 role: Literal["source", "sink"]) -> None:
        self._units = unit_parameters(model)
        self._slots = optimizer_slots(optimizer)
        self._adopted: set[int] = set()
        tied = tied_embedding(model)
        if role == "source" and tied is not None:
            self._units.setdefault(OUTPUT, {})[_OUTPUT_WEIGHT] = tied

    def units(self) -> tuple[StateUnit, ...]:
        return tuple(self._units)

    def commit(self) -> None:
        """Nothing to do: a sink is written in place (``dist_opt.ShardSink`` stages)."""

    def adopt(self, unit: StateUnit, kind: StateKind, source: dict[str, torch.Tensor]) -> None:
        """Take ``source``'s optimizer state of ``unit`` (an old layout's, same names) as this
        sink's own, without a copy, for each parameter whose state is not created yet and
        whose every tensor matches (shape, dtype, device) and is not taken already (a tied
        weight's state is offered twice)."""
        if kind != "optimizer":
            return
        for name, param in self._units.get(unit, {}).items():
            inner, main, group = self._slots[id(param)]
            if inner.state.get(main):
                continue
            # the state torch would create, on the meta device: names, shapes and dtypes
            template = new_state(inner, main.to("meta"), group)
            taken = {key: source.get(f"{name}/{key}") for key in template}
            if all(_fits(t, like, main.device) and id(t) not in self._adopted
                   for t, like in zip(taken.values(), template.values())):
                inner.state[main] = taken
                self._adopted.update(id(t) for t in taken.values())

    def tensors(self, unit: StateUnit, kind: StateKind) -> dict[str, torch.Tensor]:
        params = self._units.get(unit, {})
        out: dict[str, torch.Tensor] = {}
        for name, param in params.items():
            inner, main, group = self._slots[id(param)]
            if kind == "params":
                out[name] = param.detach()
                if main is not param:
                    out[f"{name}/main"] = main.detach()
            else:
                for key, value in optimizer_state(inner, main, group).items():
                    out[f"{name}/{key}"] = value
        return out
