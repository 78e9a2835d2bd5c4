"""The job store: the agent-hosted key-value store that outlives every worker.

torch.distributed.elastic's agent (node 0's, for a multi-node job) hosts the TCP store the
workers reach at MASTER_ADDR:MASTER_PORT. Worker 0 does not host it, so a worker's death
cannot take it down; agents and workers of the resilience runtime meet there under
``chameleon/<run id>/``: failure announcements, heartbeats, survivor rendezvous.
"""

from __future__ import annotations

import datetime
import os

import torch.distributed as dist

from chameleon_megatron.resilience.store.env import AGENT_ENV


class JobStore:
    """A namespaced view of the job store, shared by agents and workers of one run."""

    def __init__(self, store: dist.Store, run_id: str, port: int | None = None) -> None:
        self.run_id = run_id
        self.store = dist.PrefixStore(f"chameleon/{run_id}/", store)
        self.port = port
        """The server's TCP port (None: an in-process store)."""

    @classmethod
    def connect(cls, host: str, port: int, run_id: str, timeout_s: float = 60.0) -> JobStore:
        """A client connection to the job store's server."""
        client = dist.TCPStore(host, port, is_master=False,
                               timeout=datetime.timedelta(seconds=timeout_s))
        return cls(client, run_id, port)

    @classmethod
    def from_env(cls, timeout_s: float = 60.0) -> JobStore:
        """The job store of a worker started by the chameleon-run agent."""
        if os.environ.get(AGENT_ENV) != "1":
            raise RuntimeError(
                "--chameleon-ft needs the chameleon-run launcher (python -m "
                "chameleon_megatron.run), whose agent keeps survivors alive; plain torchrun "
                "kills every worker when one fails"
            )
        return cls.connect(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                           os.environ["TORCHELASTIC_RUN_ID"], timeout_s)

    def scoped(self, name: str) -> dist.PrefixStore:
        """A sub-namespace, e.g. one per rendezvous generation."""
        return dist.PrefixStore(f"{name}/", self.store)

    def counter(self, key: str) -> int:
        """Current value of an ``add`` counter (0 when unset), without blocking."""
        return int(self.store.add(key, 0))

    def mark_done(self) -> None:
        """The job finished training: spares and agents may stop."""
        self.store.set("done", "1")

    def is_done(self) -> bool:
        return self.store.check(["done"])

    def mark_failed(self, reason: str) -> None:
        """The job cannot go on (a recovery failed on its members): nobody is restarted or
        admitted any more, and a joiner still waiting leaves with ``reason``."""
        self.store.set("failed", reason)

    def failure(self) -> str | None:
        """Why the job cannot go on (``mark_failed``); None while it can."""
        return self.store.get("failed").decode() if self.store.check(["failed"]) else None
