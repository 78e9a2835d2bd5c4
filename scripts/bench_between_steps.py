"""Cost of the recovery controller's check between two steps, with nothing to do: each rank
reads how many workers queued to join (a job-store read) and all ranks agree in one
two-element all-reduce (``controller.between_steps``).

    python -m torch.distributed.run --standalone --nproc-per-node 8 scripts/bench_between_steps.py
"""

from __future__ import annotations

import datetime
import os
import time

import torch
import torch.distributed as dist

from chameleon_megatron.resilience.store.job_store import JobStore
from chameleon_megatron.resilience.store.join_queue import JoinQueue


def check(queue: JoinQueue) -> None:
    flags = torch.tensor([queue.waiting(), 0], dtype=torch.int64)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    queue.take(int(flags[0]))


def main(steps: int = 500) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    job = JobStore.connect(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), "bench")
    queue = JoinQueue(job)
    for _ in range(50):  # warm-up: connections
        check(queue)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        check(queue)
    seconds = (time.perf_counter() - start) / steps
    if dist.get_rank() == 0:
        print(f"between-steps check: {seconds * 1e3:.3f} ms per step "
              f"({dist.get_world_size()} gloo ranks, {steps} steps)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
