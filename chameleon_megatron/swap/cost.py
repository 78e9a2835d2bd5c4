"""The profiler's own cost per saved tensor, calibrated once at start-up.

Reading a clock around each hook call would cost more than the work it times (a clock
read is ~0.6 us on some VMs; a lightweight update is a fraction of that), so the hot-path
cost is calibrated once by running the same profiler calls on dummy data, and a step's
cost is the number of calls times that, plus the end-of-step work, which is timed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from chameleon_megatron.swap.recorder import FullRecorder
from chameleon_megatron.swap.signature import StageStats


@dataclass(frozen=True)
class ProfilerCost:
    light_s: float
    """Seconds per saved tensor in lightweight mode (signature update)."""
    full_s: float
    """Seconds per saved tensor in full mode (signature update, record, use and release)."""


def measure_profiler_cost(samples: int = 20000) -> ProfilerCost:
    """Time ``samples`` profiler calls of each mode on dummy data, minus the loop's own cost."""
    stats = StageStats(("F", 0, 0, 0))
    shape = torch.Size((2, 3))
    rec = FullRecorder()

    def light(i: int) -> None:
        stats.add(i & 63, 4096)

    def full(i: int) -> None:
        stats.add(i & 63, 4096)
        uid = rec.on_pack(stats.key, i, i & 63, 0, 0, 4096, tuple(shape), True, 0, 0)
        rec.on_use(uid, 0)
        rec.on_free(uid, 0)

    empty = _per_call(lambda i: None, samples)
    return ProfilerCost(light_s=max(_per_call(light, samples) - empty, 0.0),
                        full_s=max(_per_call(full, samples) - empty, 0.0))


def _per_call(fn: Callable[[int], None], samples: int) -> float:
    start = time.perf_counter()
    for i in range(samples):
        fn(i)
    return (time.perf_counter() - start) / samples
