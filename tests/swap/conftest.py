"""Fixtures for the swap tests: megatron-core on CPU in this process (gloo, world size 1)."""

from __future__ import annotations

import datetime

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
    import torch.distributed as dist
    from megatron.core import parallel_state
    from chameleon_megatron.megatron.platform import CpuPlatform
    from chameleon_megatron.megatron.te_absent import TeAbsentPatch
    from chameleon_megatron.training.distributed import free_port

    platform = CpuPlatform()
    platform.apply()
    te_absent = TeAbsentPatch()
    te_absent.apply()
    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                world_size=1, timeout=datetime.timedelta(minutes=1))
    parallel_state.initialize_model_parallel(1, 1)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        if own_group:
            dist.destroy_process_group()
        te_absent.remove()
        platform.remove()
