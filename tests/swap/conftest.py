"""Fixtures for the swap tests: megatron-core on CPU in this process (gloo, world size 1)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run faster and steadier on one intra-op thread on a shared 2-core host."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def mcore():
    """Platform patches, a one-process gloo group and megatron's parallel state."""
    from mcore_env import mcore_process

    with mcore_process():
        yield
