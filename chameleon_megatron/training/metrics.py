"""The Megatron-style log line of an iteration record (the file: ``metrics_file``)."""

from __future__ import annotations

from typing import Any


def log_line(rec: dict[str, Any], train_iters: int) -> str:
    """Megatron-LM's training log line for one iteration record."""
    parts = [
        f" iteration {rec['iteration']:8d}/{train_iters:8d}",
        f"consumed samples: {rec['consumed_samples']:12d}",
        f"elapsed time per iteration (ms): {rec['step_time_s'] * 1000:.1f}",
        f"learning rate: {rec['lr']:.6E}",
        f"global batch size: {rec['global_batch_size']:5d}",
        f"lm loss: {rec['loss']:.6E}" if rec["loss"] is not None else "lm loss: n/a",
    ]
    if rec.get("grad_norm") is not None:
        parts.append(f"grad norm: {rec['grad_norm']:.3f}")
    parts.append(f"tokens per second: {rec['tokens_per_s']:.0f}")
    if rec.get("skipped"):
        parts.append("skipped")
    return " | ".join(parts) + " |"
