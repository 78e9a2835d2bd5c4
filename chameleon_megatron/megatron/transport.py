"""The gloo transport of this process: closing it, so that an operation blocked in it
returns, and reading how much data it has carried.

On gloo nothing torch offers (``abort``, ``shutdown``, ``destroy_process_group``) interrupts
an operation blocked on a live peer: it waits for the peer or for the group's timeout, and
gloo's point-to-point waits keep the timeout of the group's creation. Shutting the process's
gloo connections down (``socket.shutdown(SHUT_RDWR)`` on duplicates of their descriptors)
makes such an operation raise "Connection closed by peer" within milliseconds, on this
process and on the peers at the other end. The job store's connections are kept: they are
the ones to or from its port.

``bytes_moved`` reads each connection's byte counters from the kernel (``TCP_INFO``): they
show a collective advancing even while each of its waits is long, which a slow link makes.

Linux only (the connections are found in ``/proc``); elsewhere nothing is closed, no traffic
is seen, and the groups' timeouts bound the wait.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
from pathlib import Path
from typing import Iterator

logger = logging.getLogger(__name__)

_ESTABLISHED = "01"
_CLOSE_WAIT = "08"
"""The peer closed its end; this end is open until shut down or closed."""


def _tcp_ports(states: tuple[str, ...] = (_ESTABLISHED,)) -> dict[int, tuple[int, int]]:
    """socket inode -> (local port, remote port) of this network namespace's TCP connections
    in ``states``."""
    out: dict[int, tuple[int, int]] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] not in states:
                continue
            local, remote = (int(f.rsplit(":", 1)[1], 16) for f in fields[1:3])
            out[int(fields[9])] = (local, remote)
    return out


def _socket_fds() -> dict[int, int]:
    """socket inode -> file descriptor, for this process's sockets."""
    out: dict[int, int] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for name in names:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            out[int(target[8:-1])] = int(name)
    return out


def _connections(keep_ports: set[int], states: tuple[str, ...] = (_ESTABLISHED,)
                 ) -> Iterator[tuple[int, int]]:
    """(socket inode, file descriptor) of this process's TCP connections in ``states``, but
    those to or from a port in ``keep_ports``."""
    ports = _tcp_ports(states)
    for inode, fd in _socket_fds().items():
        local_remote = ports.get(inode)
        if local_remote is not None and not keep_ports & set(local_remote):
            yield inode, fd


def close_connections(keep_ports: set[int]) -> int:
    """Shut down this process's open TCP connections except those to or from a port in
    ``keep_ports``; returns how many were shut down. Those whose peer closed first are
    included: an operation blocked on one ends when this end is shut down too."""
    closed = 0
    for _, fd in _connections(keep_ports, (_ESTABLISHED, _CLOSE_WAIT)):
        try:
            with socket.fromfd(fd, socket.AF_INET, socket.SOCK_STREAM) as dup:
                dup.shutdown(socket.SHUT_RDWR)
            closed += 1
        except OSError as exc:  # closed meanwhile, or not a stream socket after all
            logger.debug("shutdown of fd %d skipped: %s", fd, exc)
    return closed


_TCP_INFO_LEN = 136
_BYTES = struct.Struct("=QQ")
"""tcpi_bytes_acked, tcpi_bytes_received: at offset 120 of Linux's struct tcp_info (4.2+)."""


def bytes_moved(keep_ports: set[int]) -> dict[int, int]:
    """socket inode -> bytes the peer acknowledged plus bytes received, for each of this
    process's established TCP connections except those to or from ``keep_ports``: they grow
    while the connection carries data, in either direction."""
    out: dict[int, int] = {}
    for inode, fd in _connections(keep_ports):
        try:
            with socket.fromfd(fd, socket.AF_INET, socket.SOCK_STREAM) as dup:
                info = dup.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
        except OSError:
            continue  # closed meanwhile
        if len(info) >= _TCP_INFO_LEN:
            out[inode] = sum(_BYTES.unpack_from(info, 120))
    return out
