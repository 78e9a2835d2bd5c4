"""Policy generator on a real step's profile: planning time and distance to the optimum.

Profiles one step of the GPT-like model of ``bench_swap_profiler.py`` run with a 1F1B-like
order (``--in-flight`` microbatches forward before the first backward, then alternating),
then plans it for a range of budgets and bandwidths. For each: the plan's swapped bytes,
the lower bound from the linear relaxation (no plan swaps fewer), the expected stall and
the planning time; with ``--exact``, also what HiGHS's 0-1 solver reaches in its limit.

    python scripts/bench_swap_policy.py [--layers 8 --microbatches 8 --in-flight 4]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from bench_swap_profiler import Model
from chameleon_megatron.swap.copier import SyncCopier
from chameleon_megatron.swap.cover import exact_cover
from chameleon_megatron.swap.executor import SwapExecutor
from chameleon_megatron.swap.hostpool import HostPool
from chameleon_megatron.swap.policy import generate_policy, min_feasible_budget
from chameleon_megatron.megatron.swap_seams import LayerHooks
from chameleon_megatron.swap.stage import StageTracker
from chameleon_megatron.swap.windows import candidate_windows, resident_curve


def profile_step(a: argparse.Namespace):
    torch.manual_seed(0)
    model = Model(512, a.hidden, a.heads, a.layers)
    batch = [torch.randint(0, 512, (a.micro_batch, a.seq + 1)) for _ in range(a.microbatches)]
    tracker = StageTracker()
    LayerHooks(tracker, ((lyr, n + 1) for n, lyr in enumerate(model.layers)))
    ex = SwapExecutor(tracker, copier=SyncCopier(), pool=HostPool(pin=False, cache_bytes=0),
                      min_bytes=1 << 62, exclude=list(model.parameters()))
    order = [("F", i) for i in range(a.in_flight)]
    order += [x for i in range(a.in_flight, a.microbatches)
              for x in (("F", i), ("B", i - a.in_flight))]
    order += [("B", i) for i in range(a.microbatches - a.in_flight, a.microbatches)]
    losses = {}
    ex.begin_step(profile="full")
    with ex.hooks():
        for phase, i in order:
            if phase == "F":
                with tracker.forward(i):
                    tokens = batch[i]
                    losses[i] = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1),
                                                tokens[:, 1:].flatten())
            else:
                with tracker.backward(i):
                    losses.pop(i).backward()
    return ex.recorder.finish(tracker.segments, ex.op_names, tracker.signature())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--in-flight", type=int, default=4)
    ap.add_argument("--min-bytes", type=int, default=1 << 16)
    ap.add_argument("--exact", action="store_true", help="also run the 0-1 solver (slow)")
    ap.add_argument("--exact-limit-s", type=float, default=20.0)
    a = ap.parse_args()
    torch.set_num_threads(1)
    profile = profile_step(a)
    resident = resident_curve(profile)
    peak, floor = int(resident.max()), min_feasible_budget(profile, a.min_bytes)
    step_s = profile.event_times[-1]
    print(f"profile: {len(profile.records)} storages, {profile.num_events} events, peak "
          f"{peak / 2**20:.2f} MiB, least achievable budget {floor / 2**20:.2f} MiB, "
          f"{step_s:.2f} s of compute")
    print(f"{'budget':>8} {'GB/s':>6} {'swapped MiB':>11} {'bound MiB':>9} {'gap %':>6} "
          f"{'stall s':>7} {'plan ms':>7}" + ("  exact MiB (s)" if a.exact else ""))
    for fraction in (0.9, 0.7, 0.5, 0.3):
        budget = max(int(fraction * peak), floor)
        for gbps in (float("inf"), 1.0, 0.1):
            start = time.process_time()
            plan = generate_policy(profile, budget_bytes=budget, bandwidth_bps=gbps * 1e9,
                                 min_bytes=a.min_bytes)
            ms = 1e3 * (time.process_time() - start)
            gap = 100 * (plan.planned_out_bytes / plan.lower_bound_bytes - 1) \
                if plan.lower_bound_bytes else 0.0
            row = (f"{fraction:>7.0%} {gbps:>6} {plan.planned_out_bytes / 2**20:>11.2f} "
                   f"{plan.lower_bound_bytes / 2**20:>9.2f} {gap:>6.2f} "
                   f"{plan.expected_stall_s:>7.3f} {ms:>7.1f}")
            if a.exact and gbps == float("inf"):
                windows = candidate_windows(profile, a.min_bytes, float("inf"))
                start = time.perf_counter()
                chosen, optimal = exact_cover(windows, resident - budget, a.exact_limit_s)
                took = time.perf_counter() - start
                got = "none" if chosen is None else f"{windows.nbytes[chosen].sum() / 2**20:.2f}"
                row += f"  {got} ({took:.1f}{', optimal' if optimal else ''})"
            print(row)


if __name__ == "__main__":
    main()
