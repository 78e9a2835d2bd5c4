"""The write results a checkpoint save leaves behind when a failure interrupts it.

megatron-core's filesystem writer (``dist_checkpointing.strategies.filesystem_async``, 0.16
and 0.19) passes a save's write results from its writer processes back through one queue per
process, a module global, and reads them in the save's finalization. A synchronous save
writes, waits in a barrier, then finalizes: when a peer dies in between, the barrier fails
and the results stay queued. The next save of this process, the redo of that save, then
reads them as its own: it fails ("Incomplete worker results") where the numbers of files
differ, and otherwise writes metadata that points into the abandoned save's files, a
checkpoint that cannot be loaded. A rank that abandons a step drops them first.
"""

from __future__ import annotations

import queue
from types import ModuleType

from megatron.core.dist_checkpointing.strategies import filesystem_async

QUEUE = "_results_queue"
"""The module global holding the queue (None until the first save); ``check_write_queue``."""


def check_write_queue(module: ModuleType = filesystem_async) -> None:
    """Fail at start, not in a recovery, where megatron-core keeps the results elsewhere."""
    if not hasattr(module, QUEUE):
        raise RuntimeError(f"{module.__name__} has no {QUEUE}: this megatron-core keeps "
                           "checkpoint write results where chameleon cannot drop a failed "
                           "save's (checked on 0.16 and 0.19)")


def drop_abandoned_writes(module: ModuleType = filesystem_async) -> int:
    """Empty the queue; returns how many saves' results were in it. A queue whose manager
    process is gone is forgotten: megatron makes a new one at the next save."""
    results = getattr(module, QUEUE)
    dropped = 0
    while results is not None:
        try:
            results.get_nowait()
        except queue.Empty:
            break
        except (OSError, EOFError):
            setattr(module, QUEUE, None)
            break
        dropped += 1
    return dropped
