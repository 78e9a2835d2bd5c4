"""A rank's model and optimizer state by state unit: what the restorer's executor moves.

A unit is a transformer layer (global index, 0-based), the embedding or the output layer
(final norm and output projection), as in ``resilience.layout``. Within a unit, tensors are
named by their parameter path below the unit (``self_attention.linear_qkv.weight``), so the
same layer has the same names on every rank whatever the pipeline split. Optimizer state is
named ``<param>/<key>`` (Adam's ``exp_avg``, ``exp_avg_sq``, ``step``, and
``master_param`` where the optimizer keeps the fp32 main weights; SGD's ``momentum_buffer``),
as ``optim_layout.Slot`` shows it whatever the optimizer's own layout (a fused Adam's param
group step, scaled or bf16 moments); with mixed precision the fp32 main copy travels with
the parameters as ``<param>/main``.

Module buffers that are part of the model's state (persistent: in its ``state_dict``, such as
the MoE router's ``expert_bias``, which training updates outside the optimizer) travel with
the ``"params"`` kind under their path below the unit, and are written into the new model's
buffers in place. Non-persistent buffers (per-step token counts, RoPE caches) are rebuilt.

Tied embeddings: a model held by one stage has no output weight of its own (it reuses the
embedding's). As a *source* such a model also offers the embedding weight (and its Adam
state) under the output unit, so that a last stage of a deeper layout can be filled from it.
"""

from __future__ import annotations

from typing import Any, Iterator, Literal

import torch

from chameleon_megatron.resilience.decision.layout import EMBEDDING, OUTPUT, StateUnit
from chameleon_megatron.resilience.decision.restorer import StateKind
from chameleon_megatron.resilience.optim_layout import Slot, layout_of, refuse_offloaded, set_steps

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


def _persistent_buffers(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(dotted name, buffer) of each buffer of ``module`` that its ``state_dict`` holds."""
    for path, sub in module.named_modules():
        for name, buf in sub.named_buffers(recurse=False):
            if buf is not None and name not in sub._non_persistent_buffers_set:
                yield (f"{path}.{name}" if path else name), buf


def unit_buffers(model: list[torch.nn.Module]) -> dict[StateUnit, dict[str, torch.Tensor]]:
    """unit -> name -> persistent buffer, over this rank's model chunks (see the module
    docstring); names as parameters' are, below the unit."""
    units: dict[StateUnit, dict[str, torch.Tensor]] = {}
    for chunk in model:
        gpt = unwrap(chunk)
        for name, buf in _persistent_buffers(gpt):
            unit, local = _unit_of(gpt, name)
            units.setdefault(unit, {})[local] = buf
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
    """ValueError unless the restorer can move this optimizer's state: Adam- or SGD-like
    torch optimizers inside megatron's (torch's, Transformer Engine's or apex's; see
    ``optim_layout``), not megatron's CPU-offloading one."""
    for leaf in megatron_leaves(optimizer):
        refuse_offloaded(leaf)
        layout_of(leaf.optimizer)


def optimizer_slots(optimizer: Any) -> dict[int, Slot]:
    """id(model parameter) -> its state's ``Slot`` (the tensor the optimizer updates)."""
    check_migratable(optimizer)
    slots: dict[int, Slot] = {}
    for leaf in megatron_leaves(optimizer):
        if type(leaf).__name__ == "DistributedOptimizer":
            raise ValueError("a distributed optimizer's state is sharded: read it by pieces "
                             "(resilience.dist_opt)")
        inner = leaf.optimizer
        layout = layout_of(inner)
        main_of = {}
        if hasattr(leaf, "float16_groups"):  # mixed precision: fp32 main copies
            for model_group, main_group in zip(leaf.float16_groups, leaf.fp32_from_float16_groups):
                main_of.update({id(m): p for p, m in zip(model_group, main_group)})
        for group in inner.param_groups:
            for main in group["params"]:
                model_param = main_of.get(id(main), main)
                slots[id(model_param)] = Slot(inner, main, group, layout)
    return slots


def _fits(tensor: torch.Tensor | None, key: str, main: torch.Tensor) -> bool:
    """``tensor`` can be ``main``'s state entry ``key`` as the optimizer would create it: the
    step a 0-dim fp32 scalar, the others ``main``'s shape, dtype and device."""
    if tensor is None:
        return False
    if key == "step":
        return tensor.dim() == 0 and tensor.dtype == torch.float32
    return (tensor.shape == main.shape and tensor.dtype == main.dtype
            and tensor.device == main.device)


class ModelState:
    """A ``StateView`` over model chunks and their megatron optimizer. As a sink, state the
    optimizer stores otherwise than shown (a param group's step, scaled or low-precision
    moments) is staged, and ``commit`` stores it."""

    def __init__(self, model: list[torch.nn.Module], optimizer: Any, *,
                 role: Literal["source", "sink"]) -> None:
        self._units = unit_parameters(model)
        self._buffers = unit_buffers(model)
        self._slots = optimizer_slots(optimizer)
        self._role = role
        self._staged: dict[int, dict[str, torch.Tensor]] = {}
        self._adopted: set[int] = set()
        tied = tied_embedding(model)
        if role == "source" and tied is not None:
            self._units.setdefault(OUTPUT, {})[_OUTPUT_WEIGHT] = tied

    def units(self) -> tuple[StateUnit, ...]:
        return tuple(self._units | self._buffers)

    def commit(self) -> None:
        """Store what was staged (the rest was written in place)."""
        steps = []
        for key, values in self._staged.items():
            slot = self._slots[key]
            slot.write(values)
            if "step" in values:
                steps.append((slot, values["step"]))
        set_steps(steps)
        self._staged.clear()

    def _state(self, slot: Slot, key: int) -> dict[str, torch.Tensor]:
        values = slot.read()
        if self._role == "source":
            return values
        staged = self._staged.setdefault(key, {})
        for name, stage in slot.staged().items():
            if stage:
                values[name] = staged.setdefault(name, torch.zeros_like(values[name]))
        return values

    def adopt(self, unit: StateUnit, kind: StateKind, source: dict[str, torch.Tensor]) -> None:
        """Take ``source``'s optimizer state of ``unit`` (an old layout's, same names) as this
        sink's own, without a copy, for each parameter whose state is not created yet and
        whose every tensor matches (shape, dtype, device) and is not taken already (a tied
        weight's state is offered twice)."""
        if kind != "optimizer":
            return
        for name, param in self._units.get(unit, {}).items():
            slot = self._slots[id(param)]
            if slot.optimizer.state.get(slot.main) or any(slot.staged().values()):
                continue  # created already, or stored otherwise than shown (staged)
            taken = {key: source.get(f"{name}/{key}") for key in slot.keys()}
            if taken and all(_fits(t, key, slot.main) and id(t) not in self._adopted
                             for key, t in taken.items()):
                slot.optimizer.state[slot.main] = taken
                self._adopted.update(id(t) for t in taken.values())

    def tensors(self, unit: StateUnit, kind: StateKind) -> dict[str, torch.Tensor]:
        params = self._units.get(unit, {})
        out: dict[str, torch.Tensor] = {}
        for name, param in params.items():
            slot = self._slots[id(param)]
            if kind == "params":
                out[name] = param.detach()
                if slot.main is not param:
                    out[f"{name}/main"] = slot.main.detach()
            else:
                for key, value in self._state(slot, id(param)).items():
                    out[f"{name}/{key}"] = value
        if kind == "params":
            out.update(self._buffers.get(unit, {}))
        return out
