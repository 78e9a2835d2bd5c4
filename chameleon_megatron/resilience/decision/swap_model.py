"""Swap-aware memory: a stage over device memory made to fit by swapping activations (pure).

This joins the two halves of the project: where Eq. 14 puts a stage over the device's
memory, the swap subsystem can keep part of each waiting microbatch's activations on the
host, at a stall the copies cost.

A stage holds ``static`` bytes (parameters, gradients, optimizer state) and, at its 1F1B
peak, ``k`` microbatches' activations of ``act`` bytes each. With ``cap`` bytes of device
memory the activations may use ``budget = cap - static``; ``over = static + k act - cap``
bytes must be on the host at the peak. The microbatch being computed stays resident, so the
stage fits only when ``static + act <= cap``; the ``k - 1`` waiting microbatches then each
keep ``s = over / (k - 1)`` bytes on the host: ``s`` goes out during its forward and comes
back during its backward, on their own copy streams. A copy hides behind the compute it
overlaps, so the stage's forward of a microbatch takes ``max(t_f, s / bw)`` and its backward
``max(t_b, s / bw)``: the stall is what the copies add to the stage's times, and the
pipeline schedule carries it to the step time.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StageSwap:
    """How a stage fits: its activation budget and what swapping costs."""

    budget_bytes: float
    """Activation bytes that may stay on the device (``cap - static``)."""
    fraction: float
    """That budget as a share of the stage's no-swap activation peak (``k act``): what the
    swap subsystem of the rank is told to keep (it measures its own peak)."""
    swapped_bytes: float
    """Per waiting microbatch, bytes out in forward and back in backward."""
    forward_s: float
    backward_s: float
    """Per-microbatch times with the copies."""
    stall_s: float
    """Time the copies add to the stage per step (``m`` microbatches)."""


def stage_swap(*, static: float, act: float, in_flight: float, forward_s: float,
               backward_s: float, microbatches: int, cap: float,
               bandwidth_Bps: float) -> StageSwap | None:
    """The swap that makes the stage fit ``cap``; None when it fits without one.
    ValueError when it cannot fit even so, or swapping is off (bandwidth 0)."""
    peak = static + in_flight * act
    if peak <= cap:
        return None
    if bandwidth_Bps <= 0:
        raise ValueError(f"the stage needs {peak:.4g} bytes, more than {cap:.4g}, and the job "
                         "does not swap")
    if static + act > cap or in_flight <= 1:
        raise ValueError(f"the stage needs {static + act:.4g} bytes with one microbatch "
                         f"resident, more than {cap:.4g}: swapping cannot fit it")
    s = (peak - cap) / (in_flight - 1)
    copy = s / bandwidth_Bps
    f, b = max(forward_s, copy), max(backward_s, copy)
    budget = cap - static
    return StageSwap(budget_bytes=budget, fraction=budget / (in_flight * act),
                     swapped_bytes=s, forward_s=f, backward_s=b,
                     stall_s=microbatches * (f - forward_s + b - backward_s))


def swap_times(f: np.ndarray, b: np.ndarray, static: np.ndarray, act: np.ndarray,
               in_flight: np.ndarray, cap: float,
               bandwidth_Bps: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``stage_swap`` over arrays of stages (elementwise, broadcast): the per-microbatch
    times with copies, and whether each stage fits."""
    peak = static + in_flight * act
    over = np.maximum(peak - cap, 0.0)
    if bandwidth_Bps <= 0:
        return f, b, over <= 0
    fits = (over <= 0) | ((static + act <= cap) & (in_flight > 1))
    waiting = np.maximum(in_flight - 1, 1)
    copy = over / waiting / bandwidth_Bps
    return np.maximum(f, copy), np.maximum(b, copy), fits
