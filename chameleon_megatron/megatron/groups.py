"""The one place that builds and tears down process groups (torch.distributed and megatron's).

Recovery rebuilds groups in-process: the old world (with a dead member) is destroyed, the
survivors start a new one on a fresh prefix of the job store, and megatron's parallel state is
rebuilt for the new layout. The recovery group, over all survivors including spares, carries
state transfers and votes; it is built here too but kept out of torch.distributed's registry,
so that megatron's world (active ranks only) is unaffected by it.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket

import torch.distributed as dist
from megatron.core import parallel_state

from chameleon_megatron.megatron import torch_seams

logger = logging.getLogger(__name__)


def _timedelta(seconds: float) -> datetime.timedelta:
    if seconds <= 0:
        raise ValueError(f"process-group timeout={seconds} s: must be > 0")
    return datetime.timedelta(seconds=seconds)


def init_world(store: dist.Store, rank: int, world_size: int, *, backend: str,
               timeout_s: float) -> None:
    """torch.distributed's default group over ``world_size`` ranks meeting on ``store``."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank}: must be in [0, {world_size})")
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=_timedelta(timeout_s))


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_from_launcher(*, rank: int, world_size: int, backend: str, timeout_s: float) -> None:
    """torch.distributed's default group as torchrun describes it (MASTER_ADDR/PORT in the
    environment); without a launcher, a world of one process on a private loopback port."""
    if dist.is_initialized():
        return
    if "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=_timedelta(timeout_s))
    else:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}",
                                rank=rank, world_size=world_size, timeout=_timedelta(timeout_s))


def build_uniform(tp: int, pp: int, *, timeout_s: float, vpp: int | None = None) -> None:
    """Megatron's parallel state for a uniform TP x PP x DP layout over the current world."""
    world = dist.get_world_size()
    if tp < 1 or pp < 1 or world % (tp * pp):
        raise ValueError(f"layout tp={tp} x pp={pp}: must divide the world size {world}")
    _timedelta(timeout_s)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        distributed_timeout_minutes=timeout_s / 60.0,  # megatron passes it to timedelta(minutes=)
    )


def data_parallel_gloo() -> dist.ProcessGroup:
    """This rank's data-parallel group (with context parallelism) of megatron's parallel
    state, over gloo: host-memory copies travel there whatever the device backend."""
    return parallel_state.get_data_parallel_group_gloo(with_context_parallel=True)


def destroy() -> None:
    """Tear down megatron's parallel state and the default group. With NCCL this waits for
    the work queued on each communicator: after a failure, leave through
    ``teardown.Teardown.leave``, which aborts them first. Megatron's state is reset even
    when its groups are not all set (a layout megatron cannot express leaves some, and the
    global memory buffer, behind): the next uniform layout's initialization refuses anything
    left over."""
    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def set_timeouts(timeout_s: float) -> int:
    """Apply a new collective timeout to every registered group; returns how many."""
    delta = _timedelta(timeout_s)
    groups = torch_seams.registered_groups()
    for group in groups:
        group.set_timeout(delta)
    return len(groups)


def current_timeout(group: dist.ProcessGroup | None = None) -> datetime.timedelta:
    """The collective timeout ``group`` (default: the world's) has now. gloo's point-to-point
    waits keep the timeout the group was created with unless given this one explicitly."""
    return torch_seams.group_timeout(group or dist.group.WORLD)


def unregistered_gloo_group(store: dist.Store, rank: int, size: int, *,
                            timeout_s: float) -> dist.ProcessGroupGloo:
    """A gloo group over all survivors, outside torch.distributed's registry (point-to-point
    ``send``/``recv`` and ``allreduce`` on the object itself)."""
    if not 0 <= rank < size:
        raise ValueError(f"rank={rank}: must be in [0, {size})")
    return dist.ProcessGroupGloo(store, rank, size, _timedelta(timeout_s))


def new_groups(rank_lists: list[tuple[int, ...]], *, timeout_s: float,
               backend: str | None = None) -> list[dist.ProcessGroup | None]:
    """One group per list of world ranks, for layouts megatron's parallel state cannot
    express (heterogeneous pipelines, rerouting). torch requires every rank of the world to
    create every group, in the same order; the result holds this rank's handle for the groups
    it belongs to and None for the others. ``backend``: the world's unless given."""
    delta = _timedelta(timeout_s)
    me = dist.get_rank()
    handles: list[dist.ProcessGroup | None] = []
    for ranks in rank_lists:
        group = dist.new_group(list(ranks), timeout=delta, backend=backend)
        handles.append(group if me in ranks else None)
    return handles
