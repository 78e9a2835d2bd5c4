"""The executor's copy engines: the only code that touches streams and events.

Both engines move flat byte views of storages. A *token* stands for a copy in flight;
``None`` means the copy has finished. ``SyncCopier`` (CPU, or any device) copies
synchronously, so every path of the executor runs in CPU tests. ``CudaCopier`` uses one
device-to-host and one host-to-device stream; the compute stream waits on a copy's event
only when the tensor is needed, and never blocks the host on the hot path.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch

from chameleon_megatron.swap.profile import DeviceMemory


class SyncCopier:
    """Synchronous copies on the current device (CPU tests, and the semantics reference)."""

    def alloc(self, nbytes: int, device: torch.device) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def start_out(self, src: torch.Tensor, host: torch.Tensor) -> Any:
        host.copy_(src)
        return None

    def start_in(self, host: torch.Tensor, device: torch.device,
                 after: Any) -> tuple[torch.Tensor, Any]:
        dst = self.alloc(host.numel(), device)
        dst.copy_(host)
        return dst, None

    def done(self, token: Any) -> bool:
        return True

    def wait_in(self, token: Any) -> None:
        """Make compute wait for a copy back (nothing to wait for here): before the copy's
        destination is used, or dropped unused."""

    def sync(self, token: Any) -> None:
        """Block the host until a copy has finished (OOM eviction, end of step)."""

    def memory_in_use(self) -> int | None:
        """Device memory the allocator holds for tensors (None: not measurable here)."""
        return None

    def reset_peaks(self) -> None:
        """Start measuring a step's peaks (``memory_summary``)."""

    def memory_summary(self) -> DeviceMemory | None:
        """Peaks since ``reset_peaks`` and the memory used beside torch (None: no device)."""
        return None

    def sync_device(self) -> None:
        """Wait for all queued device work (profiling steps time their segments)."""


class CudaCopier(SyncCopier):
    """Asynchronous copies on dedicated streams, ordered by events."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.d2h = torch.cuda.Stream(device)
        self.h2d = torch.cuda.Stream(device)

    def start_out(self, src: torch.Tensor, host: torch.Tensor) -> Any:
        self.d2h.wait_stream(torch.cuda.current_stream(self.device))  # src is produced
        with torch.cuda.stream(self.d2h):
            host.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        return event  # the executor keeps src alive until the event: the deferred free

    def start_in(self, host: torch.Tensor, device: torch.device,
                 after: Any) -> tuple[torch.Tensor, Any]:
        dst = self.alloc(host.numel(), device)
        # dst's block may still be read by queued compute work that freed it.
        self.h2d.wait_stream(torch.cuda.current_stream(self.device))
        if after is not None:
            self.h2d.wait_event(after)  # the host copy is complete
        with torch.cuda.stream(self.h2d):
            dst.copy_(host, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        # No record_stream: it would hold the block until the copy stream passes later
        # prefetches, raising the peak. dst belongs to the compute stream, which waits for
        # the event before any use, and before dst is dropped unused (executor.release).
        return dst, event

    def done(self, token: Any) -> bool:
        return token is None or token.query()

    def wait_in(self, token: Any) -> None:
        if token is not None:
            torch.cuda.current_stream(self.device).wait_event(token)

    def sync(self, token: Any) -> None:
        if token is not None:
            token.synchronize()

    def memory_in_use(self) -> int | None:
        return torch.cuda.memory_allocated(self.device)

    def reset_peaks(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def memory_summary(self) -> DeviceMemory | None:
        free, total = torch.cuda.mem_get_info(self.device)
        reserved = torch.cuda.memory_reserved(self.device)
        return DeviceMemory(peak_allocated=torch.cuda.max_memory_allocated(self.device),
                            peak_reserved=torch.cuda.max_memory_reserved(self.device),
                            outside_torch=max(total - free - reserved, 0))

    def sync_device(self) -> None:
        torch.cuda.synchronize(self.device)


def register_host(buf: torch.Tensor) -> None:
    """Page-lock a host tensor's memory for asynchronous copies, on exactly its size."""
    if buf.numel():
        err = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.numel(), 0)
        if int(err) != 0:
            _clear_last_error()
            raise RuntimeError(f"cudaHostRegister of {buf.numel()} bytes failed "
                               f"(error {int(err)})")


def unregister_host(ptr: int) -> None:
    """Undo ``register_host`` of the buffer at ``ptr`` (before its memory is freed)."""
    if int(torch.cuda.cudart().cudaHostUnregister(ptr)) != 0:
        _clear_last_error()


def _clear_last_error() -> None:
    """A failed runtime call leaves its error pending, and torch raises it at its next
    kernel launch, wherever that is (seen on a lent H200: "invalid argument" from a later
    ``model.to``). torch's bindings have no cudaGetLastError: a launch reads and clears it."""
    with contextlib.suppress(RuntimeError):
        torch.zeros(1, device=torch.device("cuda", torch.cuda.current_device()))


def copier_for(device: torch.device) -> SyncCopier:
    return CudaCopier(device) if device.type == "cuda" else SyncCopier()


def measure_bandwidth(device: torch.device, nbytes: int = 256 << 20, repeats: int = 3) -> float:
    """Pinned host<->device copy bandwidth in bytes/s: the slower direction's best run."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    rates = []
    for dst, src in ((dev, host), (host, dev)):
        best = 0.0
        for _ in range(repeats):
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize(device)
            best = max(best, nbytes / (time.perf_counter() - start))
        rates.append(best)
    return min(rates)
