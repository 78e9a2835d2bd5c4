"""Eq. 8: pick the candidate with the most expected samples per second until the next
failure, score = (B / t_step) x ((D - t_transition) / D)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterable, Literal

from chameleon_megatron.resilience.decision.candidates import Candidate

log = logging.getLogger(__name__)

Strategy = Literal["adaptive", "reroute", "replan"]


def score(batch: int, t_step_s: float, t_transition_s: float, d_s: float) -> float:
    """Eq. 8; callers exclude D <= t_transition first."""
    return batch / t_step_s * ((d_s - t_transition_s) / d_s)


class NoFeasibleCandidate(ValueError):
    """No candidate can be used; ``record`` holds every candidate's reason."""

    def __init__(self, message: str, record: dict[str, Any]) -> None:
        super().__init__(message)
        self.record = record


@dataclass(frozen=True)
class Decision:
    chosen: Candidate
    record: dict[str, Any]
    """JSON-serialisable: D, B, strategy, each candidate's times, score, feasibility and
    reason, and the choice."""


def select(candidates: Iterable[Candidate], *, d_s: float, batch: int,
           strategy: Strategy = "adaptive") -> Decision:
    """Score every feasible candidate; ``strategy`` other than adaptive forces that one."""
    if not d_s > 0:
        raise ValueError(f"D={d_s}: must be > 0")
    if batch < 1:
        raise ValueError(f"B={batch}: must be >= 1")
    rows, usable = [], []
    for cand in candidates:
        row = cand.summary()
        row["score"] = None
        if cand.feasible and cand.t_transition_s is not None and cand.t_step_s is not None:
            if d_s <= cand.t_transition_s and strategy == "adaptive":
                row["feasible"] = False
                row["reason"] = f"D={d_s:.4g}s <= t_transition={cand.t_transition_s:.4g}s"
            else:
                row["score"] = score(batch, cand.t_step_s, cand.t_transition_s, d_s)
                if strategy in ("adaptive", cand.name):
                    usable.append((row["score"], cand))
        rows.append(row)
    record: dict[str, Any] = {"event": "decision", "D_s": d_s, "B": batch, "strategy": strategy,
                              "candidates": rows, "choice": None}
    if not usable:
        reasons = "; ".join(f"{r['name']}: {r['reason']}" for r in rows)
        log.debug("no feasible recovery candidate: %s", reasons)
        raise NoFeasibleCandidate(f"no feasible recovery candidate ({strategy}): {reasons}", record)
    best_score, chosen = max(usable, key=lambda x: x[0])
    record["choice"] = chosen.name
    log.debug("recovery decision %s", record)
    return Decision(chosen=chosen, record=record)
