"""A worker the job went on without: it leaves at once, with one line and a distinct status.

The survivors declare a member failed when it misses a recovery's rendezvous (a rank too
slow, or behind a slow link: ``regroup.suspect``); when it arrives it finds itself outside
the new generation. The job has redone its step without it, so nothing it still holds is
current: it must not unwind into the trainer's end-of-job work (a final checkpoint, the
metrics file, an evaluation), which would write beside the job that goes on. It ends the
process where it learns the verdict, with ``WORKER_LEFT_EXIT``; its agent restarts it
as a joiner when respawns are on, and otherwise stops its node (``agent.py``).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn

from chameleon_megatron.resilience.recovery.regroup import DeclaredFailed
from chameleon_megatron.resilience.store.exits import WORKER_LEFT_EXIT

logger = logging.getLogger(__name__)


def leave_declared_failed(exc: DeclaredFailed, rank: int) -> NoReturn:
    """Log the verdict (a record, then one line for the console) and end the process."""
    logger.error({"event": "declared_failed", "rank": rank, "why": str(exc),
                  "exit": WORKER_LEFT_EXIT})
    print(f"chameleon: error: {exc} (it missed the recovery's rendezvous): the job goes on "
          f"without it; this worker stops and exits ({WORKER_LEFT_EXIT})", file=sys.stderr)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(WORKER_LEFT_EXIT)
