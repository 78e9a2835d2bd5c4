"""``chameleon report`` on a fault-tolerance metrics file: the recovery timeline.

The records are written as the job writes them: ``MetricsWriter``, iteration records with
the trainer's keys, recovery records from ``recovery_record`` (the sample of
tests/resilience/recovery/test_recovery_e2e.py's four-rank job: two recoveries, re-plans
from 2x(d2,m2) to 2x(d1,m2) to 1x(d1,m4)).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from chameleon_megatron.cli import main
from chameleon_megatron.commands import report_recovery
from chameleon_megatron.metrics_file import MetricsWriter, read_metrics
from chameleon_megatron.resilience.recovery.record import PHASES, recovery_record
from chameleon_megatron.resilience.store.announce import FailureRecord

pytestmark = pytest.mark.timeout(60)

LAYOUTS = ("2x(d2,m2), tp1", "2x(d1,m2), tp1", "1x(d1,m4), tp1")
STEP_S = {1: 0.27, 2: 0.07, 3: 0.06, 4: 0.05, 5: 0.05, 6: 0.06, 7: 0.25, 8: 0.05}
PHASES_S = ({"detect": 0.0, "decide": 1.12, "regroup": 0.19, "migrate": 0.03},
            {"detect": 3.04, "decide": 3.15, "regroup": 0.05, "migrate": 0.01})


def iteration(i: int, world: int, swap: dict | None = None) -> dict[str, Any]:
    rec = {"event": "iteration", "iteration": i, "loss": 4.0, "step_time_s": STEP_S[i],
           "consumed_samples": 8 * i, "global_batch_size": 8, "world_size": world,
           "layout": {"tp": 1, "pp": 2 if world == 4 else 1, "vpp": 1, "dp": min(world, 2)},
           "tokens_per_s": 8 * 32 / STEP_S[i], "ft": {"generation": 0, "estimated_step_s": None}}
    return rec if swap is None else {**rec, "swap": swap}


def decision(before: str, after: str) -> dict[str, Any]:
    return {"event": "decision", "D_s": 7200.0, "B": 8, "strategy": "adaptive",
            "candidates": [
                {"name": "reroute", "feasible": True, "reason": "ok", "t_step_s": 16.4,
                 "t_transition_s": 0.0, "plan": before, "score": 0.49},
                {"name": "replan", "feasible": True, "reason": "ok", "t_step_s": 0.00017,
                 "t_transition_s": 0.0013, "plan": after, "score": 47094.8}],
            "choice": "replan", "executed": "replan", "mode": "megatron",
            "executed_reason": "chosen by score", "fallback": None, "stale": [],
            "layout_before": before, "layout_after": after, "transfers": 12, "lost": []}


def recovery(k: int, failed: list[int], ranks: list[int], redo: int) -> dict[str, Any]:
    phases = {**PHASES_S[k], "total": sum(PHASES_S[k].values())}
    dp = len(ranks)
    return recovery_record(
        generation=k + 2, failures=[FailureRecord(rank=r, time=1.7e9 + k, reason="exit",
                                                  exitcode=43) for r in failed],
        decision=decision(LAYOUTS[k], LAYOUTS[k + 1]), phases=phases,
        layout_after={"mode": "megatron", "ranks": ranks, "plan": LAYOUTS[k + 1], "tp": 1,
                      "pp": 1, "dp": dp},
        spares=[], redo_iteration=redo, migrated_bytes=2523856 if k == 0 else 0)


def write_job(path: Path, swap: dict | None = None) -> list[dict[str, Any]]:
    """The four-rank job: failures before iterations 3 and 6."""
    writer = MetricsWriter(str(path))
    writer.write({"event": "run", "world_size": 4, "args": {}})
    for rec in [iteration(1, 4, swap), iteration(2, 4, swap), recovery(0, [0, 2], [1, 3], 3),
                iteration(3, 2, swap), iteration(4, 2, swap), iteration(5, 2, swap),
                recovery(1, [3], [1], 6), iteration(6, 1, swap), iteration(7, 1, swap),
                iteration(8, 1, swap)]:
        writer.write(rec)
    writer.close()
    return read_metrics(path)


def spans(fig) -> list:
    return [p for p in fig.axes[0].patches if (p.get_gid() or "").startswith("phase:")]


def test_report_writes_the_timeline_and_summarises_each_recovery(tmp_path, capsys):
    path = tmp_path / "ft.jsonl"
    write_job(path)
    assert main(["report", str(path)]) == 0
    out = capsys.readouterr().out
    assert "recoveries: 2 (7.59 s in total)" in out
    assert "recovery 1: failure of ranks [0, 2], resumed at iteration 3 (generation 2)" in out
    assert "phases: detect 0.00 s, decide 1.12 s, regroup 0.19 s, migrate 0.03 s; " \
        "total 1.34 s" in out
    assert "decision: replan (chosen by score, D 7200 s): reroute step 16.4 s" in out
    assert f"layout: {LAYOUTS[1]} -> {LAYOUTS[2]}; 0.0 MiB moved" in out
    png = tmp_path / "ft-recovery.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "ft-swap.png").exists()  # no swap metrics: no swap figure


def test_phases_are_shaded_where_they_happened_and_layouts_labelled(tmp_path):
    records = write_job(tmp_path / "ft.jsonl")
    fig = report_recovery.report(records, tmp_path / "t.png", "t")
    assert len(fig.axes) == 1
    shaded = spans(fig)
    assert len(shaded) == 2 * len(PHASES)  # recoveries x phases
    assert [p.get_gid() for p in shaded] == [f"phase:{n}" for n in PHASES] * 2
    # the first recovery starts after iterations 1-2 and lasts as its phases did
    start = shaded[0].get_x()
    assert start == pytest.approx(STEP_S[1] + STEP_S[2])
    assert [p.get_width() for p in shaded[:4]] == pytest.approx(list(PHASES_S[0].values()))
    labels = [t.get_text().strip() for t in fig.axes[0].texts if t.get_gid() == "layout"]
    assert [lab.rstrip(" \u2192") for lab in labels] == list(LAYOUTS)
    line = next(line for line in fig.axes[0].get_lines() if line.get_gid() == "throughput")
    ys = [y for y in line.get_ydata() if y == y]
    assert ys == pytest.approx([8 * 32 / STEP_S[i] for i in STEP_S for _ in (0, 1)])
    assert fig.axes[0].get_ylabel() == "tokens/s"


def test_png_has_the_figure_size_and_is_not_blank(tmp_path):
    from matplotlib.image import imread

    records = write_job(tmp_path / "ft.jsonl")
    fig = report_recovery.report(records, tmp_path / "t.png", "t")
    pixels = imread(tmp_path / "t.png")
    width, height = (fig.get_size_inches() * 110).round().astype(int)
    assert pixels.shape[:2] == (height, width)
    box = fig.axes[0].get_window_extent()
    area = pixels[height - int(box.y1):height - int(box.y0), int(box.x0):int(box.x1), :3]
    assert area.std() > 0.05


def test_without_step_times_each_recovery_takes_one_iteration(tmp_path):
    records = [{k: v for k, v in r.items() if k not in ("step_time_s", "tokens_per_s")}
               for r in write_job(tmp_path / "ft.jsonl")]
    t = report_recovery.timeline(records)
    assert not t.timed and t.unit == "samples/s"
    first = t.spans[:4]
    assert first[0][0] == 2.0 and first[-1][1] == pytest.approx(3.0)
    assert [s[1] - s[0] for s in first] == pytest.approx(
        [v / sum(PHASES_S[0].values()) for v in PHASES_S[0].values()])


def test_a_file_with_swap_and_recoveries_gets_both_figures(tmp_path, capsys):
    swap = {"mode": "light", "plan_version": 1, "peak_resident_saved_bytes": 4 << 20,
            "peak_saved_bytes": 8 << 20, "budget_bytes": 4 << 20, "swapped_out_bytes": 4 << 20,
            "blocking_swapins": 0}
    path = tmp_path / "both.jsonl"
    write_job(path, swap)
    assert main(["report", str(path), "--recovery-out", str(tmp_path / "r.png")]) == 0
    out = capsys.readouterr().out
    assert "stage 0: iterations: 8" in out and "recoveries: 2" in out
    assert (tmp_path / "both-swap.png").stat().st_size > 5000
    assert (tmp_path / "r.png").stat().st_size > 5000


def test_a_recovery_without_phases_is_a_dashed_line(tmp_path, capsys):
    path = tmp_path / "relaunch.jsonl"
    lines = [{"event": "run", "world_size": 2}, iteration(1, 4), iteration(2, 4),
             {"event": "recovery", "cause": "store_lost", "fallback": "checkpoint",
              "relaunch": 1, "resumed_iteration": 2, "world_size": 2}, iteration(3, 2)]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert main(["report", str(path)]) == 0
    assert "no phases recorded: {'fallback': 'checkpoint', 'resumed_iteration': 2, " \
        "'world_size': 2}" in capsys.readouterr().out
    fig = report_recovery.plot(report_recovery.timeline(read_metrics(path)),
                               tmp_path / "x.png", "x")
    assert not spans(fig)
    assert [a.get_gid() for a in fig.axes[0].get_lines()].count("recovery:no-phases") == 1
