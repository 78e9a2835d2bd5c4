"""``chameleon report METRICS.jsonl``: swap memory and recoveries from a metrics file.

Swap (iteration records of a ``--chameleon-swap`` run; ``--out``, default METRICS-swap.png):
per pipeline stage (one panel each: the budgets are per stage) and per iteration, the peak
of resident saved-activation bytes with swap, the peak the same step would have had without
it, and the budget; re-profiled steps and detected sequence changes are marked. Prints a
short summary per stage.

Recoveries (a ``--chameleon-ft`` run; ``--recovery-out``, default METRICS-recovery.png):
throughput over time with each recovery's phases shaded and each layout labelled, and a
summary of each recovery (``report_recovery``). A file with both gets both figures.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from chameleon_megatron.commands import report_recovery
from chameleon_megatron.metrics_file import read_metrics

MIB = 1 << 20


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("report", description=__doc__,
                              help="plot swap memory and recoveries from a metrics file",
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("metrics", help="JSON-lines metrics file (--chameleon-metrics-file)")
    p.add_argument("--out", default=None,
                   help="swap PNG to write (default: METRICS with a -swap.png suffix)")
    p.add_argument("--run", type=int, default=None,
                   help="which run of the file (run ids count from 1; default: the last)")
    p.add_argument("--baseline", default=None, metavar="METRICS",
                   help="metrics file of a reference run (e.g. without the failure): compare "
                        "the losses, iteration by iteration")
    p.add_argument("--recovery-out", default=None,
                   help="recovery timeline PNG of a --chameleon-ft run (default: METRICS with "
                        "a -recovery.png suffix)")
    return p


def _stages(swap: dict[str, Any]) -> list[dict[str, Any]]:
    """Each stage's figures of one record (older records: the writer's own, as stage 0)."""
    return swap.get("stages") or [{**swap, "stage": 0}]


def swap_series(records: list[dict[str, Any]]) -> dict[int, dict[str, list]]:
    """Per stage, per-iteration columns of the records that carry swap metrics."""
    out: dict[int, dict[str, list]] = {}
    for r in records:
        swap = r.get("swap")
        if not swap:
            continue
        for s in _stages(swap):
            col = out.setdefault(s["stage"], {k: [] for k in (
                "iteration", "with_swap", "without_swap", "budget", "swapped_out", "blocking",
                "planned", "full", "changed")})
            col["iteration"].append(r["iteration"])
            col["with_swap"].append(s["peak_resident_saved_bytes"])
            col["without_swap"].append(s["peak_saved_bytes"])
            col["budget"].append(s["budget_bytes"])
            col["swapped_out"].append(s["swapped_out_bytes"])
            col["blocking"].append(s["blocking_swapins"])
            col["planned"].append(s["plan_version"] > 0)
            col["full"].append(s["mode"] == "full")
            col["changed"].append(swap.get("sequence_changed", False) and s["stage"] == 0)
    return dict(sorted(out.items()))


def summary(series: dict[str, list], stage: int) -> str:
    planned = [k for k, p in enumerate(series["planned"]) if p]
    top_with = max((series["with_swap"][k] for k in planned), default=0)
    top_without = max((series["without_swap"][k] for k in planned), default=0)
    saved = 100.0 * (1 - top_with / top_without) if top_without else 0.0
    return "\n".join([
        f"stage {stage}: iterations: {len(series['iteration'])} "
        f"(re-profiled: {sum(series['full'])}, sequence changes: {sum(series['changed'])})",
        f"  peak resident saved activations over the {len(planned)} iterations with a plan: "
        f"{top_with / MIB:.2f} MiB with swap, {top_without / MIB:.2f} MiB without "
        f"({saved:.1f} % less)",
        f"  swapped out: {sum(series['swapped_out']) / MIB:.2f} MiB in total; "
        f"blocking swap-ins: {sum(series['blocking'])}",
    ])


def plot(series: dict[int, dict[str, list]], out: Path, title: str) -> Any:
    """One panel per stage; returns the figure (written to ``out``)."""
    from matplotlib.figure import Figure  # no pyplot: no global backend state

    fig = Figure(figsize=(8, 1.2 + 3.0 * len(series)))
    axes = fig.subplots(len(series), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (stage, col) in zip(axes, series.items()):
        it = col["iteration"]
        ax.plot(it, [b / MIB for b in col["without_swap"]], "o-", label="without swap")
        ax.plot(it, [b / MIB for b in col["with_swap"]], "o-", label="with swap")
        budget = [(i, b / MIB) for i, b in zip(it, col["budget"]) if b is not None]
        if budget:
            ax.step(*zip(*budget), where="mid", linestyle="--", color="grey", label="budget")
        for i, full, changed in zip(it, col["full"], col["changed"]):
            if changed:
                ax.axvline(i, color="red", alpha=0.4)
            elif full:
                ax.axvline(i, color="grey", alpha=0.2)
        ax.set_ylabel(f"stage {stage}: MiB")
        ax.set_ylim(bottom=0)
        ax.legend(loc="upper right", fontsize=8)
    axes[0].set_title(f"{title}: peak resident saved activations")
    axes[-1].set_xlabel("iteration (red: sequence changed, grey: re-profiled)")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    return fig


def run(args: argparse.Namespace) -> int:
    path = Path(args.metrics)
    records = read_metrics(path, run=args.run)
    series = swap_series([r for r in records if r.get("event") == "iteration"])
    ft = report_recovery.is_ft(records)
    if not series and not ft:
        print(f"chameleon report: {path} has no swap metrics "
              "(train with --chameleon-swap and --chameleon-metrics-file) and no recovery "
              "records (--chameleon-ft)")
        return 1
    if series:
        out = Path(args.out) if args.out else path.with_name(path.stem + "-swap.png")
        plot(series, out, f"swap: {path.name}")
        for stage, col in series.items():
            print(summary(col, stage))
        print(f"wrote {out}")
    if ft:
        out = Path(args.recovery_out) if args.recovery_out else \
            path.with_name(path.stem + "-recovery.png")
        report_recovery.report(records, out, f"recoveries: {path.name}")
        print(f"wrote {out}")
    if args.baseline:
        print(loss_against(records, read_metrics(args.baseline)))
    return 0


def loss_against(records: list[dict[str, Any]], reference: list[dict[str, Any]]) -> str:
    """The last loss against the reference run's, and their largest gap over the iterations
    both ran."""
    ours = {r["iteration"]: r["loss"] for r in records
            if r.get("event") == "iteration" and r.get("loss") is not None}
    theirs = {r["iteration"]: r["loss"] for r in reference
              if r.get("event") == "iteration" and r.get("loss") is not None}
    both = sorted(set(ours) & set(theirs))
    if not both:
        return "loss: no iteration in common with the reference run"
    last = both[-1]
    gap = max(abs(ours[i] - theirs[i]) for i in both)
    return (f"loss at iteration {last}: {ours[last]:.6f} (reference {theirs[last]:.6f}); "
            f"largest difference over {len(both)} iterations: {gap:.2e}")
