"""Holds every packet of a netfilter queue for a fixed time, then lets it through: a link's
delay where the kernel has no ``sch_netem`` (these machines' kernel has none).

Run inside a network namespace whose iptables rules send packets to ``--queue``
(``-j NFQUEUE --queue-num N``). It speaks nfnetlink_queue over a raw netlink socket (no
library): bind the queue, receive each packet's id (metadata only, no payload), and give
the accept verdict once its time has come, in arrival order. On SIGTERM it lets everything
held through and prints how many packets it delayed.

    python tests/link_delay.py --queue 0 --delay-ms 50
"""

from __future__ import annotations

import argparse
import collections
import select
import signal
import socket
import struct
import sys
import time

NETLINK_NETFILTER = 12
SOL_NETLINK = 270
NETLINK_NO_ENOBUFS = 5
NFNL_SUBSYS_QUEUE = 3
MSG_PACKET, MSG_VERDICT, MSG_CONFIG = (NFNL_SUBSYS_QUEUE << 8) | 0, \
    (NFNL_SUBSYS_QUEUE << 8) | 1, (NFNL_SUBSYS_QUEUE << 8) | 2
NLM_F_REQUEST, NLM_F_ACK = 1, 4
NLMSG_ERROR = 2
CFG_CMD, CFG_PARAMS, CFG_QUEUE_MAXLEN = 1, 2, 3
CMD_BIND = 1
COPY_META = 1
PACKET_HDR, VERDICT_HDR = 1, 2
NF_ACCEPT = 1


def _attr(kind: int, payload: bytes) -> bytes:
    raw = struct.pack("=HH", 4 + len(payload), kind) + payload
    return raw + b"\0" * (-len(raw) % 4)


def _message(kind: int, queue: int, attrs: bytes, flags: int = NLM_F_REQUEST) -> bytes:
    body = struct.pack("=BB", socket.AF_UNSPEC, 0) + struct.pack(">H", queue) + attrs
    return struct.pack("=IHHII", 16 + len(body), kind, flags, 0, 0) + body


def _messages(data: bytes):
    """(type, payload after the netlink header) of each netlink message in ``data``."""
    at = 0
    while at + 16 <= len(data):
        length, kind = struct.unpack_from("=IH", data, at)
        yield kind, data[at + 16:at + length]
        at += (length + 3) & ~3


def _packet_id(payload: bytes) -> int | None:
    at = 4  # nfgenmsg
    while at + 4 <= len(payload):
        length, kind = struct.unpack_from("=HH", payload, at)
        if kind & 0x7FFF == PACKET_HDR:
            return struct.unpack_from(">I", payload, at + 4)[0]
        at += (length + 3) & ~3
    return None


def bind(queue: int) -> socket.socket:
    """A netlink socket bound to ``queue``, copying packets' metadata only."""
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    sock.setsockopt(SOL_NETLINK, NETLINK_NO_ENOBUFS, 1)
    sock.bind((0, 0))
    attrs = (_attr(CFG_CMD, struct.pack(">BxH", CMD_BIND, socket.AF_INET))
             + _attr(CFG_PARAMS, struct.pack(">IB", 0, COPY_META))
             + _attr(CFG_QUEUE_MAXLEN, struct.pack(">I", 1 << 16)))
    sock.send(_message(MSG_CONFIG, queue, attrs, NLM_F_REQUEST | NLM_F_ACK))
    for kind, payload in _messages(sock.recv(65536)):
        code = struct.unpack_from("=i", payload)[0] if kind == NLMSG_ERROR else 0
        if code:  # an error's payload starts with -errno (0: the acknowledgement)
            raise OSError(-code, f"binding netfilter queue {queue}")
    return sock


def run(queue: int, delay_s: float) -> int:
    """Delay packets until SIGTERM; how many were delayed."""
    sock = bind(queue)
    held: collections.deque[tuple[float, int]] = collections.deque()
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    delayed = 0

    def release(until: float) -> None:
        while held and held[0][0] <= until:
            _, packet = held.popleft()
            sock.send(_message(MSG_VERDICT, queue,
                               _attr(VERDICT_HDR, struct.pack(">II", NF_ACCEPT, packet))))

    print("ready", flush=True)
    while not stopping:
        wait = max(0.0, held[0][0] - time.monotonic()) if held else 0.5
        try:
            ready, _, _ = select.select([sock], [], [], wait)
        except InterruptedError:
            continue
        if ready:
            now = time.monotonic()
            for kind, payload in _messages(sock.recv(1 << 20)):
                packet = _packet_id(payload) if kind == MSG_PACKET else None
                if packet is not None:
                    held.append((now + delay_s, packet))
                    delayed += 1
        release(time.monotonic())
    release(float("inf"))
    return delayed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queue", type=int, default=0)
    parser.add_argument("--delay-ms", type=float, required=True)
    args = parser.parse_args()
    delayed = run(args.queue, args.delay_ms / 1000)
    print(f"delayed {delayed} packets", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
