"""A checkpoint's files are whole before anything is read from them.

torch's distributed checkpoint records, for every stored item, the file it lives in and its
byte range (``.metadata``). A shard cut short by a full disk or an interrupted copy would
otherwise surface as an ``EOFError`` from torch's unpickler deep inside megatron's load; here
it is one line naming the file, its size against what the metadata needs, and the iteration
directory.
"""

from __future__ import annotations

import contextlib
import pickle
from pathlib import Path
from typing import Iterator

from torch.distributed.checkpoint import FileSystemReader

from chameleon_megatron.configurable import ConfigError

SHORT = (EOFError, pickle.UnpicklingError)
"""What torch's unpickler raises on a file cut short or overwritten."""
UNREADABLE = (*SHORT, OSError, ValueError, KeyError, RuntimeError)
"""What reading a small metadata file (pickled, or a zip archive) raises when damaged."""


def required_sizes(path: Path) -> dict[str, int]:
    """file name -> the bytes the checkpoint's metadata says it holds at least."""
    with damaged(path, ".metadata"):
        metadata = FileSystemReader(str(path)).read_metadata()
    need: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = info.offset + info.length
        need[info.relative_path] = max(need.get(info.relative_path, 0), end)
    return need


def check_files(path: Path) -> None:
    """ConfigError naming the first file of the checkpoint at ``path`` that is missing or
    shorter than its metadata says."""
    for name, size in sorted(required_sizes(path).items()):
        file = path / name
        if not file.is_file():
            raise ConfigError(f"checkpoint {path}: {name} is missing (the metadata names it)")
        have = file.stat().st_size
        if have < size:
            raise ConfigError(f"checkpoint {path}: {name} is truncated ({have} bytes, the "
                              f"metadata needs {size})")


@contextlib.contextmanager
def damaged(path: Path, what: str,
            errors: tuple[type[BaseException], ...] = UNREADABLE) -> Iterator[None]:
    """``errors`` raised reading ``what`` in the checkpoint at ``path`` become one ConfigError
    line."""
    if not path.is_dir():
        raise ConfigError(f"checkpoint {path}: no such directory (named by the tracker file)")
    try:
        yield
    except ConfigError:
        raise
    except errors as exc:
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"checkpoint {path}: {what} is unreadable ({detail})") from exc
