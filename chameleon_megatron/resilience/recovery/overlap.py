"""How little of the old layout a recovery keeps while it builds the new one.

The migration reads the old parameters and optimizer state while it fills the new ones, so
the two overlap in memory. The overlap is bounded to what the migration reads: a survivor
keeps only its old state's tensors (``SourceTensors``); the old model, its DDP gradient
buffers, the optimizer's wrappers, the engine and runtime with their communicators, and the
failed step's activations are let go (``free_layout``) before the new layout allocates. A
unit that stays on its rank is not copied: the new optimizer adopts the old state tensors
(``adopt_local``), so the new layout adds its parameters and gradient buffers, and the state
of the units it receives, to the old state, not a second copy of all of it. (Units rebuilt
from the distributed optimizer's shard copies are built, and adopted, one wave at a time by
the migration itself: ``transfer.migrate``.)
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
from typing import Any, Sequence

import torch

from chameleon_megatron.resilience.decision.layout import StateUnit
from chameleon_megatron.resilience.decision.restorer import StateKind, Transfer

KINDS: tuple[StateKind, ...] = ("params", "optimizer")


class SourceTensors:
    """A ``StateView`` of old state: each unit's tensors taken from a source view (model
    state), without the modules and optimizer that held them."""

    def __init__(self, view: Any) -> None:
        self._tensors = {(unit, kind): view.tensors(unit, kind)
                         for unit in view.units() for kind in KINDS}

    def units(self) -> tuple[StateUnit, ...]:
        return tuple(dict.fromkeys(unit for unit, _ in self._tensors))

    def tensors(self, unit: StateUnit, kind: StateKind) -> dict[str, torch.Tensor]:
        return self._tensors.get((unit, kind), {})


def free_layout(trainer: Any) -> None:
    """The trainer lets go of its layout, whose memory goes back (``give_back``) before the
    new layout's groups and model allocate."""
    trainer.drop_layout()
    give_back()


def give_back() -> None:
    """Collect cycles (DDP's hooks hold DDP) and hand freed memory back: torch's CUDA cache,
    and the C heap's free pages (glibc keeps them resident, where the new layout's large
    allocations, mapped afresh, cannot reuse them)."""
    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    libc = ctypes.util.find_library("c")
    trim = getattr(ctypes.CDLL(libc), "malloc_trim", None) if libc else None
    if trim is not None:  # glibc
        trim(0)


def adopt_local(old: Any, new: Any, transfers: Sequence[Transfer], me: int) -> None:
    """Let ``new`` take the old tensors of this rank's local transfers as its own, where the
    sink can (``adopt``); the migration's local copy then finds them in place."""
    adopt = getattr(new, "adopt", None)
    if adopt is None:
        return
    for t in transfers:
        if t.src == me and t.dst == me:
            adopt(t.layer, t.kind, old.tensors(t.layer, t.kind))
