"""Megatron-core on CPU in this process: patches first, then a gloo group of one.

Kept apart from ``mcore.py``, which imports megatron's model code at module level and so
must be imported only once the patches are in place.
"""

from __future__ import annotations

import contextlib
import datetime
from typing import Iterator


@contextlib.contextmanager
def mcore_process() -> Iterator[None]:
    """Platform patches, a one-process gloo group and megatron's parallel state."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from chameleon_megatron.megatron.platform import CpuPlatform
    from chameleon_megatron.megatron.te_absent import TeAbsentPatch
    from chameleon_megatron.megatron.groups import free_port

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
