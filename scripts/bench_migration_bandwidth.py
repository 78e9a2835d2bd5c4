"""State migration against the transport's own limit, by state size, in one run.

Two processes on one gloo group (loopback TCP, this machine). For each size S:

- **limit**: the same S bytes sent from rank 0 to rank 1 as contiguous messages of 4 MiB,
  then of 64 MiB (all posted at once), the faster of the two: what the transport does;
- **per tensor**: the state's own tensors sent one message each, all posted at once: what
  the transport does with messages of the state's sizes, with no packing;
- **migrate**: ``recovery.transfer.migrate`` moving a state of S bytes from rank 0 to
  rank 1, made like a transformer's: units of a few layers' weights and Adam moments
  (tensors of 4H x H, 3H x H, H x H and H, fp32; H = 128 by default: 2.25 MiB a
  unit), with its checks and votes.

Each is timed ``--repeat`` times; the medians are printed with migrate / limit. Target
(issue 29): >= 0.7 for states of 256 MiB and more.

    python scripts/bench_migration_bandwidth.py                    # 16 64 256 1024 MiB
    python scripts/bench_migration_bandwidth.py --sizes-mib 256 --repeat 5
    python scripts/bench_migration_bandwidth.py --built-on-read   # units rebuilt on each read
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from chameleon_megatron.resilience.decision.restorer import Transfer  # noqa: E402
from chameleon_megatron.resilience.recovery.transfer import migrate  # noqa: E402

MIB = 1 << 20
CHUNKS = (4 * MIB, 64 * MIB)


class Units:
    """``units`` state units, each a layer's weights (params) and two Adam moments
    (optimizer), filled with ``value``."""

    def __init__(self, units: int, value: float, hidden: int) -> None:
        h = hidden
        shapes = {"fc1": (4 * h, h), "fc2": (h, 4 * h), "qkv": (3 * h, h), "proj": (h, h),
                  "norm": (h,)}
        self.state = {
            (u, kind): {f"{n}/{k}": torch.full(s, value) for n, s in shapes.items()
                        for k in (("w",) if kind == "params" else ("exp_avg", "exp_avg_sq"))}
            for u in range(units) for kind in ("params", "optimizer")}

    def tensors(self, unit: int, kind: str) -> dict[str, torch.Tensor]:
        return self.state[(unit, kind)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in self.state.values() for t in d.values())


class BuiltOnRead(Units):
    """Old state whose every read builds the unit anew (a copy of each tensor), as units
    assembled from the distributed optimizer's shard copies are; the checks read specs."""

    def specs(self, unit: int, kind: str) -> dict[str, tuple[list[int], str]]:
        return {n: (list(t.shape), str(t.dtype)) for n, t in self.state[(unit, kind)].items()}

    def tensors(self, unit: int, kind: str) -> dict[str, torch.Tensor]:
        return {n: t.clone() for n, t in self.state[(unit, kind)].items()}


def unit_bytes(hidden: int) -> int:
    return Units(1, 0.0, hidden).nbytes


def send_all_s(rank: int, bufs: list[torch.Tensor]) -> float:
    """Rank 0 sends ``bufs`` to rank 1, one message each, all posted at once."""
    dist.barrier()
    start = time.perf_counter()
    works = [dist.isend(b, 1) if rank == 0 else dist.irecv(b, 0) for b in bufs]
    for w in works:
        w.wait()
    dist.barrier()
    return time.perf_counter() - start


def limit_s(rank: int, nbytes: int) -> float:
    """The fastest of sending ``nbytes`` as messages of each size in ``CHUNKS``."""
    return min(send_all_s(rank, [torch.empty(min(chunk, nbytes - at) // 4)
                                 for at in range(0, nbytes, chunk)]) for chunk in CHUNKS)


def per_tensor_s(rank: int, units: int, hidden: int) -> float:
    """The state's tensors (rank 1: a second state) sent one message each, all at once."""
    return send_all_s(rank, [t for d in Units(units, float(rank == 0), hidden).state.values()
                             for t in d.values()])


def migrate_s(rank: int, units: int, hidden: int, store: dist.Store,
              trial: int, built: bool) -> tuple[float, bool]:
    old = (BuiltOnRead if built else Units)(units, 1.0 if rank == 0 else 0.0, hidden)
    new = Units(units, 0.0, hidden)
    transfers = [Transfer(0, 1, u, kind, 0.0) for u in range(units)
                 for kind in ("params", "optimizer")]
    dist.barrier()
    start = time.perf_counter()
    migrate(dist.group.WORLD, [0, 1], rank, transfers, old=old, new=new,
            store=dist.PrefixStore(f"m{trial}/", store), timeout_s=600)
    took = time.perf_counter() - start
    ok = rank == 0 or all(bool((t == 1.0).all()) for d in new.state.values()
                          for t in d.values())
    return took, ok


def worker(rank: int, port: int, sizes: list[int], repeat: int, hidden: int, built: bool,
           out: mp.Queue) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0,
                          timeout=datetime.timedelta(seconds=600))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    trial = 0
    for size in sizes:
        units = max(1, size * MIB // unit_bytes(hidden))
        nbytes = units * unit_bytes(hidden)
        lim, per, mig = [], [], []
        for _ in range(repeat):
            lim.append(limit_s(rank, nbytes))
            per.append(per_tensor_s(rank, units, hidden))
            took, ok = migrate_s(rank, units, hidden, store, trial, built)
            trial += 1
            assert ok, "migrated state differs"
            mig.append(took)
        if rank == 1:
            out.put((nbytes, *(statistics.median(x) for x in (lim, per, mig))))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[16, 64, 256, 1024])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=128,
                        help="H of the units' tensors (128: 2.25 MiB a unit)")
    parser.add_argument("--built-on-read", action="store_true",
                        help="the sender builds each unit when it reads it (assembled units)")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out: mp.Queue = mp.get_context("spawn").Queue()
    port = 29000 + os.getpid() % 1000
    mp.start_processes(worker, args=(port, args.sizes_mib, args.repeat, args.hidden,
                                     args.built_on_read, out), nprocs=2, start_method="spawn")
    print("| state | limit: contiguous send | per tensor | migrate | migrate / limit | "
          "migrate / per tensor |")
    print("|---|---|---|---|---|---|")
    while not out.empty():
        nbytes, lim, per, mig = out.get()
        rate = [f"{nbytes / s / 1e6:.0f} MB/s" for s in (lim, per, mig)]
        print(f"| {nbytes / MIB:.0f} MiB | {' | '.join(rate)} | {lim / mig:.2f} | "
              f"{per / mig:.2f} |")


if __name__ == "__main__":
    main()
