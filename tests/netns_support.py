"""Hosts built from Linux network namespaces, joined by a bridge: several "machines" on one.

Each host is a namespace with its own loopback and one veth link to a bridge in the root
namespace, with its own address (10.<net>.0.<i+1>/24). ``Host.cut`` takes the host's link
down on the bridge side (packets vanish, as when a cable or a switch port fails: no reset
reaches either side), ``Host.restore`` brings it back. Each host gets an /etc/hosts naming
every host (``ip netns exec`` mounts /etc/netns/<ns>/hosts over it), so that c10d can name
the peers of its sockets. Needs root and ``ip``; ``hosts`` skips the test otherwise.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from dataclasses import dataclass
from typing import Iterator, Sequence

import pytest


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@dataclass(frozen=True)
class Host:
    ns: str
    """The namespace's name."""
    addr: str
    """Its address on the bridge."""
    link: str
    """The veth end on the bridge (root namespace)."""
    dev: str
    """The veth end inside the namespace."""

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this host."""
        return ["ip", "netns", "exec", self.ns, *argv]

    def env(self, base: dict[str, str]) -> dict[str, str]:
        """An environment whose gloo and NCCL sockets use this host's link."""
        return {**base, "GLOO_SOCKET_IFNAME": self.dev, "NCCL_SOCKET_IFNAME": self.dev,
                "TP_SOCKET_IFNAME": self.dev}

    def cut(self) -> None:
        _ip("link", "set", self.link, "down")

    def restore(self) -> None:
        _ip("link", "set", self.link, "up")


def available() -> str | None:
    """Why namespaces cannot be used here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "no ip command"
    probe = f"cmprobe{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except (subprocess.CalledProcessError, OSError) as exc:
        return f"ip netns add failed: {exc}"
    _ip("netns", "del", probe)
    return None


def _name_hosts(made: list[Host]) -> None:
    """Every host's /etc/hosts: loopback and each host's address under its namespace name,
    also in its IPv4-mapped IPv6 form (c10d's server socket is dual-stack: it sees its
    clients as ::ffff:a.b.c.d, which an IPv4 line does not name)."""
    lines = ["127.0.0.1 localhost",
             *(f"{a}{h.addr} {h.ns}" for h in made for a in ("", "::ffff:"))]
    for host in made:
        os.makedirs(f"/etc/netns/{host.ns}", exist_ok=True)
        with open(f"/etc/netns/{host.ns}/hosts", "w") as f:
            f.write("\n".join(lines) + "\n")


@contextlib.contextmanager
def hosts(count: int) -> Iterator[list[Host]]:
    """``count`` hosts on one bridge; every namespace and link is removed on exit."""
    why = available()
    if why is not None:
        pytest.skip(why)
    tag = f"{os.getpid() % 10000}"
    net = 16 + os.getpid() % 200
    bridge = f"cmbr{tag}"
    made: list[Host] = []
    _ip("link", "add", bridge, "type", "bridge")
    try:
        _ip("link", "set", bridge, "up")
        for i in range(count):
            host = Host(ns=f"cmh{tag}n{i}", addr=f"10.{net}.0.{i + 1}", link=f"cmv{tag}n{i}",
                        dev="eth0")
            _ip("netns", "add", host.ns)
            made.append(host)
            _ip("link", "add", host.link, "type", "veth", "peer", "name", f"cmp{tag}n{i}")
            _ip("link", "set", f"cmp{tag}n{i}", "netns", host.ns)
            inside = ["netns", "exec", host.ns, "ip"]
            _ip(*inside, "link", "set", f"cmp{tag}n{i}", "name", host.dev)
            _ip(*inside, "addr", "add", f"{host.addr}/24", "dev", host.dev)
            _ip(*inside, "link", "set", host.dev, "up")
            _ip(*inside, "link", "set", "lo", "up")
            _ip("link", "set", host.link, "master", bridge)
            _ip("link", "set", host.link, "up")
        _name_hosts(made)
        yield made
    finally:
        for host in made:
            shutil.rmtree(f"/etc/netns/{host.ns}", ignore_errors=True)
            with contextlib.suppress(subprocess.CalledProcessError):
                _ip("netns", "del", host.ns)
            with contextlib.suppress(subprocess.CalledProcessError):
                _ip("link", "del", host.link)
        with contextlib.suppress(subprocess.CalledProcessError):
            _ip("link", "del", bridge)
