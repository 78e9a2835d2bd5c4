"""The error that ends a job's recovery: raised the same way on every member, so that all
stop instead of retrying (a checkpoint restart is what remains)."""

from __future__ import annotations


class RecoveryFailed(RuntimeError):
    """The job cannot continue in memory or from a checkpoint (said on every member)."""
