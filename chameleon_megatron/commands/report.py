"""``chameleon report METRICS.jsonl [--out PNG]``: resident saved memory with and without swap.

Reads the iteration records of a metrics file written with ``--chameleon-swap`` and draws,
per iteration, the peak of resident saved-activation bytes with swap, the peak the same
step would have had without it, and the budget; re-profiled steps and detected sequence
changes are marked. Prints a short summary.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from chameleon_megatron.training.metrics import read_metrics

MIB = 1 << 20


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("report", help="plot swap memory from a metrics file",
                              description=__doc__.splitlines()[0])
    p.add_argument("metrics", help="JSON-lines metrics file (--chameleon-metrics-file)")
    p.add_argument("--out", default=None,
                   help="PNG to write (default: METRICS with a -swap.png suffix)")
    return p


def swap_series(records: list[dict[str, Any]]) -> dict[str, list]:
    """Per-iteration columns of the records that carry swap metrics."""
    rows = [(r["iteration"], r["swap"]) for r in records if r.get("swap")]
    return {
        "iteration": [i for i, _ in rows],
        "with_swap": [s["peak_resident_saved_bytes"] for _, s in rows],
        "without_swap": [s["peak_saved_bytes"] for _, s in rows],
        "budget": [s["budget_bytes"] for _, s in rows],
        "swapped_out": [s["swapped_out_bytes"] for _, s in rows],
        "blocking": [s["blocking_swapins"] for _, s in rows],
        "planned": [s["plan_version"] > 0 for _, s in rows],
        "full": [s["mode"] == "full" for _, s in rows],
        "changed": [s["sequence_changed"] for _, s in rows],
    }


def summary(series: dict[str, list]) -> str:
    planned = [k for k, p in enumerate(series["planned"]) if p]
    top_with = max((series["with_swap"][k] for k in planned), default=0)
    top_without = max((series["without_swap"][k] for k in planned), default=0)
    saved = 100.0 * (1 - top_with / top_without) if top_without else 0.0
    return "\n".join([
        f"iterations: {len(series['iteration'])} "
        f"(re-profiled: {sum(series['full'])}, sequence changes: {sum(series['changed'])})",
        f"peak resident saved activations over the {len(planned)} iterations with a plan: "
        f"{top_with / MIB:.2f} MiB with swap, {top_without / MIB:.2f} MiB without "
        f"({saved:.1f} % less)",
        f"swapped out: {sum(series['swapped_out']) / MIB:.2f} MiB in total; "
        f"blocking swap-ins: {sum(series['blocking'])}",
    ])


def plot(series: dict[str, list], out: Path, title: str) -> None:
    from matplotlib.figure import Figure  # no pyplot: no global backend state

    fig = Figure(figsize=(8, 4.5))
    ax = fig.add_subplot()
    it = series["iteration"]
    ax.plot(it, [b / MIB for b in series["without_swap"]], "o-", label="without swap")
    ax.plot(it, [b / MIB for b in series["with_swap"]], "o-", label="with swap")
    budget = [(i, b / MIB) for i, b in zip(it, series["budget"]) if b is not None]
    if budget:
        ax.step(*zip(*budget), where="mid", linestyle="--", color="grey", label="budget")
    for i, full, changed in zip(it, series["full"], series["changed"]):
        if changed:
            ax.axvline(i, color="red", alpha=0.4)
        elif full:
            ax.axvline(i, color="grey", alpha=0.2)
    ax.set_xlabel("iteration (red: sequence changed, grey: re-profiled)")
    ax.set_ylabel("peak resident saved activations (MiB)")
    ax.set_ylim(bottom=0)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def run(args: argparse.Namespace) -> int:
    path = Path(args.metrics)
    series = swap_series(read_metrics(path, event="iteration"))
    if not series["iteration"]:
        print(f"chameleon report: {path} has no swap metrics "
              "(train with --chameleon-swap and --chameleon-metrics-file)")
        return 1
    out = Path(args.out) if args.out else path.with_name(path.stem + "-swap.png")
    plot(series, out, f"swap: {path.name}")
    print(summary(series))
    print(f"wrote {out}")
    return 0
