"""Letting go of what a failed step's frames hold."""

from __future__ import annotations

import traceback


def clear_frames(exc: BaseException | None, seen: set[int] | None = None) -> None:
    """Drop the locals of the finished frames in the tracebacks of ``exc``, its cause and
    its context (recursively): a failed step's frames hold its activations and autograd
    graph, which hold the layout's parameters. The tracebacks keep their lines."""
    seen = set() if seen is None else seen
    if exc is None or id(exc) in seen:
        return
    seen.add(id(exc))
    traceback.clear_frames(exc.__traceback__)
    clear_frames(exc.__cause__, seen)
    clear_frames(exc.__context__, seen)
