#!/usr/bin/env python3
"""Add (or remove) Chameleon's hook in a Megatron-LM checkout's ``pretrain_gpt.py``.

The change is one marked block inserted as the first lines of the ``__main__`` block (before
anything there parses arguments, as Megatron-LM's in-process-restart wrapper does); it
rebinds ``pretrain`` to ``chameleon_megatron.megatron_lm.wrap_pretrain(pretrain)``,
which adds the ``--chameleon-*`` flags to every argument parse and installs Chameleon's
plugins for the ``pretrain(...)`` call. No existing line is edited, so removing the block
restores the file byte for byte.

    python patches/apply.py apply  /path/to/Megatron-LM   # idempotent
    python patches/apply.py remove /path/to/Megatron-LM   # reversible
    python patches/apply.py status /path/to/Megatron-LM
    python patches/apply.py diff   /path/to/Megatron-LM   # show, change nothing

Standard library only: it runs with any Python 3.9+, before chameleon_megatron is installed.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import importlib.util
import re
import sys
from pathlib import Path
from typing import Any

SCRIPT = "pretrain_gpt.py"
VERSION_FILE = "megatron/core/package_info.py"
TRAINING = "megatron/training/training.py"
SEAMS_FILE = Path(__file__).resolve().parents[1] / "chameleon_megatron/megatron/lm_seams.py"
"""The layouts of the seams the hook binds (loaded alone, standard library only: this script
runs before chameleon_megatron is installed)."""

BEGIN = "# >>> chameleon-megatron (patches/apply.py) >>>"
END = "# <<< chameleon-megatron <<<"
BLOCK = (
    BEGIN,
    "from chameleon_megatron.megatron_lm import wrap_pretrain as _chameleon_wrap",
    "pretrain = _chameleon_wrap(pretrain)",
    END,
)
MAIN_GUARD = re.compile(r"""^if __name__ == ["']__main__["']:\s*$""")
CALL = re.compile(r"^[ \t]+pretrain\(\s*$")


class PatchError(Exception):
    """The checkout cannot be patched; the message says why and what was expected."""


def megatron_version(checkout: Path) -> tuple[int, int, int]:
    """(major, minor, patch) read from the checkout's package_info.py, without importing it."""
    path = checkout / VERSION_FILE
    if not path.is_file():
        raise PatchError(f"{checkout}: no {VERSION_FILE}; is this a Megatron-LM checkout?")
    text = path.read_text()
    parts = []
    for name in ("MAJOR", "MINOR", "PATCH"):
        match = re.search(rf"^{name}\s*=\s*(\d+)", text, re.MULTILINE)
        if match is None:
            raise PatchError(f"{path}: no '{name} = <int>' line; unknown Megatron-LM layout")
        parts.append(int(match.group(1)))
    return parts[0], parts[1], parts[2]


def _seams() -> Any:
    spec = importlib.util.spec_from_file_location("chameleon_lm_seams", SEAMS_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _module_file(checkout: Path, module: str) -> Path | None:
    base = checkout.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _function_params(checkout: Path, path: Path, name: str,
                     hops: int = 4) -> tuple[str, ...] | None:
    """Parameter names of the function ``name`` defined in, or imported into, the module
    at ``path`` (followed through ``from X import name`` up to ``hops`` times), read from
    the source; None where it is not found."""
    package = path.parent.relative_to(checkout).parts
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            a = node.args  # in inspect.signature's order
            return tuple(x.arg for x in (*a.posonlyargs, *a.args, a.vararg, *a.kwonlyargs,
                                         a.kwarg) if x is not None)
        if isinstance(node, ast.ImportFrom) and hops and any(
                (x.asname or x.name) == name for x in node.names):
            (alias,) = [x for x in node.names if (x.asname or x.name) == name]
            parts = list(package[:len(package) - node.level + 1]) if node.level else []
            source = _module_file(checkout, ".".join([*parts, *(node.module or "").split(".")]
                                                     ).strip("."))
            if source is not None:
                return _function_params(checkout, source, alias.name, hops - 1)
    return None


def seam_params(checkout: Path, names: tuple[str, ...]) -> dict[str, tuple[str, ...] | None]:
    """Seam name -> its parameter names, as megatron/training/training.py binds it (defined
    there or imported), read from the checkout's source: nothing is imported."""
    path = checkout / TRAINING
    if not path.is_file():
        raise PatchError(f"{checkout}: no {TRAINING}; is this a Megatron-LM checkout?")
    return {name: _function_params(checkout, path, name) for name in names}


def check_layout(checkout: Path) -> str:
    """The known layout the checkout's seams have (lm_seams.LAYOUTS), whatever its version."""
    version = ".".join(map(str, megatron_version(checkout)))
    seams = _seams()
    try:
        return seams.match_layout(version, seam_params(checkout, seams.SEAMS))
    except seams.UnsupportedMegatron as exc:
        raise PatchError(str(exc)) from None


def _lines(text: str) -> list[str]:
    return text.splitlines(keepends=True)


def _newline(text: str) -> str:
    return "\r\n" if "\r\n" in text else "\n"


def _block_span(lines: list[str]) -> tuple[int, int] | None:
    """[start, end) of the inserted block, or None when the file is not patched."""
    starts = [i for i, line in enumerate(lines) if line.strip() == BEGIN]
    ends = [i for i, line in enumerate(lines) if line.strip() == END]
    if not starts and not ends:
        return None
    if len(starts) != 1 or len(ends) != 1 or ends[0] < starts[0]:
        raise PatchError(
            f"found {len(starts)} begin and {len(ends)} end markers of the chameleon block; "
            "expected one of each in order: fix the file by hand or restore it from git"
        )
    return starts[0], ends[0] + 1


def _insertion_point(lines: list[str]) -> tuple[int, str]:
    """Index of the first line of the __main__ block and its indentation, once the layout is
    known: one __main__ guard and, after it, one ``pretrain(`` call (the name we rebind)."""
    guard = [i for i, line in enumerate(lines) if MAIN_GUARD.match(line)]
    if len(guard) != 1:
        raise PatchError(f"expected one 'if __name__ == \"__main__\":' line, found {len(guard)}")
    body = guard[0] + 1
    calls = [line for line in lines[body:] if CALL.match(line)]
    if len(calls) != 1:
        raise PatchError(
            f"expected one line 'pretrain(' in the __main__ block of {SCRIPT}, found {len(calls)}; "
            "unknown Megatron-LM layout"
        )
    first = next(line for line in lines[body:] if line.strip())
    return body, first[: len(first) - len(first.lstrip())]


def unpatched(text: str) -> str:
    """``text`` without the chameleon block (unchanged when it has none)."""
    lines = _lines(text)
    span = _block_span(lines)
    if span is None:
        return text
    return "".join(lines[:span[0]] + lines[span[1]:])


def patched(text: str) -> str:
    """``text`` with the current chameleon block at the top of the __main__ block."""
    lines = _lines(unpatched(text))
    index, indent = _insertion_point(lines)
    newline = _newline(text)
    block = [f"{indent}{line}{newline}" for line in BLOCK]
    return "".join(lines[:index] + block + lines[index:])


def _script(checkout: Path) -> Path:
    path = checkout / SCRIPT
    if not path.is_file():
        raise PatchError(f"{checkout}: no {SCRIPT}; is this a Megatron-LM checkout?")
    return path


def _read(path: Path) -> str:
    with path.open(newline="") as f:  # keep \r\n as is
        return f.read()


def _write(path: Path, text: str) -> None:
    with path.open("w", newline="") as f:
        f.write(text)


def apply(checkout: Path) -> bool:
    """Insert (or refresh) the block; True when the file changed."""
    check_layout(checkout)
    path = _script(checkout)
    old = _read(path)
    new = patched(old)
    if new != old:
        _write(path, new)
    return new != old


def remove(checkout: Path) -> bool:
    """Delete the block (any Megatron-LM version); True when the file changed."""
    path = _script(checkout)
    old = _read(path)
    new = unpatched(old)
    if new != old:
        _write(path, new)
    return new != old


def status(checkout: Path) -> str:
    """'patched', 'outdated' (an older block) or 'unpatched'."""
    text = _read(_script(checkout))
    if _block_span(_lines(text)) is None:
        return "unpatched"
    return "patched" if patched(text) == text else "outdated"


def diff(checkout: Path) -> str:
    """Unified diff that ``apply`` would make."""
    check_layout(checkout)
    old = _read(_script(checkout))
    return "".join(difflib.unified_diff(
        _lines(old), _lines(patched(old)), f"a/{SCRIPT}", f"b/{SCRIPT}"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("apply", "remove", "status", "diff"))
    parser.add_argument("checkout", type=Path, help="root of the Megatron-LM checkout")
    args = parser.parse_args(argv)
    try:
        if args.action == "apply":
            changed = apply(args.checkout)
            print(f"{args.checkout / SCRIPT}: {'patched' if changed else 'already patched'}")
        elif args.action == "remove":
            changed = remove(args.checkout)
            print(f"{args.checkout / SCRIPT}: {'restored' if changed else 'was not patched'}")
        elif args.action == "status":
            print(status(args.checkout))
        else:
            sys.stdout.write(diff(args.checkout))
    except PatchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
