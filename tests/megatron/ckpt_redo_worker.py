"""One rank saves a checkpoint with megatron's dist_checkpointing, a peer "dies" at the save's
barrier (after the write, before the finalization), and the rank saves again, as the redo
after a recovery does; then loads what the redo wrote. ``--no-drop``: without
``drop_abandoned_writes`` between the two (megatron's behaviour, which the redo trips on).

usage: ckpt_redo_worker.py DIR {fewer,same} [--no-drop]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedTensor

from chameleon_megatron.megatron.ckpt_writes import drop_abandoned_writes
from chameleon_megatron.megatron.platform import CpuPlatform

REDO = {
    # The interrupted save wrote one file, the redo writes two (another layout's share).
    "fewer": {"x": torch.arange(4.0), "y": torch.arange(3.0) + 10},
    # The same number of files with other sizes: megatron's redo "succeeds".
    "same": {"x": torch.arange(32.0)},
}


def _sharded(tensors: dict[str, torch.Tensor]) -> dict[str, ShardedTensor]:
    return {k: ShardedTensor.from_rank_offsets(k, t, replica_id=0) for k, t in tensors.items()}


def _save_cut_off_at_barrier(path: Path) -> None:
    barrier = dist.barrier

    def peer_died(*args, **kwargs):
        if sys._getframe(1).f_code.co_name == "execute_sync":  # after the write
            raise RuntimeError("peer died")
        return barrier(*args, **kwargs)

    dist.barrier = peer_died
    try:
        dist_checkpointing.save(_sharded({"x": torch.ones(4)}), str(path))
    except RuntimeError as exc:
        assert "peer died" in str(exc), exc
    else:
        raise AssertionError("the save was not cut off")
    finally:
        dist.barrier = barrier


def main(root: Path, case: str, drop: bool) -> None:
    CpuPlatform().apply()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    (root / "cut").mkdir()
    (root / "redo").mkdir()
    _save_cut_off_at_barrier(root / "cut")
    if drop:
        print(f"dropped {drop_abandoned_writes()}", flush=True)
    redo = REDO[case]
    dist_checkpointing.save(_sharded(redo), str(root / "redo"))
    loaded = dist_checkpointing.load(_sharded({k: torch.zeros_like(t) for k, t in redo.items()}),
                                     str(root / "redo"))
    for k, t in redo.items():
        assert torch.equal(loaded[k], t), (k, loaded[k], t)
    print("redo loaded", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], "--no-drop" not in sys.argv)
