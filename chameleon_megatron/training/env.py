"""Where this process sits in the job, read from the torchrun environment (no torch import)."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int


def env_from_torchrun() -> DistEnv:
    """RANK, WORLD_SIZE and LOCAL_RANK as torchrun sets them; one process without them."""
    return DistEnv(
        rank=int(os.environ.get("RANK", 0)),
        world_size=int(os.environ.get("WORLD_SIZE", 1)),
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
    )
