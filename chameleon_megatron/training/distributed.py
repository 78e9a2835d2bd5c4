"""Process-group start-up for the trainer: torch.distributed, then megatron's parallel state.

Reads the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT);
without it, runs as a single process on a private loopback port.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from chameleon_megatron.training.env import DistEnv


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def device_for(env: DistEnv) -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(env.local_rank)
        return torch.device("cuda", env.local_rank)
    return torch.device("cpu")


def init_process_groups(args: argparse.Namespace, env: DistEnv) -> None:
    """Start torch.distributed (if needed) and megatron's model-parallel groups."""
    backend = args.distributed_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    timeout = datetime.timedelta(minutes=args.distributed_timeout_minutes)
    if not dist.is_initialized():
        if "MASTER_ADDR" not in os.environ:
            init = f"tcp://127.0.0.1:{free_port()}"
            dist.init_process_group(backend, init_method=init, rank=env.rank,
                                    world_size=env.world_size, timeout=timeout)
        else:
            dist.init_process_group(backend, rank=env.rank, world_size=env.world_size,
                                    timeout=timeout)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        distributed_timeout_minutes=args.distributed_timeout_minutes,
    )


def seed_everything(seed: int) -> None:
    """Megatron's seeding: the default generator per pipeline stage, plus the TP tracker."""
    stage_seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    torch.manual_seed(stage_seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed(stage_seed)
    tensor_parallel.model_parallel_cuda_manual_seed(stage_seed)


def seed_unplaced(seed: int) -> None:
    """Seeding before this rank's place in a layout is known (a joiner): the streams are
    replaced with a holder's when it gets its stage."""
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, tp_rank=0, ep_rank=0, etp_rank=0)


def shutdown() -> None:
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
