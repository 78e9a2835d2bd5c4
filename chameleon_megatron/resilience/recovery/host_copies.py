"""Every move of training state between device and host memory.

Shard copies and a recovery's transfers move optimizer state and weights to host memory
(gloo carries host memory) and back. They go through a ``HostMover``:

* ``HostBuffers``: host memory for a fixed list of tensors, one flat buffer per dtype and a
  view per tensor, pinned when CUDA is available (so device copies run asynchronously),
  reused by the next copy of the same list.
* ``HostMover.copy_out``: each tensor copied into its view (no concatenation on the device,
  no cast); on a GPU on a side stream, ordered after the work queued so far, so the training
  stream goes on. ``HostCopy.wait`` synchronises before the host copy is read;
  ``HostCopy.fence`` makes the training stream wait before it overwrites the sources.
* 0-dim tensors (step counts) are read as scalars: metadata (value and dtype), not data.
* ``HostMover.to_host`` / ``to_device``: a transfer's tensors, synchronously; ``pack``:
  several end to end in one host buffer (one message).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import torch

from chameleon_megatron.resilience.recovery.packing import laid_out

Spec = tuple[tuple[str, tuple[int, ...], str], ...]
"""(name, shape, dtype) of each tensor, in order."""
Scalar = tuple[Any, str]
"""(value, dtype) of a 0-dim tensor: a Python number, restored exactly by ``scalar``."""


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype named ``name`` ("torch.float32" or "float32")."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype {name!r}: not a torch dtype")
    return dtype


def scalar(value: Scalar) -> torch.Tensor:
    """A 0-dim host tensor of ``value``'s dtype (exact: Python numbers hold every float32,
    bfloat16 and integer value a step count takes)."""
    number, dtype = value
    return torch.tensor(number, dtype=dtype_of(dtype))


def spec_of(tensors: Iterable[tuple[str, torch.Tensor]]) -> Spec:
    return tuple((name, tuple(t.shape), str(t.dtype)) for name, t in tensors)


@dataclass(eq=False)
class HostBuffers:
    """Host memory for the tensors of ``spec``: one flat buffer per dtype (in order of first
    appearance), each tensor a view of its own."""

    spec: Spec
    pinned: bool = False
    flats: list[torch.Tensor] = field(init=False)
    views: dict[str, torch.Tensor] = field(init=False)

    def __post_init__(self) -> None:
        counts: dict[str, int] = {}
        place: list[tuple[str, str, int, tuple[int, ...]]] = []
        for name, shape, dtype in self.spec:
            n = _numel(shape)
            place.append((name, dtype, counts.get(dtype, 0), shape))
            counts[dtype] = counts.get(dtype, 0) + n
        self.flats = [torch.empty(n, dtype=dtype_of(d), pin_memory=self.pinned)
                      for d, n in counts.items()]
        by_dtype = dict(zip(counts, self.flats))
        self.views = {name: by_dtype[d][at:at + _numel(shape)].view(shape)
                      for name, d, at, shape in place}

    @property
    def nbytes(self) -> int:
        return sum(f.numel() * f.element_size() for f in self.flats)

    def fits(self, spec: Spec, pinned: bool) -> bool:
        return self.spec == spec and self.pinned == pinned


class HostCopy:
    """Tensors copied (or being copied) to host memory: the data in ``buffers`` (views by
    name), the 0-dim tensors as ``scalars`` (metadata, readable after ``wait``)."""

    def __init__(self, buffers: HostBuffers, *, scalars: Mapping[str, Scalar] | None = None,
                 landing: HostBuffers | None = None, done: Any = None) -> None:
        """``landing``: host memory the 0-dim tensors are being copied into; ``done``: the
        CUDA event recorded after the copies (None: they are complete)."""
        self.buffers = buffers
        self._landing = landing
        self._done = done
        self._scalars = dict(scalars) if scalars is not None else None

    @classmethod
    def received(cls, spec: Spec, scalars: Mapping[str, Scalar],
                 reuse: HostBuffers | None = None) -> HostCopy:
        """Empty host memory for a copy of ``spec`` to be received into."""
        buffers = reuse if reuse is not None and reuse.fits(spec, False) else \
            HostBuffers(spec)
        return cls(buffers, scalars=scalars)

    def wait(self) -> HostCopy:
        """Block until the copies are complete (the host copy may be read then)."""
        if self._done is not None:
            self._done.synchronize()
        return self

    @property
    def asynchronous(self) -> bool:
        """Whether the copies run on a device stream (complete after ``wait``)."""
        return self._done is not None

    def fence(self) -> None:
        """Work queued from now on the current device stream waits for the copies (their
        sources may be overwritten then)."""
        if self._done is not None:
            torch.cuda.current_stream().wait_event(self._done)

    @property
    def views(self) -> dict[str, torch.Tensor]:
        return self.buffers.views

    @property
    def spec(self) -> Spec:
        """What travels as data."""
        return self.buffers.spec

    def scalars(self) -> dict[str, Scalar]:
        """The 0-dim tensors as (value, dtype), after ``wait``."""
        if self._scalars is None:
            self.wait()
            views = self._landing.views if self._landing is not None else {}
            self._scalars = {n: (v.item(), str(v.dtype)) for n, v in views.items()}
        return self._scalars

    def tensor(self, name: str) -> torch.Tensor:
        """One tensor by name: a host view, or a 0-dim tensor made from its scalar."""
        value = self.scalars().get(name)
        return scalar(value) if value is not None else self.buffers.views[name]

    @property
    def nbytes(self) -> int:
        return self.buffers.nbytes


class HostMover:
    """Moves tensors between a device and host memory, for one process: pinned reusable
    host buffers and a side stream when CUDA is available, plain host memory otherwise."""

    def __init__(self, *, pinned: bool | None = None) -> None:
        self.pinned = torch.cuda.is_available() if pinned is None else pinned
        self._streams: dict[torch.device, Any] = {}

    def _stream(self, device: torch.device) -> Any:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def buffers(self, spec: Spec, reuse: HostBuffers | None = None) -> HostBuffers:
        """Host memory for ``spec``: ``reuse`` when it fits."""
        if reuse is not None and reuse.fits(spec, self.pinned):
            return reuse
        return HostBuffers(spec, pinned=self.pinned)

    @torch.no_grad()
    def copy_out(self, tensors: Sequence[tuple[str, torch.Tensor]],
                 reuse: HostBuffers | None = None) -> HostCopy:
        """Copy each tensor into host memory (``reuse``'s when it fits), asynchronously on
        a GPU: read the copy after ``HostCopy.wait``, overwrite the sources after
        ``HostCopy.fence``. 0-dim tensors become ``HostCopy.scalars``, not data."""
        data = [(n, t) for n, t in tensors if t.dim() > 0]
        zero = [(n, t) for n, t in tensors if t.dim() == 0]
        buffers = self.buffers(spec_of(data), reuse)
        landing = HostBuffers(spec_of(zero), pinned=self.pinned)
        device = next((t.device for _, t in tensors if t.device.type == "cuda"), None)
        stream = self._stream(device) if device is not None else None
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(device))  # after the step's work
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for (name, t), views in [*((d, buffers.views) for d in data),
                                     *((z, landing.views) for z in zero)]:
                src = t.detach()
                if src.device.type == "cuda":
                    src.record_stream(stream)
                views[name].copy_(src, non_blocking=stream is not None)
        done = None
        if stream is not None:
            done = torch.cuda.Event()
            done.record(stream)
        return HostCopy(buffers, landing=landing, done=done)

    @torch.no_grad()
    def to_host(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Host copies of ``tensors``, complete on return; contiguous host tensors are
        returned as they are."""
        moving = {str(k): t for k, t in enumerate(tensors)
                  if not (t.device.type == "cpu" and t.is_contiguous())}
        if not moving:
            return [t.detach() for t in tensors]
        copied = self.copy_out(list(moving.items())).wait()
        return [copied.tensor(str(k)) if str(k) in moving else t.detach()
                for k, t in enumerate(tensors)]

    @torch.no_grad()
    def pack(self, tensors: Sequence[torch.Tensor], flat: torch.Tensor) -> torch.Tensor:
        """``tensors`` (``flat``'s dtype) end to end in host memory ``flat``, complete on
        return: one message of them (on a GPU: copied on the side stream, one wait)."""
        device = next((t.device for t in tensors if t.device.type == "cuda"), None)
        stream = self._stream(device) if device is not None else None
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for view, t in laid_out(flat, tensors):
                view.copy_(t.detach(), non_blocking=stream is not None)
        if stream is not None:
            stream.synchronize()
        return flat

    def staging(self, like: torch.Tensor) -> torch.Tensor:
        """Host memory to receive a tensor like ``like`` into (``like`` itself when it is a
        contiguous host tensor)."""
        if like.device.type == "cpu" and like.is_contiguous():
            return like
        return torch.empty(like.shape, dtype=like.dtype, pin_memory=self.pinned)

    @torch.no_grad()
    def to_device(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy each host tensor into its target (device or host), complete on return."""
        devices = set()
        for src, dst in pairs:
            if src is dst:
                continue
            dst.copy_(src, non_blocking=self.pinned and dst.device.type == "cuda")
            if dst.device.type == "cuda":
                devices.add(dst.device)
        for device in devices:
            torch.cuda.current_stream(device).synchronize()


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
