"""``chameleon report``: summary numbers and a PNG from a metrics file."""

from __future__ import annotations

import json

import pytest

from chameleon_megatron.cli import main

pytestmark = pytest.mark.timeout(60)

MIB = 1 << 20


def _swap(mode, peak, no_swap, budget, out, blocking=0, changed=False):
    return {"mode": mode, "plan_version": 0 if budget is None else 1,
            "peak_resident_saved_bytes": peak, "peak_saved_bytes": no_swap,
            "budget_bytes": budget, "swapped_out_bytes": out, "blocking_swapins": blocking,
            "sequence_changed": changed}


def test_report_summarises_and_draws(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    lines = [
        {"event": "run", "world_size": 1},
        {"event": "iteration", "iteration": 1, "swap": _swap("full", 8 * MIB, 8 * MIB, None, 0)},
        {"event": "iteration", "iteration": 2,
         "swap": _swap("light", 4 * MIB, 8 * MIB, 4 * MIB, 5 * MIB)},
        {"event": "eval", "iteration": 2, "loss": 1.0},
        {"event": "iteration", "iteration": 3,
         "swap": _swap("light", 6 * MIB, 12 * MIB, 4 * MIB, 7 * MIB, blocking=2, changed=True)},
    ]
    path.write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    assert main(["report", str(path)]) == 0
    text = capsys.readouterr().out
    assert "stage 0: iterations: 3 (re-profiled: 1, sequence changes: 1)" in text
    # The profiling step (8 MiB, no plan yet) is not a step with swap.
    assert "over the 2 iterations with a plan: 6.00 MiB with swap, 12.00 MiB without " \
        "(50.0 % less)" in text
    assert "swapped out: 12.00 MiB in total; blocking swap-ins: 2" in text
    png = tmp_path / "metrics-swap.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def _stage(stage, peak, no_swap, budget):
    return {"stage": stage, "rank": stage, "mode": "light", "plan_version": 1,
            "budget_bytes": budget, "min_tensor_bytes": 1024,
            "peak_resident_saved_bytes": peak, "peak_saved_bytes": no_swap,
            "swapped_out_bytes": no_swap - peak, "blocking_swapins": 0, "expected_stall_s": 0}


def test_report_draws_one_panel_per_pipeline_stage(tmp_path, capsys):
    """Budgets are per stage: the first stage (more microbatches in flight) swaps more."""
    from matplotlib.image import imread

    from chameleon_megatron.commands import report

    records = [{"event": "iteration", "iteration": i,
                "swap": {**_swap("light", 5 * MIB, 10 * MIB, 5 * MIB, 5 * MIB),
                         "stages": [_stage(0, 5 * MIB, 10 * MIB, 5 * MIB),
                                    _stage(1, 3 * MIB, 4 * MIB, 3 * MIB)]}}
               for i in (1, 2, 3)]
    series = report.swap_series(records)
    assert sorted(series) == [0, 1]
    assert series[1]["with_swap"] == [3 * MIB] * 3 and series[1]["budget"] == [3 * MIB] * 3
    fig = report.plot(series, tmp_path / "r.png", "t")
    assert len(fig.axes) == 2
    assert [len(ax.get_lines()) for ax in fig.axes] == [3, 3]  # without, with, budget
    pixels = imread(tmp_path / "r.png")
    assert pixels.std() > 0.05  # not blank
    assert "stage 1:" in report.summary(series[1], 1)


def test_report_without_swap_metrics_says_so(tmp_path, capsys):
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps({"event": "iteration", "iteration": 1, "loss": 2.0}) + "\n")
    assert main(["report", str(path), "--out", str(tmp_path / "x.png")]) == 1
    assert "has no swap metrics" in capsys.readouterr().out
    assert not (tmp_path / "x.png").exists()
