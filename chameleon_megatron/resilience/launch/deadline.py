"""Calls into the job store that give up after a deadline.

A TCP store client whose server's link went silent (no reset: a cut cable, a dead switch
port) blocks in its call far past its own timeout: measured here on torch 2.13 with a 5 s
timeout, an ``add`` had not returned after 60 s. An agent that waited for it would never
notice that it is cut off. So its store work runs on a helper thread, and the agent stops
waiting after the deadline; the stuck thread is abandoned (a daemon, never reused).
"""

from __future__ import annotations

import threading
from typing import Callable, TypeVar

T = TypeVar("T")

THREAD_NAME = "store-call"


def abandoned() -> bool:
    """Whether a call given up on is still blocked: then the process must leave with
    ``os._exit``, since finalizing the interpreter ends such a daemon thread inside C++ code,
    which aborts (SIGABRT) instead of exiting with the intended status."""
    return any(t.name == THREAD_NAME and t.is_alive() for t in threading.enumerate())


class Unanswered(Exception):
    """The call did not return within its deadline."""


def within(timeout_s: float, fn: Callable[[], T]) -> T:
    """``fn()``'s result or exception; ``Unanswered`` when it has not returned after
    ``timeout_s``."""
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the caller
            box["error"] = exc

    thread = threading.Thread(target=run, name=THREAD_NAME, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise Unanswered(f"no answer from the job store for {timeout_s:g} s")
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]
