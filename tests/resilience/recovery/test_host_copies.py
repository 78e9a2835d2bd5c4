"""The one module that moves training state between device and host memory."""

from __future__ import annotations

import pytest
import torch

from chameleon_megatron.resilience.recovery.host_copies import (
    HostBuffers,
    HostCopy,
    HostMover,
    scalar,
)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit pattern (NaNs compare equal, -0.0 differs from 0.0)."""
    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[
        t.element_size()])


def state(seed: int, device: str = "cpu") -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    main = torch.randn(5, 3, generator=g)
    main[0, 0], main[0, 1] = float("nan"), -0.0
    return [(n, t.to(device)) for n, t in [
        ("0/main", main),
        ("0/exp_avg", torch.randn(5, 3, generator=g).to(torch.bfloat16)),
        ("0/exp_avg_sq", torch.rand(3, 5, generator=g).t()),  # not contiguous
        ("0/step", torch.tensor(7.0)),
        ("1/main", torch.randn(4, generator=g)),
        ("1/step", torch.tensor(3, dtype=torch.int64)),
    ]]


def test_each_tensor_round_trips_bitwise_in_its_own_dtype() -> None:
    tensors = state(0)
    copy = HostMover().copy_out(tensors).wait()
    for name, t in tensors:
        if t.dim():
            got = copy.views[name]
            assert got.dtype == t.dtype and got.shape == t.shape
            assert torch.equal(bits(got), bits(t)), name
    # one flat buffer per dtype, each tensor a view of it (no concatenation, no cast)
    assert [f.dtype for f in copy.buffers.flats] == [torch.float32, torch.bfloat16]
    assert copy.buffers.flats[0].numel() == 15 + 15 + 4


def test_scalars_travel_as_metadata_and_come_back_exactly() -> None:
    copy = HostMover().copy_out(state(0)).wait()
    assert copy.scalars() == {"0/step": (7.0, "torch.float32"), "1/step": (3, "torch.int64")}
    assert "0/step" not in copy.views and all(n != "0/step" for n, _, _ in copy.spec)
    step = copy.tensor("1/step")
    assert step.dim() == 0 and step.dtype == torch.int64 and step.item() == 3
    odd = torch.tensor(0.1, dtype=torch.float32)  # not a double: must come back as it was
    assert torch.equal(bits(scalar((odd.item(), str(odd.dtype)))), bits(odd))
    # a received copy is rebuilt from the spec and the scalars alone
    got = HostCopy.received(copy.spec, copy.scalars())
    for flat, sent in zip(got.buffers.flats, copy.buffers.flats):
        flat.copy_(sent)
    assert torch.equal(got.tensor("0/step"), torch.tensor(7.0))
    assert torch.equal(bits(got.views["0/exp_avg"]), bits(copy.views["0/exp_avg"]))


def test_host_buffers_are_reused_when_the_tensors_are_the_same() -> None:
    mover = HostMover()
    first = mover.copy_out(state(0)).wait()
    pointers = [f.data_ptr() for f in first.buffers.flats]
    second = mover.copy_out(state(1), reuse=first.buffers).wait()
    assert second.buffers is first.buffers
    assert [f.data_ptr() for f in second.buffers.flats] == pointers
    assert torch.equal(bits(second.views["1/main"]), bits(state(1)[4][1]))
    other = mover.copy_out(state(1)[:2], reuse=first.buffers)  # another list: new memory
    assert other.buffers is not first.buffers


def test_a_transfer_moves_only_what_is_not_host_memory_already() -> None:
    mover = HostMover()
    host, strided = torch.arange(6.0), torch.arange(6.0).view(2, 3).t()
    out = mover.to_host([host, strided, torch.tensor(2.0)])
    assert out[0] is host or out[0].data_ptr() == host.data_ptr()
    assert out[1].is_contiguous() and torch.equal(out[1], strided)
    assert out[2].item() == 2.0
    target = torch.zeros(3, 2).t()  # not contiguous: received through host staging
    staged = mover.staging(target)
    assert staged is not target and staged.is_contiguous()
    staged.copy_(torch.arange(6.0).view(2, 3))
    mover.to_device([(staged, target)])
    assert torch.equal(target, torch.arange(6.0).view(2, 3))
    assert mover.staging(host) is host


def test_a_bad_dtype_name_is_one_clear_error() -> None:
    with pytest.raises(ValueError, match="'torch.float99': not a torch dtype"):
        HostBuffers((("x", (2,), "torch.float99"),))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_device_copy_runs_on_a_side_stream_into_pinned_memory() -> None:
    mover = HostMover()
    tensors = state(0, "cuda")
    copy = mover.copy_out(tensors)
    assert copy.asynchronous and all(f.is_pinned() for f in copy.buffers.flats)
    copy.fence()  # the sources may be overwritten after this on the current stream
    for _, t in tensors:
        t.add_(1)
    copy.wait()
    for name, t in state(0, "cuda"):
        if t.dim():
            assert torch.equal(bits(copy.views[name]), bits(t.cpu())), name
    assert copy.scalars()["0/step"] == (7.0, "torch.float32")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_device_tensors_pack_into_pinned_host_memory_and_unpack_back() -> None:
    """A migration's packed message from device tensors (side stream, one wait) and its
    views copied back into device targets."""
    mover = HostMover()
    sources = [torch.randn(3, 5, device="cuda"), torch.randn(7, device="cuda").t()]
    flat = mover.pack(sources, torch.empty(22, pin_memory=True))
    assert torch.equal(flat, torch.cat([t.reshape(-1).cpu() for t in sources]))
    targets = [torch.zeros_like(t) for t in sources]
    mover.to_device([(flat[:15].view(3, 5), targets[0]), (flat[15:], targets[1])])
    assert all(torch.equal(a, b) for a, b in zip(targets, sources))
