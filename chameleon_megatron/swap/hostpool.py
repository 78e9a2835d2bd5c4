"""Host buffers for swapped storages, reused across steps (pinned when copying from a GPU)."""

from __future__ import annotations

import torch


class HostPool:
    """Byte buffers by exact size; freed buffers are kept up to ``cache_bytes`` in total."""

    def __init__(self, *, pin: bool, cache_bytes: int) -> None:
        self.pin = pin
        self.cache_bytes = cache_bytes
        self._free: dict[int, list[torch.Tensor]] = {}
        self.cached_bytes = 0
        self.live = 0
        """Buffers handed out and not yet returned."""
        self.allocated = 0
        """Buffers ever allocated (a steady workload stops allocating after its first step)."""

    def acquire(self, nbytes: int) -> torch.Tensor:
        free = self._free.get(nbytes)
        if free:
            buf = free.pop()
            self.cached_bytes -= nbytes
        else:
            buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)
            self.allocated += 1
        self.live += 1
        return buf

    def release(self, buf: torch.Tensor) -> None:
        self.live -= 1
        nbytes = buf.numel()
        if self.cached_bytes + nbytes <= self.cache_bytes:
            self._free.setdefault(nbytes, []).append(buf)
            self.cached_bytes += nbytes

    def clear(self) -> None:
        """Drop every cached buffer."""
        self._free.clear()
        self.cached_bytes = 0
