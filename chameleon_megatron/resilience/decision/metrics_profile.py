"""A profile from the trainer's JSON-lines metrics file.

The file starts with ``{"event": "run", "args": {...Megatron args...}, "world_size": N}``
and has one ``{"event": "iteration", "step_time_s": ..., "layout": {"tp", "pp", "vpp",
"dp"}, ...}`` per step. Bytes come from the model shape in ``args``; per-layer times are
the model's FLOP shares scaled so that the step model reproduces the median measured
step time of each layout (the first ``skip`` steps of each layout are warm-up).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chameleon_megatron.metrics_file import read_metrics
from chameleon_megatron.resilience.decision.calibration import Calibration, Observation, calibrate
from chameleon_megatron.resilience.decision.layout import UniformLayout
from chameleon_megatron.resilience.decision.model_shape import SHAPE_KEYS, ModelShape
from chameleon_megatron.resilience.decision.profile import Profile
from chameleon_megatron.resilience.decision.shape_profile import Hardware, profile_from_shape


@dataclass(frozen=True)
class MetricsRun:
    args: dict[str, Any]
    step_times: dict[tuple[int, int, int, int], list[float]]
    """(tp, pp, vpp, dp) -> step times in file order."""


def read_run(path: str | Path, run: int | None = None) -> MetricsRun:
    """The trainer's args and the step times per layout of one run (None: the last)."""
    args: dict[str, Any] | None = None
    times: dict[tuple[int, int, int, int], list[float]] = {}
    for rec in read_metrics(path, run=run):
        if rec.get("event") == "run" and args is None:
            args = dict(rec.get("args") or {})
        elif rec.get("event") == "iteration" and "step_time_s" in rec:
            lay = rec.get("layout") or {}
            try:
                key = (int(lay["tp"]), int(lay["pp"]), int(lay.get("vpp") or 1), int(lay["dp"]))
            except (KeyError, TypeError, ValueError):
                continue  # not a uniform layout: no observation for it
            times.setdefault(key, []).append(float(rec["step_time_s"]))
    if args is None:
        raise ValueError(f"{path}: no {{'event': 'run'}} record with the trainer's args")
    if not times:
        raise ValueError(f"{path}: no iteration record with step_time_s and a layout")
    return MetricsRun(args=args, step_times=times)


def profile_from_metrics(path: str | Path, hardware: Hardware, *, name: str, skip: int = 2,
                         run: int | None = None) -> tuple[Profile, Calibration, dict[str, Any]]:
    """(calibrated profile, calibration report, model args kept for provenance)."""
    if skip < 0:
        raise ValueError(f"skip={skip}: must be >= 0")
    measured = read_run(path, run)
    shape = ModelShape.from_args(measured.args)
    base = profile_from_shape(
        shape, hardware, seconds_per_flop=1e-12, name=name,
        source=f"chameleon profile {Path(path).name}: bytes from the model shape; per-layer "
               "times are FLOP shares scaled to the measured median step times by inverting "
               "the step model (Eq. 9/11 with communication terms)",
    )
    obs = []
    for (tp, pp, vpp, dp), steps in sorted(measured.step_times.items()):
        kept = steps[skip:]
        if tp != shape.tp or not kept:
            continue  # times are per rank at the run's TP degree
        plan = UniformLayout(tp=tp, pp=pp, dp=dp, vpp=vpp).to_plan(
            shape.num_layers, base.global_microbatches)
        obs.append(Observation(plan, statistics.median(kept),
                               f"tp{tp} pp{pp} vpp{vpp} dp{dp} ({len(kept)} steps)"))
    if not obs:
        raise ValueError(f"{path}: no layout with tp={shape.tp} has steps left after skip={skip}")
    cal = calibrate(base, obs)
    model = {k: measured.args[k] for k in SHAPE_KEYS if k in measured.args}
    return cal.profile, cal, model
