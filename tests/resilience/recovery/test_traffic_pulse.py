"""Beats while the process's peer connections carry data (a slow link's long step), none
while only the job store's connection does, and none once the traffic stops (a hang)."""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from contextlib import contextmanager
from typing import Iterator

import pytest

from chameleon_megatron.megatron import transport
from chameleon_megatron.resilience.recovery.traffic_pulse import TrafficPulse, advanced

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


@contextmanager
def connection() -> Iterator[tuple[socket.socket, socket.socket, int]]:
    """An established loopback TCP connection: (client, server side, the server's port)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        server, _ = listener.accept()
    with client, server:
        yield client, server, port


def _send(a: socket.socket, b: socket.socket, n: int) -> None:
    a.sendall(b"x" * n)
    got = 0
    while got < n:
        got += len(b.recv(n - got))


def _mine(moved: dict[int, int], *socks: socket.socket) -> dict[int, int]:
    inodes = {os.fstat(s.fileno()).st_ino for s in socks}
    return {inode: n for inode, n in moved.items() if inode in inodes}


def test_the_byte_counters_grow_with_the_data_either_way_and_skip_the_kept_port() -> None:
    with connection() as (client, server, port):
        before = _mine(transport.bytes_moved(set()), client, server)
        assert len(before) == 2  # both ends of the connection are this process's
        _send(client, server, 50_000)
        _send(server, client, 20_000)
        time.sleep(0.05)  # the last acknowledgements
        after = _mine(transport.bytes_moved(set()), client, server)
        grown = sorted(after[k] - before[k] for k in after)
        assert grown == [70_000, 70_000]  # acked 50 000 + received 20 000, and the reverse
        assert _mine(transport.bytes_moved({port}), client, server) == {}


def test_advanced_counts_a_grown_or_new_connection_not_a_closed_one() -> None:
    assert advanced({1: 10}, {1: 11})
    assert advanced({1: 10}, {1: 10, 2: 5})
    assert not advanced({1: 10}, {1: 10})
    assert not advanced({1: 10, 2: 5}, {1: 10})
    assert not advanced({}, {3: 0})


def _pulses_while(pump: threading.Event, sock_pair, keep: int | None, seconds: float,
                  enough: int | None = None) -> int:
    """Pulses counted while ``sock_pair`` carries data for ``seconds`` (or until ``enough``
    came: a loaded host runs the pulse thread late, not never)."""
    count = [0]
    a, b = sock_pair

    def feed() -> None:
        while pump.is_set():
            _send(a, b, 1000)
            time.sleep(0.02)
    feeder = threading.Thread(target=feed, daemon=True)
    pulse = TrafficPulse(lambda: count.__setitem__(0, count[0] + 1), keep, period_s=0.1).start()
    feeder.start()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and (enough is None or count[0] < enough):
        time.sleep(0.05)
    pump.clear()
    feeder.join()
    pulse.stop()
    return count[0]


def test_it_pulses_while_a_peer_connection_carries_data_and_not_for_the_stores() -> None:
    with connection() as (client, server, port), connection() as (store_c, store_s, store_port):
        flowing = threading.Event()
        flowing.set()
        assert _pulses_while(flowing, (client, server), store_port, 30.0, enough=5) >= 5
        flowing.set()
        # Only the job store's connection busy (the beats themselves go there): no pulse.
        assert _pulses_while(flowing, (store_c, store_s), store_port, 1.0) == 0


def test_it_stops_pulsing_when_the_traffic_stops_and_never_starts_without_a_store_port() -> None:
    count = [0]
    readings = iter([{1: 0}, {1: 100}, {1: 200}] + [{1: 200}] * 1000)
    pulse = TrafficPulse(lambda: count.__setitem__(0, count[0] + 1), 4242, period_s=0.01,
                         read=lambda keep: next(readings)).start()
    time.sleep(0.3)
    pulse.stop()
    assert count[0] == 2  # the two readings that grew, then silence (a hang) beats no more

    never = TrafficPulse(lambda: count.__setitem__(0, count[0] + 100), None, period_s=0.01,
                         read=lambda keep: {1: int(time.monotonic() * 1e6)}).start()
    time.sleep(0.1)
    never.stop()
    assert count[0] == 2


def test_a_failing_beat_ends_the_thread_not_the_process() -> None:
    def lost() -> None:
        raise RuntimeError("the job store is unreachable")
    readings = iter(range(10**6))
    pulse = TrafficPulse(lost, 4242, period_s=0.01, read=lambda keep: {1: next(readings)})
    pulse.start()
    time.sleep(0.2)
    assert not pulse._thread.is_alive()
    pulse.stop()
