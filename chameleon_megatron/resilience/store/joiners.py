"""Identities of restarted workers (joiners): a new launch-rank id, never reused in the job.

An agent that restarts a failed worker gives the new process the old one's command line and
environment plus ``CHAMELEON_FT_JOIN_ID``: its launch-rank id, the launch's world size plus a
job-wide counter, so ids from every agent of every node are distinct and never collide with
the ranks of the original launch. The worker takes that id instead of ``RANK`` and asks to be
admitted at the job's next step boundary.
"""

from __future__ import annotations

import os

from chameleon_megatron.resilience.store.env import JOIN_ENV
from chameleon_megatron.resilience.store.job_store import JobStore

_COUNTER = "join/next"


def allocate_join_id(job: JobStore, launch_world_size: int) -> int:
    """A launch-rank id no other process of the job has or will get."""
    if launch_world_size < 1:
        raise ValueError(f"launch_world_size={launch_world_size}: must be >= 1")
    return launch_world_size + job.store.add(_COUNTER, 1) - 1


def join_id_from_env() -> int | None:
    """This process's join id; None when it was started by the launch, not as a restart."""
    text = os.environ.get(JOIN_ENV)
    if text is None:
        return None
    try:
        join_id = int(text)
    except ValueError:
        raise ValueError(f"{JOIN_ENV}={text!r}: must be an integer") from None
    if join_id < 1:  # ids start at the launch's world size, which is >= 1
        raise ValueError(f"{JOIN_ENV}={text!r}: must be >= 1")
    return join_id
