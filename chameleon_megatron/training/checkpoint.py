"""Checkpoints through megatron.core.dist_checkpointing, loadable into another TP/PP layout.

A checkpoint holds the model and optimizer state keyed by global tensor names (so it
reshards), the LR scheduler, the iteration and consumed samples (the data position), and,
per rank, the RNG states. RNG states are restored only into the layout that saved them;
in a different layout each rank re-seeds (and says so), everything else is exact.

Directory layout (Megatron-LM's): ``<dir>/iter_0000042/`` and
``<dir>/latest_checkpointed_iteration.txt``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedObject

from chameleon_megatron.training.checkpoint_files import SHORT, check_files, damaged
from chameleon_megatron.training.checkpoint_shapes import check_shapes
from chameleon_megatron.training.rng import rng_state, set_rng_state

logger = logging.getLogger(__name__)

TRACKER_FILE = "latest_checkpointed_iteration.txt"
OPT_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


@dataclass(frozen=True)
class Resumed:
    """What a loaded checkpoint says about where training stands."""

    iteration: int
    consumed_samples: int
    rng_restored: bool


def _layout() -> dict[str, int]:
    return {
        "tp": parallel_state.get_tensor_model_parallel_world_size(),
        "pp": parallel_state.get_pipeline_model_parallel_world_size(),
        "dp": parallel_state.get_data_parallel_world_size(),
    }


def _rank_coords() -> tuple[int, int, int]:
    return (parallel_state.get_pipeline_model_parallel_rank(),
            parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_data_parallel_rank())


def _rng_object(layout: dict[str, int]) -> ShardedObject:
    shape = (layout["pp"], layout["tp"], layout["dp"])
    return ShardedObject("rng_state", rng_state(), shape, _rank_coords(), replica_id=0)


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside megatron's DDP wrapper (checkpoint keys carry no 'module.')."""
    return getattr(chunk, "module", chunk)


def _model_state(model: list[torch.nn.Module]) -> dict[str, Any]:
    return {f"model{i}": _unwrap(chunk).sharded_state_dict() for i, chunk in enumerate(model)}


def _sharded_state(model, optimizer, *, is_loading: bool, with_optimizer: bool,
                   rng_layout: dict[str, int] | None) -> dict[str, Any]:
    state = _model_state(model)
    if with_optimizer:
        # The optimizer's entries refer to the model's sharded tensors: build those once.
        state["optimizer"] = optimizer.sharded_state_dict(
            dict(state), is_loading=is_loading, metadata=OPT_METADATA)
    if rng_layout is not None:
        state["rng_state"] = _rng_object(rng_layout)
    return state


def iteration_dir(root: str | Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def save_checkpoint(root: str, model, optimizer, scheduler, *, iteration: int,
                    consumed_samples: int) -> Path:
    """Write a checkpoint of the current step (collective: every rank calls it)."""
    path = iteration_dir(root, iteration)
    if dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    state = _sharded_state(model, optimizer, is_loading=False, with_optimizer=True,
                           rng_layout=_layout())
    state.update(iteration=iteration, consumed_samples=consumed_samples,
                 scheduler=scheduler.state_dict(), layout=_layout())
    dist_checkpointing.save(state, str(path))
    dist.barrier()
    if dist.get_rank() == 0:
        (Path(root) / TRACKER_FILE).write_text(f"{iteration}\n")
        logger.info("saved checkpoint at iteration %d to %s", iteration, path)
    return path


def latest_iteration(root: str | Path) -> int | None:
    tracker = Path(root) / TRACKER_FILE
    if not tracker.exists():
        return None
    return int(tracker.read_text().strip())


def load_checkpoint(root: str, model, optimizer, scheduler, args, *, load_optim: bool = True,
                    load_rng: bool = True) -> Resumed | None:
    """Load the latest checkpoint under ``root`` into the current layout (None: none there);
    ConfigError when its model has other global shapes (``checkpoint_shapes``) or a file is
    missing, short or unreadable (``checkpoint_files``)."""
    iteration = latest_iteration(root)
    if iteration is None:
        logger.warning("no checkpoint found under %s: starting from scratch", root)
        return None
    where = iteration_dir(root, iteration)
    path = str(where)
    check_files(where)
    with damaged(where, "the tensors' metadata"):
        saved = dist_checkpointing.load_tensors_metadata(path)
    check_shapes(saved, _model_state(model), args, root)
    with damaged(where, "the common state (common.pt)"):
        common = dist_checkpointing.load_common_state_dict(path)
    same_layout = common.get("layout") == _layout()
    restore_rng = load_rng and same_layout
    state = _sharded_state(model, optimizer, is_loading=True, with_optimizer=load_optim,
                           rng_layout=_layout() if restore_rng else None)
    with damaged(where, "a tensor shard", SHORT):
        loaded = dist_checkpointing.load(state, path)
    for i, chunk in enumerate(model):
        _unwrap(chunk).load_state_dict(loaded[f"model{i}"])
    if load_optim:
        optimizer.load_state_dict(loaded["optimizer"])
        scheduler.load_state_dict(common["scheduler"])
    if restore_rng:
        set_rng_state(loaded["rng_state"])
    elif load_rng:
        logger.info("checkpoint layout %s differs from %s: RNG states re-seeded",
                    common.get("layout"), _layout())
    logger.info("loaded checkpoint of iteration %d from %s", iteration, path)
    return Resumed(iteration=common["iteration"], consumed_samples=common["consumed_samples"],
                   rng_restored=restore_rng)
