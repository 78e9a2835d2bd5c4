"""This rank's random-number state: the CPU generator, CUDA's, and megatron's TP tracker."""

from __future__ import annotations

from typing import Any

import torch
from megatron.core import tensor_parallel


def rng_state() -> dict[str, Any]:
    """Everything needed to continue this rank's random streams exactly."""
    state = {
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
