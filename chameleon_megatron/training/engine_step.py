"""One training step through a step engine (``engine.StepEngine``) and its metrics record,
as both loops run it: chameleon's trainer at every step, Megatron-LM's loop while a plan
runs (``lm_loop``)."""

from __future__ import annotations

import time
from typing import Any

from chameleon_megatron.training.plugin import TrainerPlugin, plugins_step
from chameleon_megatron.training.step import Applied


def engine_step(engine: Any, dataset: Any, plugins: list[TrainerPlugin], *, iteration: int,
                consumed: int, gbs: int) -> tuple[Applied, float]:
    """Step ``iteration + 1`` (the ``gbs`` samples of ``dataset`` after ``consumed``) inside
    the plugins' step context: (what was applied, seconds)."""
    start = time.perf_counter()
    with plugins_step(plugins, iteration + 1, training=True):
        applied = engine.train_step(dataset, consumed, gbs)
    return applied, time.perf_counter() - start


def step_record(engine: Any, applied: Applied, plugins: list[TrainerPlugin], *,
                iteration: int, consumed: int, gbs: int, seconds: float, world_size: int,
                lr: float, seq_length: int) -> dict[str, Any]:
    """The metrics record of step ``iteration`` (``consumed``: the samples after it), the
    plugins' metrics merged in; sums the loss over every rank (collective)."""
    loss, _ = engine.global_loss(applied.reports)
    record: dict[str, Any] = {
        "event": "iteration", "iteration": iteration, "loss": loss, "step_time_s": seconds,
        "consumed_samples": consumed, "global_batch_size": gbs, "world_size": world_size,
        "layout": engine.layout(), "lr": lr, "grad_norm": applied.grad_norm,
        "skipped": applied.skipped, "tokens_per_s": gbs * seq_length / seconds,
    }
    for plugin in plugins:
        record.update(plugin.metrics())
    return record
