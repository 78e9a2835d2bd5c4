"""The recovery timeline of ``chameleon report``, for a metrics file of a ``--chameleon-ft`` run.

Throughput (tokens/s, else samples/s) of each iteration record as a step line over time:
the steps' ``step_time_s`` and each recovery's phases (``phases_s``: detect, decide,
regroup, migrate) laid end to end in the order the file has them, so evaluation and
checkpoint time is not on the axis; without step times, one unit per iteration and per
recovery. Each recovery's phases are shaded, and each layout is labelled where it starts
(the plan string of the decision, else tp/pp/dp). A recovery record without phases (a
relaunch from the checkpoint, a restart) is a dashed line. Prints one paragraph per recovery:
phases, the decision with each candidate's estimate and score, the layouts before and after.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

PHASE_COLOURS = {"detect": "tab:red", "decide": "tab:orange", "regroup": "tab:blue",
                 "migrate": "tab:purple"}
MIB = 1 << 20


def is_ft(records: list[dict[str, Any]]) -> bool:
    """Whether the records are of a fault-tolerance run (recoveries, or iterations with the
    ``ft`` figures)."""
    return any(r.get("event") == "recovery" or (r.get("event") == "iteration" and "ft" in r)
               for r in records)


def phases(record: dict[str, Any]) -> dict[str, float]:
    """A recovery's phase durations in order (``total`` left out)."""
    return {k: float(v) for k, v in (record.get("phases_s") or {}).items() if k != "total"}


def layout_label(layout: dict[str, Any] | str | None) -> str:
    """The plan string when there is one, else tp/pp/dp; rerouted ranks named."""
    if not layout:
        return "?"
    if isinstance(layout, str):
        return layout
    label = layout.get("plan") or " ".join(
        f"{k}{layout[k]}" for k in ("tp", "pp", "dp") if k in layout)
    if layout.get("rerouted"):
        label += f" rerouting {layout['rerouted']}"
    return label


@dataclass
class Timeline:
    """What the figure draws, in x units of seconds or iterations."""

    timed: bool
    """x in seconds (else: iterations)."""
    unit: str
    xs: list[float] = field(default_factory=list)
    ys: list[float] = field(default_factory=list)
    spans: list[tuple[float, float, str]] = field(default_factory=list)
    """(start, end, phase) of every recovery's phases."""
    marks: list[tuple[float, str]] = field(default_factory=list)
    """Recoveries without phases: (x, what)."""
    layouts: list[tuple[float, str]] = field(default_factory=list)
    """(x where a layout starts, its label)."""


def _first_layout(records: list[dict[str, Any]]) -> str:
    """The first recovery's plan before it (a plan string says more than tp/pp/dp), else
    the first iteration's layout."""
    for r in records:
        if r.get("event") == "recovery" and (r.get("decision") or {}).get("layout_before"):
            return r["decision"]["layout_before"]
    first = next((r for r in records if r.get("event") == "iteration"), {})
    return layout_label(first.get("layout"))


def _rate(r: dict[str, Any], unit: str) -> float:
    if unit == "tokens/s":
        return float(r["tokens_per_s"])
    step, batch = r.get("step_time_s"), r.get("global_batch_size")
    return batch / step if step and batch else math.nan


def timeline(records: list[dict[str, Any]]) -> Timeline:
    """Lay the iterations and recoveries of one run out in file order."""
    iterations = [r for r in records if r.get("event") == "iteration"]
    timed = bool(iterations) and all(r.get("step_time_s") for r in iterations)
    unit = "tokens/s" if iterations and all("tokens_per_s" in r for r in iterations) \
        else "samples/s"
    t = Timeline(timed, unit, layouts=[(0.0, _first_layout(records))])
    x = 0.0
    for r in records:
        if r.get("event") == "iteration":
            width = r["step_time_s"] if timed else 1.0
            t.xs += [x, x + width]
            t.ys += [_rate(r, unit)] * 2
            x += width
        elif r.get("event") == "recovery":
            t.xs.append(math.nan)  # no training while recovering: a gap
            t.ys.append(math.nan)
            x = _recovery(t, r, x)
    return t


def _recovery(t: Timeline, r: dict[str, Any], x: float) -> float:
    """Lay one recovery out from ``x``; where it ends."""
    p = phases(r)
    if not p:
        t.marks.append((x, _cause(r)))
        return x
    total = sum(p.values())
    for name, seconds in p.items():
        # untimed: the recovery takes one unit, split as its phases took
        width = seconds if t.timed else (seconds / total if total else 1 / len(p))
        t.spans.append((x, x + width, name))
        x += width
    t.layouts.append((x, layout_label(r.get("layout_after") or
                                      (r.get("decision") or {}).get("layout_after"))))
    return x


