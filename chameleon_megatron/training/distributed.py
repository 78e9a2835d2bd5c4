"""Where this rank trains and how it seeds: the device, megatron's seeding per stage.

Process groups are built in ``chameleon_megatron.megatron.groups``.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state, tensor_parallel

from chameleon_megatron.training.env import DistEnv


def device_for(env: DistEnv) -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(env.local_rank)
        return torch.device("cuda", env.local_rank)
    return torch.device("cpu")


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
