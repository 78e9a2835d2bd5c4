"""User mistakes end in one line that names the flag, file (with line) or value, exit 2.

``user_error(exc)`` tells a user's mistake (a bad flag or value, a missing or malformed file)
from a bug and words it as one line; ``reading(path)`` turns the errors of loading a user's
file into such a line, with the path and, for YAML and JSON, the line. The entries
(``chameleon``, ``chameleon-pretrain-gpt``, ``chameleon-run``) print ``<prog>: error: <line>``
and exit 2, without a traceback (``-v``/``--verbose`` where offered shows it).
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Iterator

USAGE_EXIT = 2


class UserError(ValueError):
    """A mistake in what the user gave; its message is the whole story."""


def user_error(exc: BaseException) -> str | None:
    """The one-line message of a user's mistake; None for anything else (a bug)."""
    if isinstance(exc, FileNotFoundError) and exc.filename:
        return f"{exc.filename}: no such file or directory"
    if isinstance(exc, (IsADirectoryError, NotADirectoryError, PermissionError)) and exc.filename:
        return f"{exc.filename}: {exc.strerror.lower()}"
    if isinstance(exc, ValueError):  # ConfigError, UserError, and checks naming the value
        return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return None


@contextlib.contextmanager
def reading(path: str | Path) -> Iterator[None]:
    """Errors of parsing the user's file ``path`` become UserError('<path>:<line>: ...')."""
    import yaml  # what the callers read YAML with

    try:
        yield
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise UserError(f"{where}: not valid YAML ({problem})") from None


def fail(prog: str, message: str) -> SystemExit:
    """Print ``<prog>: error: <message>`` and return the exit to raise."""
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    return SystemExit(USAGE_EXIT)


@contextlib.contextmanager
def user_errors(prog: str, *, speak: bool = True,
                only: tuple[type[BaseException], ...] = (Exception,)) -> Iterator[None]:
    """A user's mistake raised inside ends the process: ``<prog>: error: <line>``, exit 2.
    ``speak``: whether this process prints it (one rank of many that fail alike); ``only``:
    the exceptions that can be one (where others would be bugs)."""
    try:
        yield
    except only as exc:
        message = user_error(exc)
        if message is None:
            raise
        if speak:
            raise fail(prog, message) from None
        raise SystemExit(USAGE_EXIT) from None
