"""Failure traces: device failures and repairs over time, drawn or read from JSON."""

from __future__ import annotations

import heapq
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal, Sequence

import numpy as np

from chameleon_megatron.errors import UserError, reading


@dataclass(frozen=True, order=True)
class Event:
    time_s: float
    kind: Literal["fail", "repair"]
    rank: int


def draw_trace(world_size: int, horizon_s: float, mtbf_s: float, repair_s: float | None,
               seed: int) -> tuple[Event, ...]:
    """Poisson failures (job MTBF ``mtbf_s`` at full size, so each device fails at rate
    1 / (mtbf_s x world_size)) of uniformly chosen healthy devices; each is repaired after
    an exponential time of mean ``repair_s`` (None or 0: never)."""
    if world_size < 1 or horizon_s <= 0 or mtbf_s <= 0:
        raise ValueError(f"world_size={world_size}, horizon_s={horizon_s}, mtbf_s={mtbf_s}: "
                         "must be >= 1, > 0, > 0")
    rng = np.random.default_rng(seed)
    rate = 1.0 / (mtbf_s * world_size)
    healthy = list(range(world_size))
    repairs: list[tuple[float, int]] = []
    events: list[Event] = []
    t = 0.0
    while True:
        gap = rng.exponential(1.0 / (rate * len(healthy))) if healthy else np.inf
        if repairs and repairs[0][0] <= t + gap:
            t, rank = heapq.heappop(repairs)
            if t >= horizon_s:
                break
            healthy.append(rank)
            events.append(Event(t, "repair", rank))
            continue
        t += gap
        if t >= horizon_s:
            break
        rank = healthy.pop(int(rng.integers(len(healthy))))
        events.append(Event(t, "fail", rank))
        if repair_s:
            heapq.heappush(repairs, (t + rng.exponential(repair_s), rank))
    return tuple(events)


def check_trace(events: Sequence[Event], world_size: int) -> tuple[Event, ...]:
    """Sorted events, refusing unknown ranks, a failure of a failed rank, or a repair of a
    healthy one."""
    down: set[int] = set()
    out = tuple(sorted(events))
    for e in out:
        if not 0 <= e.rank < world_size:
            raise ValueError(f"trace event {e}: rank outside [0, {world_size})")
        if e.kind == "fail":
            if e.rank in down:
                raise ValueError(f"trace event {e}: rank {e.rank} is already down")
            down.add(e.rank)
        elif e.kind == "repair":
            if e.rank not in down:
                raise ValueError(f"trace event {e}: rank {e.rank} is not down")
            down.discard(e.rank)
        else:
            raise ValueError(f"trace event {e}: kind must be 'fail' or 'repair'")
    return out


def load_trace(path: str | Path) -> tuple[Event, ...]:
    """JSON list of {"time_s": t, "kind": "fail"|"repair", "rank": r}."""
    with reading(path):
        data = json.loads(Path(path).read_text())
    try:
        return tuple(Event(float(e["time_s"]), e["kind"], int(e["rank"])) for e in data)
    except (KeyError, TypeError, ValueError) as exc:
        raise UserError(f"{path}: each event must be {{\"time_s\": t, \"kind\": \"fail\" or "
                        f"\"repair\", \"rank\": r}} ({type(exc).__name__}: {exc})") from None


def save_trace(events: Sequence[Event], path: str | Path) -> None:
    Path(path).write_text(json.dumps([asdict(e) for e in events], indent=1) + "\n")
