"""Throughput over time of each strategy, as a PNG (matplotlib, Agg backend)."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

from chameleon_megatron.sim.engine import StrategyResult


def plot_throughput(results: Mapping[str, StrategyResult], failure_free: float,
                    path: str | Path, title: str = "") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    for name, r in results.items():
        xs, ys = [], []
        for start, end, rate in r.segments:
            xs += [start / 3600, end / 3600]
            ys += [rate, rate]
        ax.plot(xs, ys, label=f"{name} (avg {r.avg_throughput:.1f})", linewidth=1.2)
    ax.axhline(failure_free, color="grey", linestyle="--", linewidth=0.8,
               label=f"failure-free ({failure_free:.1f})")
    ax.set_xlabel("time (h)")
    ax.set_ylabel("samples/s")
    ax.set_title(title)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
