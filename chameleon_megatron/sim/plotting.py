"""The figure of ``chameleon simulate --plot``: throughput over time of each strategy, the
trace's failures and repairs, and each strategy's average, as a PNG.

Three panels: a thin event strip (failures: red x, repairs: green ^), throughput over time
below it (one step line per strategy at the rate it trains between events; downtime is a
gap, not a drop to zero; Chameleon thick, black and on top), and on the right each
strategy's average throughput as bars with their values (the failure-free rate dashed).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Sequence

from chameleon_megatron.sim.engine import StrategyResult
from chameleon_megatron.sim.traces import Event

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

HIGHLIGHT = "chameleon"
HIGHLIGHT_COLOUR = "black"
# No red or green: those mark failures and repairs.
PALETTE = ("tab:blue", "tab:orange", "tab:purple", "tab:brown", "tab:pink", "tab:olive",
           "tab:cyan", "tab:gray")
DPI = 110
HOUR = 3600.0


def colours(names: Sequence[str]) -> dict[str, str]:
    """One colour per strategy, the same in every panel; Chameleon's stands out."""
    others = iter(PALETTE * (1 + len(names) // len(PALETTE)))
    return {n: HIGHLIGHT_COLOUR if n == HIGHLIGHT else next(others) for n in names}


def drawing_order(names: Sequence[str]) -> list[str]:
    """Chameleon last, so that no baseline covers it."""
    return [n for n in names if n != HIGHLIGHT] + [n for n in names if n == HIGHLIGHT]


def step_xy(segments: Sequence[tuple[float, float, float]]) -> tuple[list[float], list[float]]:
    """Step-line points (hours, samples/s); a segment without training breaks the line."""
    xs: list[float] = []
    ys: list[float] = []
    for start, end, rate in segments:
        if end <= start:
            continue
        if rate <= 0:
            if xs and not math.isnan(ys[-1]):
                xs.append(math.nan)
                ys.append(math.nan)
            continue
        xs += [start / HOUR, end / HOUR]
        ys += [rate, rate]
    return xs, ys


def plot_throughput(results: Mapping[str, StrategyResult], failure_free: float,
                    path: str | Path, title: str = "",
                    events: Sequence[Event] = ()) -> Figure:
    """Draw the figure, write it to ``path`` and return it (for tests)."""
    from matplotlib.figure import Figure  # no pyplot: no global backend state

    fig = Figure(figsize=(13, 5.5), layout="constrained")
    grid = fig.add_gridspec(2, 2, height_ratios=(1, 7), width_ratios=(3, 1))
    strip = fig.add_subplot(grid[0, 0])
    lines = fig.add_subplot(grid[1, 0], sharex=strip)
    bars = fig.add_subplot(grid[:, 1])
    horizon = max((r.horizon_s for r in results.values()), default=0.0)
    colour = colours(list(results))
    _events(strip, events, horizon)
    _lines(lines, results, colour, failure_free)
    _averages(bars, results, colour, failure_free)
    lines.set_xlim(0, horizon / HOUR)
    if title:
        fig.suptitle(title)
    fig.savefig(path, dpi=DPI)
    return fig


def _events(ax: Axes, events: Sequence[Event], horizon_s: float) -> None:
    shown = [e for e in events if e.time_s < horizon_s]
    for kind, y, style in (("fail", 1, dict(marker="x", color="red")),
                           ("repair", 0, dict(marker="^", color="green"))):
        times = [e.time_s / HOUR for e in shown if e.kind == kind]
        ax.plot(times, [y] * len(times), linestyle="none", markersize=6, gid=f"events:{kind}",
                label=f"{'failures' if kind == 'fail' else 'repairs'} ({len(times)})", **style)
    ax.set_ylim(-0.7, 1.7)
    ax.set_yticks([0, 1], ["repair", "failure"], fontsize=8)
    ax.tick_params(axis="x", labelbottom=False, length=0)
    for side in ("top", "right", "bottom"):
        ax.spines[side].set_visible(False)
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8, frameon=False)


def _lines(ax: Axes, results: Mapping[str, StrategyResult], colour: Mapping[str, str],
           failure_free: float) -> None:
    for z, name in enumerate(drawing_order(list(results)), start=2):
        top = name == HIGHLIGHT
        ax.plot(*step_xy(results[name].segments), color=colour[name], gid=f"strategy:{name}",
                linewidth=2.6 if top else 1.2, alpha=1.0 if top else 0.85, zorder=z,
                label=name)
    ax.axhline(failure_free, color="grey", linestyle="--", linewidth=0.8, zorder=1,
               label="failure-free")
    ax.set_ylim(bottom=0)
    ax.set_xlabel("time (h); a gap: the strategy is down (detection, restart, transition)")
    ax.set_ylabel("samples/s")
    handles, labels = ax.get_legend_handles_labels()
    order = sorted(range(len(labels)), key=lambda k: labels[k] != HIGHLIGHT)
    ax.legend([handles[k] for k in order], [labels[k] for k in order], fontsize=8,
              loc="lower left")


def _averages(ax: Axes, results: Mapping[str, StrategyResult], colour: Mapping[str, str],
              failure_free: float) -> None:
    names = list(reversed(drawing_order(list(results))))  # Chameleon at the top
    avg = [results[n].avg_throughput for n in names]
    container = ax.barh(range(len(names)), avg, color=[colour[n] for n in names],
                        gid="averages")
    ax.set_yticks(range(len(names)), names)
    share = [f"{v:.1f} ({v / failure_free:.0%})" if failure_free > 0 else f"{v:.1f}"
             for v in avg]
    ax.bar_label(container, share, padding=3, fontsize=8)
    ax.axvline(failure_free, color="grey", linestyle="--", linewidth=0.8)
    ax.invert_yaxis()
    ax.set_xlim(0, 1.45 * max([failure_free, *avg]))
    ax.set_xlabel("average samples/s (% of failure-free)")
    for tick in ax.get_yticklabels():
        if tick.get_text() == HIGHLIGHT:
            tick.set_fontweight("bold")
