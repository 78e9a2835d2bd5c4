"""The per-iteration metrics file (JSON lines) and the Megatron-style log line."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, TextIO

logger = logging.getLogger(__name__)


class MetricsWriter:
    """Appends one JSON object per line; a no-op when no path is given (or not rank 0)."""

    def __init__(self, path: str | None, *, enabled: bool = True) -> None:
        self._file: TextIO | None = None
        if path and enabled:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", buffering=1)

    def write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record, default=_plain) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _plain(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


def read_metrics(path: str | Path, event: str | None = None) -> list[dict[str, Any]]:
    """Records of a metrics file, optionally only those of one event type."""
    records = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [r for r in records if event is None or r.get("event") == event]


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
