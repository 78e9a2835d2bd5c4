"""A slow or lossy link between namespace hosts, where the kernel has no ``sch_netem``.

``impaired(host, peers, delay_ms=..., loss=...)`` makes ``host``'s link:

- lose each packet with probability ``loss``, both ways (iptables' ``statistic`` match drops
  it as it arrives: at ``host`` from the link, and at every peer from ``host``'s address);
- deliver the packets that reach ``host`` ``delay_ms`` later (its INPUT chain queues them
  to ``link_delay.py``, which holds each one that long): one way, so a round trip with
  ``host`` takes ``delay_ms`` longer, as netem's delay on the link's other end would.

Packets are dropped where they arrive, not where they leave: a local drop at the sender
would be reported to its TCP stack, which a lossy wire never does. Needs root, ``ip`` and
``iptables`` (``scripts/setup_host_tools.sh`` installs it); ``needs`` says why not.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Iterator, Sequence

from netns_support import Host, available

DELAYER = Path(__file__).resolve().parent / "link_delay.py"
QUEUE = 7


def needs() -> str | None:
    """Why links cannot be impaired here (None: they can)."""
    return available() or (None if shutil.which("iptables") else "no iptables command")


def _iptables(host: Host, *rule: str) -> None:
    subprocess.run(host.command(["iptables", *rule]), check=True, capture_output=True,
                   text=True)


def drop_rules(host: Host, peers: Sequence[Host], loss: float) -> list[tuple[Host, list[str]]]:
    """The rules that lose each packet with probability ``loss`` on ``host``'s link."""
    chance = ["-m", "statistic", "--mode", "random", "--probability", f"{loss:.6f}", "-j",
              "DROP"]
    return [(host, ["INPUT", "-i", host.dev, *chance]),
            *((peer, ["INPUT", "-s", host.addr, *chance]) for peer in peers)]


@contextlib.contextmanager
def impaired(host: Host, peers: Sequence[Host], *, delay_ms: float = 0.0,
             loss: float = 0.0) -> Iterator[dict[str, int]]:
    """``host``'s link slow and lossy while inside; yields ``{"delayed": n}``, filled on exit
    with the packets the delayer held (so a test can tell that the delay was in force)."""
    rules = drop_rules(host, peers, loss) if loss > 0 else []
    delayer = None
    seen = {"delayed": 0}
    if delay_ms > 0:
        delayer = subprocess.Popen(
            host.command([sys.executable, str(DELAYER), "--queue", str(QUEUE),
                          "--delay-ms", str(delay_ms)]),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert delayer.stdout is not None and delayer.stdout.readline().strip() == "ready", \
            delayer.communicate()[0]
        # last: an accepted verdict skips the rest of the chain (the drop comes first)
        rules.append((host, ["INPUT", "-i", host.dev, "-j", "NFQUEUE", "--queue-num",
                                str(QUEUE)]))
    added: list[tuple[Host, list[str]]] = []
    try:
        for where, rule in rules:
            _iptables(where, "-A", *rule)
            added.append((where, rule))
        yield seen
    finally:
        for where, rule in reversed(added):
            with contextlib.suppress(subprocess.CalledProcessError):
                _iptables(where, "-D", *rule)
        if delayer is not None:
            delayer.terminate()
            out = delayer.communicate(timeout=30)[0]
            seen["delayed"] = int(out.split("delayed ")[-1].split()[0]) if "delayed " in out \
                else 0
