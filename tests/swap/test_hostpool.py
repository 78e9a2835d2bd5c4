"""The host pool holds exactly what it says, within its cache bound, and frees the rest."""

from __future__ import annotations

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
