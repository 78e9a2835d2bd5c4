"""The per-iteration metrics file: JSON lines written by one rank, read by the tools.

Every record carries the ``run_id`` of the run that wrote it. A file holds one run unless a
run was started with ``--chameleon-metrics-append``; readers take the last run by default
(``run=``: another), so runs are never drawn or fitted as one.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, TextIO

from chameleon_megatron.errors import UserError
from chameleon_megatron.logs import plain


class MetricsWriter:
    """Appends one JSON object per line; a no-op when no path is given (or not rank 0).
    ``run_id``: the run the records belong to (None: a new run after those in the file)."""

    def __init__(self, path: str | None, *, enabled: bool = True,
                 run_id: int | None = None) -> None:
        self._file: TextIO | None = None
        self.run_id = run_id
        if path and enabled:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            if self.run_id is None:
                self.run_id = len(run_ids(path)) + 1
            self._file = open(path, "a", buffering=1)

    def write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps({**record, "run_id": self.run_id}, default=plain)
                             + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def run_record(world_size: int, args: argparse.Namespace, megatron_core: str) -> dict[str, Any]:
    """The record a run starts with: its world size, its Megatron arguments (those JSON can
    hold; ``chameleon profile`` reads the model shape from them) and the versions it ran."""
    import torch

    return {"event": "run", "world_size": world_size, "args": jsonable_args(args),
            "versions": {"torch": torch.__version__, "megatron_core": megatron_core}}


def jsonable_args(args: argparse.Namespace) -> dict[str, Any]:
    """Megatron arguments that are plain values (Chameleon's own flags left out)."""
    out = {}
    for k, v in vars(args).items():
        if k.startswith("chameleon"):
            continue
        if isinstance(v, (int, float, str, bool, type(None))) or (
                isinstance(v, (list, tuple)) and all(isinstance(x, (int, float, str)) for x in v)):
            out[k] = v
    return out


def _records(path: str | Path) -> list[dict[str, Any]]:
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}:{n}: not a JSON record ({exc.msg}); a line cut short "
                            "by a crash can be deleted") from None
    return out


def run_ids(path: str | Path) -> list[int]:
    """The runs a metrics file holds, in order (none: no file or no run yet)."""
    if not Path(path).is_file():
        return []
    return sorted({r.get("run_id", 1) for r in _records(path) if r.get("event") == "run"})


def current_run(path: str | Path) -> int | None:
    """The run a metrics file is being written by (its last), None when it holds none."""
    ids = run_ids(path)
    return ids[-1] if ids else None


def continue_run(old: MetricsWriter, path: str | None, rank: int) -> MetricsWriter:
    """After a regroup: ``old`` closed, and the writer of the same run for this rank (the
    first rank may have died: whoever is rank 0 now appends to the file)."""
    old.close()
    return MetricsWriter(path, enabled=rank == 0, run_id=current_run(path) if path else None)


def read_metrics(path: str | Path, event: str | None = None,
                 run: int | None = None) -> list[dict[str, Any]]:
    """Records of one run of a metrics file (``run``; None: the last), optionally only
    those of one event type. UserError naming the line of a record that is not JSON."""
    records = _records(path)
    if run is None:
        run = max((r.get("run_id", 1) for r in records), default=1)
    mine = [r for r in records if r.get("run_id", 1) == run]
    if records and not mine:
        raise UserError(f"{path}: no run {run} (runs: {run_ids(path)})")
    return [r for r in mine if event is None or r.get("event") == event]
