"""The host pool holds exactly what it says, within its cache bound, and frees the rest."""

from __future__ import annotations

from chameleon_megatron.swap import hostpool
from chameleon_megatron.swap.hostpool import HostPool


def test_buffers_are_exact_and_the_cache_bound_holds() -> None:
    pool = HostPool(pin=False, cache_bytes=1000)
    a, b = pool.acquire(300), pool.acquire(500)
    assert (a.numel(), b.numel()) == (300, 500)  # no rounding up
    assert pool.held_bytes == 800 and pool.live == 2
    pool.release(a)
    pool.release(b)
    assert pool.held_bytes == pool.cached_bytes == 800 and pool.live == 0
    c = pool.acquire(700)  # no cached buffer of that size: a new one
    assert pool.held_bytes == 1500 and pool.allocated == 3
    pool.release(c)  # caching it would pass the bound: dropped
    assert pool.held_bytes == pool.cached_bytes == 800
    assert pool.acquire(500) is b  # reused
    pool.release(b)
    pool.clear()
    assert pool.held_bytes == 0


def test_reserve_makes_a_plans_buffers_ahead_within_the_bound() -> None:
    pool = HostPool(pin=False, cache_bytes=1000)
    pool.release(pool.acquire(300))
    assert pool.reserve([300, 300, 200, 500]) == 500  # one 300 cached; 300 + 200; 500 passes
    assert pool.cached_bytes == 800 and pool.allocated == 3
    before = pool.allocated
    bufs = [pool.acquire(300), pool.acquire(300), pool.acquire(200)]
    assert pool.allocated == before  # the step took them from the cache
    for buf in bufs:
        pool.release(buf)
    assert pool.reserve([300, 300, 200]) == 0


def test_a_buffer_cuda_refuses_to_register_stays_pageable(monkeypatch) -> None:
    """Registering fails on some machines (a lent H200 under gVisor): the buffer is used
    pageable, never unregistered; the registered ones are unregistered when dropped."""
    registered, unregistered = [], []

    def register(buf):
        if len(registered) == 1:
            raise RuntimeError("cudaHostRegister of 500 bytes failed (error 1)")
        registered.append(buf.data_ptr())

    monkeypatch.setattr(hostpool, "register_host", register)
    monkeypatch.setattr(hostpool, "unregister_host",
                        lambda ptr: unregistered.append(ptr))
    pool = HostPool(pin=True, cache_bytes=0)
    a, b = pool.acquire(300), pool.acquire(500)
    assert (len(registered), pool.unpinned, b.numel()) == (1, 1, 500)
    pool.release(b)
    assert unregistered == []  # never registered
    pool.release(a)
    assert unregistered == registered


def test_closing_unregisters_every_buffer_handed_out_or_cached(monkeypatch) -> None:
    """Memory freed while registered makes CUDA refuse a later buffer sharing one of its
    pages: a pool that goes away unregisters everything it registered."""
    registered, unregistered = set(), set()
    monkeypatch.setattr(hostpool, "register_host", lambda buf: registered.add(buf.data_ptr()))
    monkeypatch.setattr(hostpool, "unregister_host", lambda ptr: unregistered.add(ptr))
    pool = HostPool(pin=True, cache_bytes=1 << 20)
    live, cached = pool.acquire(300), pool.acquire(500)
    pool.release(cached)
    del pool  # its finalizer closes it
    assert unregistered == registered == {live.data_ptr(), cached.data_ptr()}
