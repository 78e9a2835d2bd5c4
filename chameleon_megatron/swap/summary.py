"""End-of-run swap summary: one row per rank, as a fixed-width text table."""

from __future__ import annotations

from typing import Sequence

from chameleon_megatron.swap.manager import RunTotals

_COLUMNS = ("rank", "steps", "full", "plans", "changes", "out MiB", "in MiB",
            "peak MiB (plan)", "no-swap MiB", "matched %", "blocking", "forced", "ooms",
            "profiler ms/step", "switches")


def summary_row(rank: int, t: RunTotals) -> tuple[str, ...]:
    mib = 1 << 20
    matched = 100.0 * t.matched / t.planned if t.planned else 100.0
    per_step = 1e3 * t.profiler_s / t.steps if t.steps else 0.0
    return (str(rank), str(t.steps), str(t.full_steps), str(t.plans), str(t.changes),
            f"{t.swapped_out_bytes / mib:.1f}", f"{t.swapped_in_bytes / mib:.1f}",
            f"{t.peak_resident_saved_bytes / mib:.1f}", f"{t.peak_saved_bytes / mib:.1f}",
            f"{matched:.1f}", str(t.blocking_swapins), str(t.forced_swaps), str(t.ooms),
            f"{per_step:.3f}", str(t.switches))


def summary_table(rows: Sequence[tuple[int, RunTotals]]) -> str:
    cells = [_COLUMNS] + [summary_row(rank, t) for rank, t in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(_COLUMNS))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells)
