"""Which tensors of a wave travel as one message, and the pooled host memory they use."""

from __future__ import annotations

import torch

from chameleon_megatron.resilience.recovery.host_copies import HostMover
from chameleon_megatron.resilience.recovery.packing import PACK_BELOW, Item, Pool, bundles

BIG = PACK_BELOW // 4  # fp32 elements of a tensor that travels alone


def test_small_tensors_pack_by_peer_and_dtype_and_large_or_0_dim_ones_go_alone() -> None:
    items = [Item(1, 10, torch.zeros(3)), Item(1, 11, torch.zeros(BIG)),
             Item(2, 12, torch.zeros(4)), Item(1, 13, torch.zeros(5, dtype=torch.bfloat16)),
             Item(1, 14, torch.zeros(6)), Item(1, 15, torch.tensor(7.0)),
             Item(1, 16, torch.zeros(7, dtype=torch.bfloat16))]
    got = [(b.peer, b.tag, [t.numel() for t in b.tensors], b.packed) for b in bundles(items)]
    assert got == [(1, 11, [BIG], False), (1, 15, [1], False),  # alone, in order
                   (1, 10, [3, 6], True), (2, 12, [4], False), (1, 13, [5, 7], True)]


def test_both_ends_pack_the_same_tensors_into_the_same_messages() -> None:
    """The receiver's targets (other memory, same shapes) bundle exactly as the sender's
    tensors do: same tags, same sizes, same order."""
    shapes = [(2, 3), (BIG,), (5,), (), (4, 4)]
    send = [Item(1, 100 + j, torch.randn(s)) for j, s in enumerate(shapes)]
    recv = [Item(0, 100 + j, torch.empty(s)) for j, s in enumerate(shapes)]
    layout = [[(b.tag, [tuple(t.shape) for t in b.tensors]) for b in bundles(items)]
              for items in (send, recv)]
    assert layout[0] == layout[1]


def test_pack_puts_tensors_end_to_end() -> None:
    a, b = torch.arange(6.0).view(2, 3), torch.arange(6.0, 10.0)
    flat = HostMover().pack([a, b.t()], torch.empty(10))
    assert torch.equal(flat, torch.arange(10.0))


def test_the_pool_lends_a_buffer_again_once_it_is_given_back() -> None:
    pool = Pool(pinned=False)
    first = pool.take(torch.float32, 100)
    second = pool.take(torch.float32, 100)
    assert first.data_ptr() != second.data_ptr() and first.numel() == 100
    pool.give([first])
    again = pool.take(torch.float32, 90)
    assert again.data_ptr() == first.data_ptr() and again.numel() == 90
    pool.give([again])
    other = pool.take(torch.bfloat16, 50)  # another dtype: memory of its own
    assert other.data_ptr() != first.data_ptr()
    larger = pool.take(torch.float32, 1000)  # too small a free buffer is dropped
    assert larger.numel() == 1000 and larger.data_ptr() != first.data_ptr()
