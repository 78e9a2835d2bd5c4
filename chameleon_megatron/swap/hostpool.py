"""Host buffers for swapped storages, reused across steps (page-locked when copying from a GPU).

Buffers are kept by exact size; freed ones stay cached up to ``cache_bytes`` in total, so
``held_bytes`` (handed out plus cached) is what the pool really holds. Page-locked buffers
are ordinary host tensors registered with CUDA on exactly their size and unregistered when
the pool drops them: torch's pinned-memory allocator would round each up to a power of two
and keep it for the rest of the process, beyond any bound of the pool. ``reserve`` makes the
buffers a new plan needs before its first step, so that registering (slow) happens between
steps rather than inside the forward pass. Where CUDA refuses to register memory (seen on a
lent H200 under gVisor), the buffer stays pageable: its copies no longer overlap, but the
step is the same; the pool says so once.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterable

import torch

from chameleon_megatron.swap.copier import register_host, unregister_host

logger = logging.getLogger(__name__)


class HostPool:
    """Byte buffers by exact size; freed buffers are kept up to ``cache_bytes`` in total."""

    def __init__(self, *, pin: bool, cache_bytes: int) -> None:
        self.pin = pin
        self.cache_bytes = cache_bytes
        self._free: dict[int, list[torch.Tensor]] = {}
        self.cached_bytes = 0
        self.live = 0
        """Buffers handed out and not yet returned."""
        self.live_bytes = 0
        self.allocated = 0
        """Buffers ever allocated (a steady workload stops allocating after its first step)."""
        self._pinned: set[int] = set()
        """Data pointers of the buffers registered with CUDA."""
        self.unpinned = 0
        """Buffers CUDA refused to register (pageable: their copies do not overlap)."""

    @property
    def held_bytes(self) -> int:
        """Host memory the pool holds: buffers handed out plus cached ones."""
        return self.live_bytes + self.cached_bytes

    def acquire(self, nbytes: int) -> torch.Tensor:
        free = self._free.get(nbytes)
        if free:
            buf = free.pop()
            self.cached_bytes -= nbytes
        else:
            buf = self._new(nbytes)
        self.live += 1
        self.live_bytes += nbytes
        return buf

    def release(self, buf: torch.Tensor) -> None:
        nbytes = buf.numel()
        self.live -= 1
        self.live_bytes -= nbytes
        self._keep_or_drop(buf)

    def reserve(self, sizes: Iterable[int]) -> int:
        """Have a cached buffer ready for each of ``sizes`` (one per planned swap), as far
        as the cache bound allows; returns the bytes newly allocated."""
        want: dict[int, int] = {}
        for n in sizes:
            want[n] = want.get(n, 0) + 1
        added = 0
        for nbytes, count in sorted(want.items()):
            for _ in range(count - len(self._free.get(nbytes, ()))):
                if self.cached_bytes + nbytes > self.cache_bytes:
                    return added
                self._free.setdefault(nbytes, []).append(self._new(nbytes))
                self.cached_bytes += nbytes
                added += nbytes
        return added

    def clear(self) -> None:
        """Drop every cached buffer (buffers handed out stay theirs)."""
        for bufs in self._free.values():
            for buf in bufs:
                self._drop(buf)
        self._free.clear()
        self.cached_bytes = 0

    def _keep_or_drop(self, buf: torch.Tensor) -> None:
        nbytes = buf.numel()
        if self.cached_bytes + nbytes <= self.cache_bytes:
            self._free.setdefault(nbytes, []).append(buf)
            self.cached_bytes += nbytes
        else:
            self._drop(buf)

    def _new(self, nbytes: int) -> torch.Tensor:
        buf = torch.empty(nbytes, dtype=torch.uint8)
        if self.pin and nbytes:
            try:
                register_host(buf)
                self._pinned.add(buf.data_ptr())
            except RuntimeError as exc:
                if not self.unpinned:
                    logger.warning("host buffers stay pageable (copies do not overlap): %s", exc)
                self.unpinned += 1
        self.allocated += 1
        return buf

    def _drop(self, buf: torch.Tensor) -> None:
        if buf.data_ptr() in self._pinned:
            self._pinned.discard(buf.data_ptr())
            unregister_host(buf.data_ptr())

    def close(self) -> None:
        """Drop the cache and unregister every buffer still registered, those handed out
        too (they stay valid, pageable): memory freed while registered makes CUDA refuse
        a later buffer that shares one of its pages."""
        self.clear()
        for ptr in self._pinned:
            unregister_host(ptr)
        self._pinned.clear()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter exit CUDA may be gone
            self.close()
