"""Shutting a process's connections down (``transport.close_connections``), on real loopback
sockets in a child process (it shuts every connection of the process it runs in)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")]

CHILD = """
import os, socket, sys, time
from chameleon_megatron.megatron import transport

def state(sock):
    inode = os.fstat(sock.fileno()).st_ino
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            fields = line.split()
            if int(fields[9]) == inode:
                return fields[3]
    return "gone"

with socket.create_server(("127.0.0.1", 0)) as listener, \\
        socket.create_server(("127.0.0.1", 0)) as kept_listener:
    port, kept_port = listener.getsockname()[1], kept_listener.getsockname()[1]
    open_, closed_by_peer = (socket.create_connection(("127.0.0.1", port)) for _ in range(2))
    kept = socket.create_connection(("127.0.0.1", kept_port))
    ends = [listener.accept()[0] for _ in range(2)]
    kept_end = kept_listener.accept()[0]
    ends[1].close()  # the peer closes first: this end is left in CLOSE_WAIT
    deadline = time.monotonic() + 10
    while state(closed_by_peer) != "08":
        assert time.monotonic() < deadline, "the peer's close never arrived"
        time.sleep(0.01)
    n = transport.close_connections({kept_port})
    # the open end, its peer end, the end the peer closed first; not the kept port's two
    print(n, state(closed_by_peer), open_.recv(1), kept.getsockopt(socket.SOL_SOCKET,
                                                                 socket.SO_ERROR))
"""


def test_open_connections_and_those_whose_peer_closed_first_are_shut_but_the_kept_port() -> None:
    """An operation blocked on a connection whose peer closed it first (CLOSE_WAIT) waits
    until this end is shut down too: the shutdown covers it, and leaves the kept port's."""
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0, out.stderr
    n, state, received, kept_error = out.stdout.split()
    assert int(n) == 3 and state != "08", out.stdout  # LAST_ACK or gone, not CLOSE_WAIT
    assert received == "b''" and kept_error == "0", out.stdout
