"""A rank's memory high-water marks, per window: the steady state up to a recovery, then
the recovery itself (for the recovery record's ``memory_peak_bytes``).

Host: the resident set's high-water mark (``VmHWM`` in /proc/self/status), reset at each
window's end by writing 5 to /proc/self/clear_refs (Linux; elsewhere None). Device: torch's
peak of allocated CUDA memory, reset likewise (None while CUDA is not initialised).
"""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

import torch

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
_RESET_PEAK_RSS = "5"
"""clear_refs: reset the peak resident set size to the current one (proc(5))."""


def host_peak_bytes() -> int | None:
    """The process's resident high-water mark since start or the last reset."""
    try:
        found = re.search(r"^VmHWM:\s+(\d+) kB", _STATUS.read_text(), re.MULTILINE)
    except OSError:
        return None
    return int(found.group(1)) * 1024 if found else None


def device_peak_bytes() -> int | None:
    if not torch.cuda.is_initialized():
        return None
    return int(torch.cuda.max_memory_allocated())


def take() -> dict[str, int | None]:
    """The window's peaks (``host``, ``device``, bytes), then start the next window."""
    peaks = {"host": host_peak_bytes(), "device": device_peak_bytes()}
    with contextlib.suppress(OSError):
        _CLEAR_REFS.write_text(_RESET_PEAK_RSS)
    if peaks["device"] is not None:
        torch.cuda.reset_peak_memory_stats()
    return peaks
