"""Which side of a network partition may go on training: never two.

A node cannot tell a dead peer from a cut link, so the rule is written so that two disjoint
groups of the launch's agents can never both go on, whatever the cut:

- **The side that holds the job store** goes on (in memory, as after any node failure)
  while the launch agents it has lost are at most half of them. All in-memory recovery
  agrees through the store, so no other side can recover in memory.
- **A side without the store** relaunches the job from its checkpoint (``store_loss``) only
  when it holds a strict majority of the launch's agents; otherwise it is cut off: it ends
  its workers and exits with ``CUT_OFF_EXIT``.

Two disjoint sides that both went on would hold more than all agents between them (at least
half, and more than half). On an even split the store's side goes on. Losing more than half
of the agents at once stops the job everywhere: from inside, that is indistinguishable from
a partition whose other side holds the majority.

Timing: a side without the store waits ``ft.node_timeout_s`` after it lost the store before
relaunching, so that the store's side, which declares its agents lost after the same
window, has stopped its workers first (``relaunch_wait_s``).
"""

from __future__ import annotations

from dataclasses import dataclass

from chameleon_megatron.resilience.store.exits import CUT_OFF_EXIT


@dataclass(frozen=True)
class Verdict:
    go_on: bool
    why: str
    """One line: what this side holds against the rule."""


def store_side(launch_agents: int, lost: int) -> Verdict:
    """The store's side, having lost ``lost`` of the ``launch_agents`` launch agents."""
    go_on = 2 * lost <= launch_agents
    return Verdict(go_on, f"this node hosts the job store and lost {lost} of the launch's "
                          f"{launch_agents} agents ({'at most half' if go_on else 'a majority'})")


def storeless_side(launch_agents: int, holding: int) -> Verdict:
    """A side without the store that still sees ``holding`` launch agents (itself included)."""
    go_on = 2 * holding > launch_agents
    return Verdict(go_on, f"this side holds {holding} of the launch's {launch_agents} agents "
                          f"({'a majority' if go_on else 'no majority'}) and not the job store")


def relaunch_wait_s(node_timeout_s: float) -> float:
    """How long a side without the store waits, after losing it, before its new job starts."""
    return node_timeout_s


class CutOff(Exception):
    """Raised by an agent whose node must stop: it is cut off from the job."""

    def __init__(self, lost: str, verdict: Verdict) -> None:
        super().__init__(f"cut off from the job: {lost}; {verdict.why}: its workers are stopped "
                         f"and it exits ({CUT_OFF_EXIT})")


def left_behind() -> Verdict:
    """A node, not the store's host, whose every worker the job went on without."""
    return Verdict(False, "this node does not host the job store")
