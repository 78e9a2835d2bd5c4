"""A worker of chameleon-run ends with its agent.

An agent killed without the chance to stop its workers (SIGKILL, the OOM killer) would leave
them running: announced failed with their node, yet still holding memory, ports and store
connections, and alive after the job ends. A worker the agent started asks the kernel to
kill it when its parent dies (Linux ``PR_SET_PDEATHSIG``); without prctl, a daemon thread
watches the parent. The agent spawns workers from its main thread, which lives as long as
the agent (the signal follows the spawning thread, not the process).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import signal
import threading
import time

from chameleon_megatron.resilience.store.env import AGENT_PID_ENV

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def end_with_agent(poll_s: float = 1.0) -> str | None:
    """Tie this process's life to its agent's; returns how ("prctl" or "watch"), or None
    where no agent started it. Exits at once if the agent is already gone."""
    text = os.environ.get(AGENT_PID_ENV)
    if text is None:
        return None
    agent = int(text)
    how = "prctl" if _parent_death_signal(signal.SIGKILL) else "watch"
    if how == "watch":
        threading.Thread(target=_watch, args=(agent, poll_s), name="agent-watch",
                         daemon=True).start()
    if os.getppid() != agent:  # died before the request took effect
        _leave(agent)
    return how


def _parent_death_signal(sig: signal.Signals) -> bool:
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):  # not Linux
        return False


def _watch(agent: int, poll_s: float) -> None:
    while os.getppid() == agent:
        time.sleep(poll_s)
    _leave(agent)


def _leave(agent: int) -> None:
    logger.error("the chameleon-run agent (pid %d) is gone: this worker ends with it", agent)
    os.kill(os.getpid(), signal.SIGKILL)
