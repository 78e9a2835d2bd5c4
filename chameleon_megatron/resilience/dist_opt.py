"""The distributed optimizer's state by the pieces of parameters each rank owns.

megatron's ``DistributedOptimizer`` shards the fp32 main parameters and the optimizer state
over the data-parallel ranks: a rank owns one contiguous range of the flattened elements of
some parameters (``_get_model_param_range_map``); the model parameters stay whole on every
rank (gathered after each step). ``owned`` lists this rank's pieces; ``ShardSink`` is a new
distributed optimizer as the restorer's executor sees it: whole tensors to receive (units
move whole), of which ``settle`` (one unit, as it lands) and ``commit`` keep this rank's
ranges.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from chameleon_megatron.resilience.decision.layout import StateUnit
from chameleon_megatron.resilience.decision.restorer import StateKind
from chameleon_megatron.resilience.model_state import (
    ModelState,
    check_migratable,
    megatron_leaves,
    unit_parameters,
)
from chameleon_megatron.resilience.optim_layout import Slot, layout_of, set_steps


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, end)`` of one flattened parameter (by unit and name)."""

    unit: StateUnit
    name: str
    start: int
    end: int
    shape: tuple[int, ...]
    """The whole parameter's."""

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Owned:
    piece: Piece
    param: torch.nn.Parameter
    """The whole model parameter."""
    main: torch.Tensor
    """Its fp32 main piece (a view into ``param`` for fp32 models)."""
    state: dict
    """The optimizer state of ``main`` (created if the optimizer has not stepped yet), as
    ``optim_layout.Slot.read`` shows it: a param group's step as a 0-dim copy."""
    slot: Slot | None = None
    """Where the state lives (``Slot.write``/``set_steps`` store it back)."""


def is_distributed(optimizer: Any) -> bool:
    return any(type(leaf).__name__ == "DistributedOptimizer"
               for leaf in megatron_leaves(optimizer))


def state_keys(optimizer: Any) -> tuple[str, ...]:
    """The optimizer-state keys of every main parameter (``optim_layout.Slot.read``)."""
    check_migratable(optimizer)
    return layout_of(next(megatron_leaves(optimizer)).optimizer).state_keys()


def owned(model: list[torch.nn.Module], optimizer: Any) -> list[Owned]:
    """This rank's pieces, in one order for a given layout."""
    out = []
    for leaf in megatron_leaves(optimizer):
        layout = layout_of(leaf.optimizer)
        index = leaf.model_param_group_index_map
        for unit, params in unit_parameters(model).items():
            for name, param in sorted(params.items()):
                if param not in index:
                    continue
                group_index, order = index[param]
                group = leaf.optimizer.param_groups[group_index]
                slot = Slot(leaf.optimizer, group["params"][order], group, layout)
                span = leaf._get_model_param_range_map(param)["param"]
                piece = Piece(unit, name, span.start, span.end, tuple(param.shape))
                out.append(Owned(piece, param, slot.main, slot.read(), slot))
    return out


class ShardSink:
    """A new model with a distributed optimizer, as a ``StateView`` to fill: the model
    parameters themselves, whole staging tensors for their main copies (bf16) and optimizer
    state; ``settle`` keeps this rank's pieces of one unit as soon as it has arrived (its
    staging goes), ``commit`` those of what is left, and the step counts."""

    def __init__(self, model: list[torch.nn.Module], optimizer: Any) -> None:
        self._units = unit_parameters(model)
        self._owned = owned(model, optimizer)
        self._keys = state_keys(optimizer)
        self._staged: dict[tuple[StateUnit, str], torch.Tensor] = {}
        self._settled: set[tuple[StateUnit, StateKind]] = set()
        self._steps: list[tuple[Slot, torch.Tensor]] = []

    def _stage(self, unit: StateUnit, name: str, like: torch.Tensor,
               scalar: bool = False) -> torch.Tensor:
        shape = () if scalar else like.shape
        return self._staged.setdefault((unit, name), torch.zeros(shape, dtype=torch.float32,
                                                                 device=like.device))

    def _names(self, kind: StateKind, name: str, param: torch.Tensor) -> list[str]:
        """The staged tensors of one parameter for ``kind``."""
        if kind == "params":
            return [f"{name}/main"] if param.dtype != torch.float32 else []
        return [f"{name}/{key}" for key in self._keys]

    def specs(self, unit: StateUnit, kind: StateKind) -> dict[str, tuple[list[int], str]]:
        """Name -> (shape, dtype) of what ``tensors(unit, kind)`` returns, staging nothing."""
        out: dict[str, tuple[list[int], str]] = {}
        for name, param in self._units.get(unit, {}).items():
            if kind == "params":
                out[name] = (list(param.shape), str(param.dtype))
            for staged in self._names(kind, name, param):
                scalar = staged.endswith("/step")
                out[staged] = ([] if scalar else list(param.shape), str(torch.float32))
        return out

    def tensors(self, unit: StateUnit, kind: StateKind) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for name, param in self._units.get(unit, {}).items():
            if kind == "params":
                out[name] = param.detach()
            for staged in self._names(kind, name, param):
                out[staged] = self._stage(unit, staged, param, scalar=staged.endswith("/step"))
        return out

    def adopt(self, unit: StateUnit, kind: StateKind, source: dict[str, torch.Tensor]) -> None:
        """Stage ``source``'s tensors of ``unit`` (old state, same names) without a copy where
        they fit: staging is only read, by ``settle`` and ``commit``."""
        for name, param in self._units.get(unit, {}).items():
            for staged in self._names(kind, name, param):
                t = source.get(staged)
                shape = () if staged.endswith("/step") else param.shape
                if t is not None and t.shape == shape and t.dtype == torch.float32 \
                        and t.device == param.device:
                    self._staged.setdefault((unit, staged), t)

    def settle(self, unit: StateUnit, kind: StateKind) -> None:
        """``unit``'s ``kind`` has arrived whole: keep this rank's pieces of it, let the
        staging go (a migration settles each unit as it lands, so that at most the units in
        flight are staged whole)."""
        self._keep([own for own in self._owned if own.piece.unit == unit], kind)
        self._settled.add((unit, kind))
        for name, param in self._units.get(unit, {}).items():
            for staged in self._names(kind, name, param):
                if not staged.endswith("/step"):  # (a step is kept for set_steps)
                    self._staged.pop((unit, staged), None)

    def commit(self) -> None:
        """Keep this rank's pieces of what arrived and is not settled (every tensor must
        have arrived), then set the step counts."""
        for kind in ("params", "optimizer"):
            self._keep([own for own in self._owned
                        if (own.piece.unit, kind) not in self._settled], kind)
        set_steps(self._steps)
        self._staged.clear()
        self._steps = []

    @torch.no_grad()
    def _keep(self, owns: list[Owned], kind: StateKind) -> None:
        for own in owns:
            p = own.piece
            if kind == "params":
                main = self._staged.get((p.unit, f"{p.name}/main"))
                if main is not None:
                    own.main.copy_(main.view(-1)[p.start:p.end])
                continue
            values = {}
            for key in self._keys:
                staged = self._staged[(p.unit, f"{p.name}/{key}")]
                values[key] = staged if key == "step" else staged.view(-1)[p.start:p.end]
            own.slot.write(values)
            if "step" in values:
                self._steps.append((own.slot, values["step"]))


def sink_view(model: list[torch.nn.Module], optimizer: Any) -> ModelState | ShardSink:
    """The new model and optimizer as the restorer's executor fills them (then ``commit``)."""
    if is_distributed(optimizer):
        return ShardSink(model, optimizer)
    return ModelState(model, optimizer, role="sink")
