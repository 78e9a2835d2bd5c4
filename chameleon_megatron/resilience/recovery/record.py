"""The ``{"event": "recovery"}`` metrics record and its one-line summary for the log.

Phases, in order: detect (from the failure to this rank abandoning its step), decide
(rendezvous of survivors, run-state agreement, the decision center), regroup (new groups,
model/optimizer rebuilt), migrate (state transfers confirmed); total is from the failure to
the moment training resumes with the redone step.

The figures every member contributes (memory peaks, bytes moved) are summed over the
recovery group (``gather_peaks``, ``group_sum``: collectives).
"""

from __future__ import annotations

import time
from typing import Any, Iterable, Sequence

import torch

from chameleon_megatron.resilience.decision.center import RecoveryDecision
from chameleon_megatron.resilience.store.announce import FailureRecord

PHASES = ("detect", "decide", "regroup", "migrate")


class PhaseClock:
    """Wall-clock phase durations of one recovery, starting at the failure itself."""

    def __init__(self, failed_at: float) -> None:
        self._start = self._last = failed_at
        self._phases: dict[str, float] = {}

    def mark(self, phase: str, now: float | None = None) -> None:
        """End ``phase`` now (a phase repeated by a retried recovery accumulates)."""
        if phase not in PHASES:
            raise ValueError(f"phase={phase!r}: must be one of {list(PHASES)}")
        now = time.time() if now is None else now
        self._phases[phase] = self._phases.get(phase, 0.0) + max(0.0, now - self._last)
        self._last = now

    def phases(self) -> dict[str, float]:
        out = {p: self._phases.get(p, 0.0) for p in PHASES}
        out["total"] = max(0.0, self._last - self._start)
        return out


def recovery_record(*, generation: int, failures: Iterable[FailureRecord],
                    decision: dict[str, Any], phases: dict[str, float],
                    layout_after: dict[str, Any], spares: Iterable[int], redo_iteration: int,
                    migrated_bytes: int, fallback: str | None = None, cause: str = "failure",
                    joined: Iterable[int] = (),
                    state_from: dict[str, Any] | None = None,
                    memory: dict[str, Any] | None = None) -> dict[str, Any]:
    """``cause``: "failure"; a change between steps without one: "join" (new members
    admitted: ``joined``) or "replan" (leaving rerouting for a re-planned layout); or why a
    live rank abandoned a step that every rank then redid ("oom"). ``state_from``: where the
    state came from ("replicas": surviving copies of each unit; "shard copies": the
    distributed optimizer's host copies and their step; "checkpoint")."""
    failures = sorted(failures, key=lambda f: f.rank)
    return {
        "event": "recovery",
        "cause": cause,
        "generation": generation,
        "failed_ranks": [f.rank for f in failures],
        "failures": [{"rank": f.rank, "reason": f.reason, "exitcode": f.exitcode,
                      "signal": f.signal, "failed_at": f.failed_at} for f in failures],
        "decision": decision,
        "phases_s": phases,
        "layout_after": layout_after,
        "spares": sorted(spares),
        "redo_iteration": redo_iteration,
        "migrated_bytes": migrated_bytes,
        "fallback": fallback,
        "joined": sorted(joined),
        "state_from": state_from or {"source": "replicas"},
        "memory_peak_bytes": memory or {},
    }


def summary(record: dict[str, Any]) -> str:
    """One readable line for the log."""
    p = record["phases_s"]
    how = "from checkpoint" if record["fallback"] == "checkpoint" else "in memory"
    cause = record["cause"]
    what = {"failure": f"recovered {how} from failure of ranks {record['failed_ranks']}",
            "join": f"grew the job with ranks {record['joined']}",
            "replan": "left rerouting for a re-planned layout"}.get(
                cause, f"every rank redid a step abandoned for {cause}")
    layout = record["layout_after"]
    where = layout.get("plan", layout) if isinstance(layout, dict) else layout
    return (f"{what} "
            f"(generation {record['generation']}): layout {where}, "
            f"spares {record['spares']}, redo iteration {record['redo_iteration']}; "
            f"detect {p['detect']:.2f} s, decide {p['decide']:.2f} s, "
            f"regroup {p['regroup']:.2f} s, migrate {p['migrate']:.2f} s, "
            f"total {p['total']:.2f} s, {record['migrated_bytes'] / 2**20:.1f} MiB moved")


def layout_after(decision: RecoveryDecision) -> dict[str, Any]:
    """The record's ``layout_after``: the layout the recovery leaves the job in."""
    plan = decision.plan
    out: dict[str, Any] = {"mode": decision.mode, "ranks": list(decision.active),
                           "plan": plan.describe()}
    if decision.mode == "megatron":
        lay = decision.layout
        out.update(tp=lay.tp, pp=lay.pp, dp=lay.dp)
    else:
        out["pipelines"] = [{"stages": [list(st.ranks) for st in p.stages],
                             "layers": [len(st.layers) for st in p.stages],
                             "microbatches": p.microbatches} for p in plan.pipelines]
    if decision.reroute is not None:
        out["rerouted"] = list(decision.reroute.failed_ranks)
    return out


def gather_peaks(group: Any, members: Sequence[int], me: int, steady: dict[str, int | None],
                 recovery: dict[str, int | None]) -> dict[str, Any]:
    """Every member's memory peaks, steady state and recovery, host and device (bytes; a
    kind nobody measured is left out). Collective over the recovery group."""
    kinds = [(where, window) for where in ("host", "device")
             for window in ("steady", "recovery")]
    mine = {"steady": steady, "recovery": recovery}
    # One row per member, filled by its owner with peak + 1 (0: not measured): a sum.
    table = torch.zeros((len(members), len(kinds)), dtype=torch.int64)
    table[list(members).index(me)] = torch.tensor(
        [(mine[w].get(k) or -1) + 1 for k, w in kinds], dtype=torch.int64)
    group.allreduce([table]).wait()
    table -= 1
    out: dict[str, Any] = {"ranks": list(members)}
    for j, (where, window) in enumerate(kinds):
        column = [int(v) for v in table[:, j]]
        if all(v >= 0 for v in column):
            out.setdefault(where, {})[window] = column
    return out


def group_sum(group: Any, value: int) -> int:
    """``value`` summed over the recovery group (a collective)."""
    total = torch.tensor([value], dtype=torch.int64)
    group.allreduce([total]).wait()
    return int(total.item())
