"""Logging of the entries: structured records as JSON, one rank's library noise, once.

Decisions and recoveries are logged as dicts with an ``"event"`` key; the formatter writes
them as one JSON object (numpy and torch scalars as numbers), so a log is greppable and
parseable. Libraries warn about what a CPU run cannot act on (no Apex, no TransformerEngine,
a mock dataset without an index cache) on every rank and in several modules: rank 0 shows
each such warning once, the other ranks not at all.
"""

from __future__ import annotations

import json
import logging
import re
import warnings
from typing import Any

HARMLESS = (
    r"Transformer Engine and Apex are not installed",
    r"Apex is not installed",
    r"full scope is deprecated",
    r"Unable to save \w+ indexes because path_to_cache is None",
    r"CUDA_DEVICE_MAX_CONNECTIONS",
)
"""Library messages that say nothing a run can act on (patterns of their text)."""

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def plain(value: Any) -> Any:
    """A JSON-able form of what records carry beyond JSON's types (numpy/torch scalars and
    arrays, dataclasses, tuples of those)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if hasattr(value, "__dataclass_fields__"):
        import dataclasses

        return dataclasses.asdict(value)
    return str(value)


class RecordFormatter(logging.Formatter):
    """Dict messages as one JSON object; text as it is."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 - logging's name
        if isinstance(record.msg, dict) and not record.args:
            record.message = json.dumps(record.msg, default=plain, sort_keys=False)
        return super().formatMessage(record)


class _OnceFilter(logging.Filter):
    """Passes a harmless library message the first time only (none on ``silent`` ranks)."""

    def __init__(self, silent: bool) -> None:
        super().__init__()
        self.silent = silent
        self.seen: set[str] = set()
        self.pattern = re.compile("|".join(HARMLESS))

    def filter(self, record: logging.LogRecord) -> bool:
        found = self.pattern.search(record.getMessage())
        if found is None:
            return True
        if self.silent or found.group(0) in self.seen:
            return False
        self.seen.add(found.group(0))
        return True


def setup_logging(rank: int = 0, *, level: int = logging.INFO) -> None:
    """Logging of a process of the job (``rank``): ours at ``level``, megatron-core's at
    WARNING, harmless library warnings shown once by rank 0. Call before megatron-core is
    imported: it warns as it loads."""
    handler = logging.StreamHandler()
    handler.setFormatter(RecordFormatter(FORMAT))
    handler.addFilter(_OnceFilter(silent=rank != 0))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    logging.getLogger("megatron").setLevel(logging.WARNING)
    logging.captureWarnings(True)  # warnings.warn goes through the handler and its filter
    for pattern in HARMLESS:  # shown by the filter at most once, not once per module
        warnings.filterwarnings("always" if rank == 0 else "ignore", message=f".*{pattern}")


def log_ours(level: int = logging.INFO) -> None:
    """Our records at ``level`` on stderr, in a process whose logging someone else set up
    (the launcher's agent, Megatron-LM's training script): nothing else changes. Once."""
    ours = logging.getLogger("chameleon_megatron")
    ours.setLevel(level)
    if not any(isinstance(h.formatter, RecordFormatter) for h in ours.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(RecordFormatter(FORMAT))
        ours.addHandler(handler)
    ours.propagate = False