def plot(t: Timeline, out: Path, title: str) -> Figure:
    """Throughput with the recoveries' phases shaded; returns the figure (written to ``out``)."""
    from matplotlib.figure import Figure  # no pyplot: no global backend state

    fig = Figure(figsize=(10, 4.5), layout="constrained")
    ax = fig.add_subplot()
    ax.plot(t.xs, t.ys, color="black", linewidth=1.5, gid="throughput", label=t.unit)
    _shade(ax, t)
    top = max((y for y in t.ys if not math.isnan(y)), default=1.0)
    ax.set_ylim(0, 1.35 * top)  # room for the layout labels above the line
    ax.set_ylabel(t.unit)
    ax.set_xlabel("time (s): steps and recoveries end to end (evaluation, checkpoints left out)"
                  if t.timed else "iteration (a recovery: one unit, split as its phases took)")
    ax.set_title(title)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.savefig(out, dpi=110)
    return fig


def _shade(ax: Axes, t: Timeline) -> None:
    labelled: set[str] = set()
    for start, end, name in t.spans:
        ax.axvspan(start, end, color=PHASE_COLOURS.get(name, "tab:gray"), alpha=0.35,
                   linewidth=0, gid=f"phase:{name}",
                   label=None if name in labelled else f"recovery: {name}")
        labelled.add(name)
    for x, what in t.marks:
        ax.axvline(x, color="red", linestyle="--", gid="recovery:no-phases")
        ax.text(x, 0.02, f" {what}", transform=ax.get_xaxis_transform(), fontsize=8,
                color="red")
    end = max((x for x in t.xs if not math.isnan(x)), default=1.0)
    for k, (x, label) in enumerate(t.layouts):
        # late layouts point back at their start: written rightwards they would leave the axes
        late = x > 0.7 * end
        ax.axvline(x, color="grey", linestyle=":", linewidth=0.8)
        # three staggered rows: layouts of short periods must not overwrite each other
        ax.text(x, 0.97 - 0.07 * (k % 3), f"{label} \u2192" if late else f" {label}",
                transform=ax.get_xaxis_transform(), va="top", ha="right" if late else "left",
                fontsize=8, gid="layout")


def summary(records: list[dict[str, Any]]) -> str:
    """A count, then a few lines per recovery."""
    recoveries = [r for r in records if r.get("event") == "recovery"]
    seconds = sum((r.get("phases_s") or {}).get("total", 0.0) for r in recoveries)
    lines = [f"recoveries: {len(recoveries)} ({seconds:.2f} s in total)"]
    for k, r in enumerate(recoveries, 1):
        lines += _describe(k, r)
    return "\n".join(lines)


def _cause(r: dict[str, Any]) -> str:
    """What started a recovery (the record of a lost job store has only its fallback)."""
    return r.get("cause") or f"fallback {r.get('fallback')}"


def _describe(k: int, r: dict[str, Any]) -> list[str]:
    head = f"recovery {k}: {_cause(r)}"
    if r.get("failed_ranks"):
        head += f" of ranks {r['failed_ranks']}"
    if "redo_iteration" in r:
        head += f", resumed at iteration {r['redo_iteration']} (generation {r['generation']})"
    if not phases(r):
        extra = {key: r[key] for key in ("fallback", "resumed_iteration", "world_size", "error")
                 if r.get(key) is not None}
        return [head, f"  no phases recorded: {extra}"]
    p = r["phases_s"]
    d = r.get("decision") or {}
    cands = "; ".join(_candidate(c) for c in d.get("candidates", []))
    return [
        head,
        "  phases: " + ", ".join(f"{n} {s:.2f} s" for n, s in phases(r).items())
        + f"; total {p.get('total', sum(phases(r).values())):.2f} s",
        f"  decision: {d.get('executed', d.get('choice', '?'))} "
        f"({d.get('executed_reason', 'no reason recorded')}"
        + (f", D {d['D_s']:.0f} s" if d.get("D_s") is not None else "")
        + (f", fallback {r['fallback']}" if r.get("fallback") else "") + f"): {cands}",
        f"  layout: {d.get('layout_before', '?')} -> {layout_label(r.get('layout_after'))}; "
        f"{r.get('migrated_bytes', 0) / MIB:.1f} MiB moved",
    ]


def _candidate(c: dict[str, Any]) -> str:
    if not c.get("feasible", True):
        return f"{c['name']} infeasible ({c.get('reason')})"
    return (f"{c['name']} step {c.get('t_step_s', 0):.4g} s + transition "
            f"{c.get('t_transition_s', 0):.3g} s, score {c.get('score', 0):.4g}")


def report(records: list[dict[str, Any]], out: Path, title: str) -> Figure:
    """Print the summary, write the timeline to ``out``; returns the figure."""
    fig = plot(timeline(records), out, title)
    print(summary(records))
    return fig
