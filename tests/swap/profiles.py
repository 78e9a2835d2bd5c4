"""Hand-made and random step profiles for the policy tests (no executor involved)."""

from __future__ import annotations

import random
from types import MappingProxyType

from chameleon_megatron.swap.profile import FREE, PACK, USE, StepProfile, TensorRecord
from chameleon_megatron.swap.signature import StepSignature


def make_profile(tensors: list[tuple[int, bool]], events: list[tuple[int, int]],
                 times: list[float] | None = None) -> StepProfile:
    """tensors: (nbytes, swappable) per uid; events: (uid, kind) in order."""
    first = {}
    for e, (uid, kind) in enumerate(events):
        first.setdefault((uid, kind), e)
    records = tuple(
        TensorRecord(uid=uid, stage=("F", 0, 0, -1), ordinal=uid, op="X", code=0, history=0,
                     occurrence=uid, nbytes=nbytes, shape=(nbytes,), swappable=swappable,
                     pack_event=first[(uid, PACK)], use_event=first.get((uid, USE), -1),
                     free_event=first.get((uid, FREE), -1), device_bytes=0)
        for uid, (nbytes, swappable) in enumerate(tensors))
    return StepProfile(records=records, events=tuple(events),
                       event_times=tuple(times if times is not None else range(len(events))),
                       signature=StepSignature(MappingProxyType({})))


def random_profile(rng: random.Random, n: int, *, max_bytes: int = 100,
                   p_unused: float = 0.15, p_fixed: float = 0.15) -> StepProfile:
    """n storages with random pack < use < free order; some unused, some unswappable."""
    slots = list(range(3 * n))
    rng.shuffle(slots)
    events: list[tuple[int, int] | None] = [None] * (3 * n)
    tensors = []
    for uid in range(n):
        pack, use, free = sorted(slots[3 * uid:3 * uid + 3])
        events[pack] = (uid, PACK)
        events[free] = (uid, FREE)
        unused = rng.random() < p_unused
        events[use] = None if unused else (uid, USE)
        tensors.append((rng.randint(1, max_bytes), rng.random() >= p_fixed))
    kept = [e for e in events if e is not None]
    times, t = [], 0.0
    for _ in kept:
        t += rng.choice([0.0, 0.5, 1.0, 2.0])
        times.append(t)
    return make_profile(tensors, kept, times)
